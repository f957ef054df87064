"""bound.py's frontiers read at arctic-d24's draft tokens per step (as measured by `das bench drafter`,
2026-11-23-drafter-frontier.md: 3.05 / 3.90 / 3.49 draft tokens, 1.697 / 2.304 / 1.755 tokens per step).
python compare.py bound.log"""
import re
import sys

import numpy as np

ARCTIC = {"traces-smollm2.jsonl.gz": (3.05, 1.697), "traces-qwen2.5-coder-0.5b.jsonl.gz": (3.90, 2.304),
          "traces-smollm2-66x16.jsonl.gz": (3.49, 1.755)}
LINE = re.compile(r"(\S+) K=\d+: frequency ([\d.]+) tokens/step at ([\d.]+) draft tokens/step, "
                  r"oracle choice ([\d.]+) tokens/step at ([\d.]+)")
points: dict[str, dict[str, list[tuple[float, float]]]] = {}
for line in open(sys.argv[1]):
    if m := LINE.match(line):
        arms = points.setdefault(m[1], {"frequency": [(0.0, 1.0)], "oracle": [(0.0, 1.0)]})
        arms["frequency"].append((float(m[3]), float(m[2])))
        arms["oracle"].append((float(m[5]), float(m[4])))
for name, arms in points.items():
    drafts, arctic = ARCTIC[name]
    at = {arm: float(np.interp(drafts, *zip(*sorted(p)))) for arm, p in arms.items()}
    print(f"{name} at {drafts} draft tokens/step: oracle choice {at['oracle']:.3f}, frequency {at['frequency']:.3f}, "
          f"arctic-d24 {arctic}; oracle / arctic-d24 {at['oracle'] / arctic:.3f}, "
          f"oracle / frequency {at['oracle'] / at['frequency']:.3f}")
