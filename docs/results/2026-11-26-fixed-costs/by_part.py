"""Per-component mean ms of decode steps, by request bucket, plain vs drafted. Usage: by_part.py STEPS NAMES"""
import gzip, json, sys
import numpy as np
path, names = sys.argv[1], sys.argv[2].split(",")
with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
    takes = [r for r in map(json.loads, f) if r["tokens"]]
parts = ("forward_s", "sample_s", "propose_s", "rest_s", "gap_s")
for name, r in zip(names, takes):
    d = {k: np.array(v) for k, v in r.items()}
    dec = (d["tokens"] - d["requests"] - d["drafts"]) <= 0
    print("==", name, "  parts:", " ".join(p[:-2] for p in parts))
    for lo, hi in [(1, 1), (2, 2), (3, 8), (9, 32), (33, 64)]:
        m = (d["requests"] >= lo) & (d["requests"] <= hi) & dec
        for label, mm in (("plain", m & (d["drafts"] == 0)), ("drafted", m & (d["drafts"] > 0))):
            if mm.sum() < 2:
                continue
            print(f"  {lo:2d}-{hi:2d} {label:8s} n={mm.sum():4d} drafts={d['drafts'][mm].mean():4.1f} "
                  + " ".join(f"{d[p][mm].mean()*1e3:7.2f}" for p in parts))
