"""Drafted steps at >= 9 running requests (where the optimum does not draft on this machine: nearly all exploration)
and their time above plain steps of the same request count in the same take. Usage: explore_cost.py STEPS NAMES"""
import gzip, json, sys
import numpy as np
path, names = sys.argv[1], sys.argv[2].split(",")
with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
    takes = [r for r in map(json.loads, f) if r["tokens"]]
for name, r in zip(names, takes):
    d = {k: np.array(v, dtype=float) for k, v in r.items()}
    if not d["drafts"].any():
        continue
    t = d["forward_s"] + d["sample_s"] + d["propose_s"] + d["rest_s"] + d["gap_s"]
    dec = (d["tokens"] - d["requests"] - d["drafts"]) <= 0
    big = dec & (d["requests"] >= 9) & (d["drafts"] > 0)
    extra = []
    for i in np.flatnonzero(big):
        n = d["requests"][i]
        near = dec & (d["drafts"] == 0) & (np.abs(d["requests"] - n) <= max(1, 0.05 * n))
        if near.sum() >= 2:
            extra.append(t[i] - np.median(t[near]))
    print(f"{name}: epoch {t.sum():.2f} s, proposer {d['propose_s'].sum():.2f} s ({d['propose_s'].sum()/t.sum()*100:.1f}%), "
          f"drafted steps at >= 9 requests {big.sum()} ({d['drafts'][big].sum():.0f} draft tokens), "
          f"extra time of the {len(extra)} with plain neighbours {sum(extra):.2f} s")
