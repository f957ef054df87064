"""vLLM's CPU attention for one decode step of n requests, all decoding one token, against the same step with
some requests verifying one draft token (query length 2): does a drafted step's attention cost more than its
extra query tokens?

[DAS_DTYPE=float32|bfloat16] [DAS_SPLIT_KV=0|1] python attention_cost.py HEADS KV_HEADS CONTEXT REQUESTS[,REQUESTS...] [REPEATS]
  e.g. python attention_cost.py 14 2 600 8,32,64   (Qwen2.5-0.5B's layout: 14 query heads, 2 KV heads, 64 dims)
       python attention_cost.py 9 3 600 8,32,64    (SmolLM2-135M's)
One layer, float32 (DAS_DTYPE: bfloat16 takes vLLM's AMX kernel where the CPU has AMX), 32-token KV blocks (the
engine's on the CPU), KV splitting off (DAS_SPLIT_KV=1: on, vLLM's default); medians in ms of scheduler metadata +
attention.
"""
import os
import statistics
import sys
import time

import torch
from vllm import _custom_ops as ops
from vllm.platforms import current_platform

current_platform.import_kernels()
if torch.cpu._is_amx_tile_supported():
    torch.cpu._init_amx()  # the AMX kernel faults without the tile permission vLLM's worker asks for
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402

heads, kv_heads, context = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
sizes = [int(x) for x in sys.argv[4].split(",")]
repeats = int(sys.argv[5]) if len(sys.argv) > 5 else 31
head_dim, block = 64, 32
dtype = getattr(torch, os.environ.get("DAS_DTYPE", "float32"))
split_kv = os.environ.get("DAS_SPLIT_KV", "0") == "1"
isa = _get_attn_isa(dtype, block, head_dim, "auto")


def step(queries: list[int], cache: torch.Tensor, table: torch.Tensor) -> float:
    """One attention call over requests with the given query lengths, each with `context` tokens before them."""
    n = len(queries)
    start = torch.zeros(n + 1, dtype=torch.int32)
    start[1:] = torch.cumsum(torch.tensor(queries, dtype=torch.int32), 0)
    seq_lens = torch.tensor([context + q for q in queries], dtype=torch.int32)
    tokens = int(start[-1])
    q = torch.randn(tokens, heads, head_dim).to(dtype)
    out = torch.empty_like(q)
    key_cache, value_cache = cache.chunk(2, dim=2)
    t0 = time.perf_counter()
    meta = ops.cpu_attn_get_scheduler_metadata(n, heads, kv_heads, head_dim, seq_lens, dtype, start, True,
                                               -1, isa, split_kv)
    ops.cpu_attention_with_kv_cache(q, key_cache, value_cache, out, start, seq_lens, head_dim ** -0.5, True, None,
                                    -1, table, 0.0, meta, None)
    return time.perf_counter() - t0


for n in sizes:
    per_req = (context + 2 + block - 1) // block
    cache = torch.randn(n * per_req, kv_heads, block * 2, head_dim).to(dtype)
    table = torch.arange(n * per_req, dtype=torch.int32).view(n, per_req)
    shapes = {"plain": [1] * n, "one drafted": [2] + [1] * (n - 1), "all drafted": [2] * n,
              "plain n+1": [1] * (n + 1) if n * per_req else []}
    cache_more = torch.randn((n + 1) * per_req, kv_heads, block * 2, head_dim).to(dtype)
    table_more = torch.arange((n + 1) * per_req, dtype=torch.int32).view(n + 1, per_req)
    times = {k: [] for k in shapes}
    for _ in range(repeats):
        for name, queries in shapes.items():
            if name == "plain n+1":
                times[name].append(step(queries, cache_more, table_more))
            else:
                times[name].append(step(queries, cache, table))
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"{isa} {dtype} split {split_kv} heads {heads}/{kv_heads} context {context} requests {n:3d}: " +
          ", ".join(f"{k} {v:.3f} ms" for k, v in med.items()), flush=True)
