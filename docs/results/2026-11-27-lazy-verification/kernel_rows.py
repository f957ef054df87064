"""The cost of one keyed draw per row (vLLM's `fused_gumbel_argmax` through `keyed_tokens`) and of copying half the
rows out (`index_select`, what drawing a subset of rows costs beside the kernel), at SmolLM2's and Qwen2.5's
vocabulary sizes; medians of 7. python kernel_rows.py"""
import time

import torch
from vllm.platforms import current_platform

from das.service.engine.keyed_sampler import keyed_tokens


def median_s(fn) -> float:
    times = []
    for _ in range(7):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[3]


current_platform.import_kernels()
for vocab in (49152, 151936):
    for n in (8, 64, 256):
        x = torch.randn(n, vocab)
        keys = torch.randint(0, 2**62, (n,), dtype=torch.int64)
        keyed_tokens(x, keys)
        rows = torch.arange(0, n, 2)
        draw, copy = median_s(lambda: keyed_tokens(x, keys)), median_s(lambda: x.index_select(0, rows))
        print(f"vocab {vocab} rows {n}: keyed draw {draw * 1e3:.2f} ms ({draw / n * 1e6:.0f} us a row); copying "
              f"half the rows {copy * 1e3:.2f} ms ({copy / (n / 2) * 1e6:.0f} us a row)", flush=True)
