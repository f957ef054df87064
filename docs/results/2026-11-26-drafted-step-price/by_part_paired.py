"""Drafted minus plain step time at the same request count (same take), by part of the step (medians, ms), by
request-count bucket. python by_part_paired.py STEPS.jsonl[.gz] (raw step columns from run_with_block_size.py)"""
import gzip, json, sys
import numpy as np
path = sys.argv[1]
with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
    takes = [r for r in map(json.loads, f) if r["tokens"]]
for ti, r in enumerate(takes):
    d = {k: np.array(v, dtype=float) for k, v in r.items()}
    if not d["drafts"].any():
        continue
    dec = (d["tokens"] - d["requests"] - d["drafts"]) <= 0
    for lo, hi in [(1, 2), (3, 8), (9, 16), (17, 32), (33, 48), (49, 64)]:
        parts = {p: [] for p in ("forward_s", "sample_s", "propose_s", "rest_s", "gap_s")}
        nd = []
        for n in range(lo, hi + 1):
            m = dec & (d["requests"] == n)
            pl, dr = m & (d["drafts"] == 0), m & (d["drafts"] > 0)
            if pl.sum() >= 2 and dr.sum() >= 1:
                for p in parts:
                    parts[p].extend((d[p][dr] - np.median(d[p][pl])).tolist())
                nd.extend(d["drafts"][dr].tolist())
        if nd:
            print(f"take {ti} req {lo:2d}-{hi:2d} n={len(nd):3d} drafts med {np.median(nd):.0f}: " + " ".join(
                f"{p[:-2]} {np.median(v)*1e3:+6.1f}" for p, v in parts.items()))
