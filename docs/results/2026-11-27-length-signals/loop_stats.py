"""How often a sample that repeats its own text runs to the cap: python loop_stats.py TRACES [W]. A sample
"repeats" once its last W output tokens occurred earlier in its own output; capped = within 1 token of the
longest output in the traces."""
import sys

import numpy as np

from das.drafter.records import load_rollouts

W = int(sys.argv[2]) if len(sys.argv) > 2 else 32
records = load_rollouts(sys.argv[1])
cap = max(len(r.output_token_ids) for r in records)
lengths, first = [], []
for r in records:
    out, seen, at = r.output_token_ids, set(), -1
    for g in range(W, len(out) + 1):
        key = tuple(out[g - W:g])
        if key in seen:
            at = g
            break
        seen.add(key)
    lengths.append(len(out))
    first.append(at)
lengths, first = np.array(lengths), np.array(first)
capped, loop = lengths >= cap - 1, first >= 0
where = np.percentile(first[loop & capped] / lengths[loop & capped], [10, 50, 90]).round(2)
print(f"{sys.argv[1].split('/')[-1]}: {len(records)} samples, cap {cap}, capped {capped.sum()}, repeating "
      f"{loop.sum()}; P(capped | repeating) {capped[loop].mean():.2f}, P(capped | not) {capped[~loop].mean():.3f}, "
      f"capped samples repeating {loop[capped].mean():.2f}, at {where} of their length")
