"""Keyed verification (cpu_fixes.rejection.sample_without_draft_probs) before and after drawing rows only up to each
request's first rejection, on the same inputs, interleaved: B requests drafting K tokens each against random logits
over a vocabulary of V entries; each draft token is the keyed draw (accepted) with probability ALPHA, otherwise a
wrong token, independently per position (so a request's accepted prefix is geometric, as with a real drafter).
"before" is the function as of commit 5545951, loaded from git. Prints the median of R timings of each and their
ratio, with the rows the kernel drew.
python bench.py V B K ALPHA[,ALPHA...] R"""
import subprocess
import sys
import time
import types

import numpy as np
import torch
from vllm.platforms import current_platform

from das.service.engine.cpu_fixes import rejection
from das.service.engine.keyed_sampler import StepKeys, keyed_tokens
from das.service.sample_keys import derive


def before_module() -> types.ModuleType:
    source = subprocess.run(["git", "show", "5545951:service/engine/cpu_fixes/rejection.py"], check=True,
                            capture_output=True, text=True).stdout
    module = types.ModuleType("rejection_before")
    exec(compile(source, "rejection_before.py", "exec"), module.__dict__)
    return module


def main(vocab: int, batch: int, k: int, alphas: list[float], repeats: int) -> None:
    current_platform.import_kernels()
    old = before_module()
    torch.manual_seed(0)
    rows = torch.randn(batch * k, vocab)
    keys = np.array([derive(3, i) for i in range(batch)], dtype=np.int64)
    step = StepKeys(keys, np.ones(batch, bool), np.zeros(batch, np.int64), np.full(batch, k, np.int64))
    row_keys = step.target_row_keys()
    plain = keyed_tokens(rows, row_keys[0])
    meta = types.SimpleNamespace(temperature=torch.full((batch,), 0.8), all_greedy=False, all_random=True,
                                 generators={})
    bonus = torch.zeros((batch, 1), dtype=torch.int32)
    for alpha in alphas:
        rng = np.random.default_rng(1)
        right = torch.from_numpy(rng.random(batch * k) < alpha)
        drafts = torch.where(right, plain, (plain + 1) % vocab).to(torch.int32)
        args = (drafts, [k] * batch, k, rows, bonus, meta, row_keys)
        assert torch.equal(old.sample_without_draft_probs(*args), rejection.sample_without_draft_probs(*args))
        times: dict[str, list[float]] = {"before": [], "after": []}
        for _ in range(repeats):
            for name, fn in (("before", old.sample_without_draft_probs),
                             ("after", rejection.sample_without_draft_probs)):
                start = time.perf_counter()
                fn(*args)
                times[name].append(time.perf_counter() - start)
        grid = right.view(batch, k)
        drawn = int(sum(min(int(np.argmin(np.append(g.numpy(), False))) + 1, k) for g in grid))
        b, a = np.median(times["before"]) * 1e3, np.median(times["after"]) * 1e3
        print(f"V={vocab} B={batch} K={k} alpha={alpha}: rows drawn {drawn} of {batch * k}; before {b:.2f} ms, "
              f"after {a:.2f} ms (median of {repeats}); after / before {a / b:.3f}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), [float(x) for x in sys.argv[4].split(",")],
         int(sys.argv[5]))
