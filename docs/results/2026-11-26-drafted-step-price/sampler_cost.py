"""A drafted step's sampling against a plain step's, as the engine samples (keyed, processed logprobs, the sampled
token's logprob asked for), interleaved in one process so the machine's noise hits every arm alike.

python sampler_cost.py VOCAB REQUESTS[,REQUESTS...] DRAFTED_SHARE [REPEATS]
  e.g. python sampler_cost.py 49152 8,32,64 1.0   (every request drafts one token)
       python sampler_cost.py 49152 8,32,64 0.03  (one request in ~30 drafts: an exploration step)
Arms (medians, ms): `plain`, vLLM's sampler on the requests' rows; `drafted`, the rejection sampler with das's CPU
fixes as installed; `drafted+lsm`, the same with the bonus rows' log-softmax that the keyed sampler took before
2026-11-26 (keyed_sampler.keyed_forward_cpu: the rejection sampler takes the log-softmax of the rows it keeps
anyway). Run with the engine's allocator for the vocabulary (Qwen2.5's 151,936 entries: LD_PRELOAD=ray's
libjemalloc.so, MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1; see service/engine/cpu_allocator.py).
"""
import statistics
import sys
import time

import numpy as np
import torch
from vllm.platforms import current_platform
from vllm.plugins import load_general_plugins

load_general_plugins()  # das's CPU fixes and keyed sampling, as in an engine process
current_platform.register_triton_kernel_overrides()

from vllm.v1.sample.logits_processor import LogitsProcessors  # noqa: E402
from vllm.v1.sample.metadata import SamplingMetadata  # noqa: E402
from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler  # noqa: E402
from vllm.v1.sample.rejection_sampler import RejectionSampler  # noqa: E402
from vllm.v1.sample.sampler import Sampler  # noqa: E402
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata  # noqa: E402

from das.service.engine.keyed_sampler import StepKeys, current_step, keys_of_step  # noqa: E402

vocab, sizes, share = int(sys.argv[1]), [int(x) for x in sys.argv[2].split(",")], float(sys.argv[3])
repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 21
torch.manual_seed(0)
verifier = RejectionSampler(Sampler(logprobs_mode="processed_logprobs"))
installed = TopKTopPSampler.forward_cpu


def with_bonus_log_softmax(self, logits, generators, k, p):
    """The keyed sampler before the change: a drafted step's bonus rows also get their log-softmax."""
    tokens, processed = installed(self, logits, generators, k, p)
    step = current_step()
    if step is not None and step.drafts.any():
        processed = processed.log_softmax(dim=-1, dtype=torch.float32)
    return tokens, processed


def metadata(n: int) -> SamplingMetadata:
    return SamplingMetadata(temperature=torch.full((n,), 0.8), all_greedy=False, all_random=True, top_p=None,
                            top_k=None, generators={}, max_num_logprobs=0, no_penalties=True,
                            prompt_token_ids=None, frequency_penalties=torch.zeros(n),
                            presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n),
                            output_token_ids=[[] for _ in range(n)], allowed_token_ids_mask=None,
                            bad_words_token_ids={}, logitsprocs=LogitsProcessors())


def spec(drafts: list[int]) -> SpecDecodeMetadata:
    tokens = [[int(t) for t in torch.randint(0, vocab, (k,))] for k in drafts]
    out = SpecDecodeMetadata.make_dummy(tokens, torch.device("cpu"))
    ends = np.cumsum([k + 1 for k in drafts])
    out.bonus_logits_indices = torch.tensor(ends - 1, dtype=torch.int32)
    out.target_logits_indices = torch.tensor([e - k - 1 + j for e, k in zip(ends, drafts) for j in range(k)],
                                             dtype=torch.int32)
    return out


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


for n in sizes:
    drafting = max(1, round(share * n))
    drafts = [1] * drafting + [0] * (n - drafting)
    meta, sd = metadata(n), spec(drafts)
    keys = StepKeys(np.arange(1, n + 1, dtype=np.int64) * 7919, np.ones(n, bool), np.full(n, 10, np.int64),
                    np.array(drafts, dtype=np.int64))
    plain_keys = StepKeys(keys.sample_keys, keys.keyed, keys.positions, np.zeros(n, np.int64))
    rows = torch.randn(n + sum(drafts), vocab) * 3
    plain_rows = rows[:n].clone()
    times: dict[str, list[float]] = {"plain": [], "drafted": [], "drafted+lsm": []}
    for _ in range(repeats):
        x = plain_rows.clone()
        with keys_of_step(plain_keys):
            times["plain"].append(timed(lambda: verifier.sampler(x, meta)))
        for name, forward in (("drafted", installed), ("drafted+lsm", with_bonus_log_softmax)):
            TopKTopPSampler.forward_cpu = forward
            x = rows.clone()
            with keys_of_step(keys):
                times[name].append(timed(lambda: verifier(sd, None, x, meta)))
        TopKTopPSampler.forward_cpu = installed
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"vocab {vocab} requests {n:3d} drafting {drafting:3d}: plain {med['plain']:6.2f} ms | drafted "
          f"{med['drafted']:6.2f} ms (+{med['drafted'] - med['plain']:6.2f}), with the bonus log-softmax "
          f"{med['drafted+lsm']:6.2f} ms (+{med['drafted+lsm'] - med['plain']:6.2f})", flush=True)
