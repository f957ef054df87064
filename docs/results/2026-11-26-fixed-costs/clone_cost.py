"""Time to copy (clone) and to gather (index) float32 tensors of logits shape under the allocator the process runs
with. Usage: python clone_cost.py; LD_PRELOAD=.../ray/core/libjemalloc.so MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1
python clone_cost.py"""
import torch, timeit
for rows, vocab in ((45, 49152), (16, 151936), (64, 151936)):
    x = torch.randn(rows, vocab)
    t = min(timeit.repeat(lambda: x.clone(), number=50, repeat=5)) / 50 * 1e3
    y = torch.randn(rows * 2, vocab); idx = torch.arange(0, rows * 2, 2)
    t2 = min(timeit.repeat(lambda: y[idx], number=50, repeat=5)) / 50 * 1e3
    print(f"[{rows}, {vocab}] {rows*vocab*4/2**20:.0f} MiB: clone {t:.3f} ms, index {t2:.3f} ms")
