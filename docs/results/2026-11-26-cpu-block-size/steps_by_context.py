"""Median decode step time in each quarter of an epoch (the context grows from quarter to quarter), from raw step
columns. Usage: python steps_by_context.py STEPS.jsonl[.gz] ..."""
import sys

import numpy as np
from steps_by_batch import takes


def main() -> None:
    for path in sys.argv[1:]:
        for r in takes(path):
            d = {k: np.array(v) for k, v in r.items()}
            step = d["forward_s"] + d["sample_s"] + d["propose_s"] + d["rest_s"] + d["gap_s"]
            prompt = np.maximum(d["tokens"] - d["requests"] - d["drafts"], 0)
            s = step[prompt == 0]
            q = len(s) // 4
            print(path, f"steps {len(step)} total {step.sum():.1f}s prefill {step[prompt > 0].sum():.2f}s, decode "
                  "ms/step by quarter:", " ".join(f"{np.median(s[i * q:(i + 1) * q]) * 1e3:.1f}" for i in range(4)))


if __name__ == "__main__":
    main()
