"""Per-step engine time by running requests, prefill steps apart, from raw step columns (one JSON object per
`take_step_profile`, as run_with_block_size.py writes them). Usage: python steps_by_batch.py STEPS.jsonl[.gz]
NAME1,NAME2,... (one name per non-empty take, in order)."""
import gzip
import json
import sys

import numpy as np


def takes(path: str) -> list[dict]:
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        return [r for r in map(json.loads, f) if r["tokens"]]


def main() -> None:
    for name, r in zip(sys.argv[2].split(","), takes(sys.argv[1])):
        d = {k: np.array(v) for k, v in r.items()}
        step = d["forward_s"] + d["sample_s"] + d["propose_s"] + d["rest_s"] + d["gap_s"]
        prompt = np.maximum(d["tokens"] - d["requests"] - d["drafts"], 0)
        dec, req = prompt == 0, d["requests"]
        print(f"== {name}: steps {len(step)} total {step.sum():.2f}s prefill {step[~dec].sum():.2f}s "
              f"({(~dec).sum()} steps, {prompt.sum():.0f} prompt tokens) drafts {d['drafts'].sum():.0f}")
        for lo, hi in [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, 64)]:
            m = (req >= lo) & (req <= hi) & dec
            if not m.any():
                continue
            dr, pl = m & (d["drafts"] > 0), m & (d["drafts"] == 0)

            def ms(mask):
                return step[mask].mean() * 1e3 if mask.any() else float("nan")

            print(f"  requests {lo:2d}-{hi:2d}: steps {m.sum():4d} {step[m].sum():6.2f}s | plain {pl.sum():4d} x "
                  f"{ms(pl):6.1f} ms | drafted {dr.sum():4d} x {ms(dr):6.1f} ms, "
                  f"{d['drafts'][dr].mean() if dr.any() else 0:4.1f} drafts | tokens per request "
                  f"{d['tokens'][m].sum() / req[m].sum():.2f}")


if __name__ == "__main__":
    main()
