"""Drafted minus plain step time at the same request count (same take), by request-count bucket: the drafted-step
price net of c_tok * drafts is printed too (c_tok given)."""
import gzip, json, sys
import numpy as np
path, names, c_tok = sys.argv[1], sys.argv[2].split(","), float(sys.argv[3])
with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
    takes = [r for r in map(json.loads, f) if r["tokens"]]
for name, r in zip(names, takes):
    d = {k: np.array(v, dtype=float) for k, v in r.items()}
    if not d["drafts"].any():
        continue
    t = d["forward_s"] + d["sample_s"] + d["propose_s"] + d["rest_s"] + d["gap_s"]
    dec = (d["tokens"] - d["requests"] - d["drafts"]) <= 0
    out = {}
    for n in np.unique(d["requests"][dec]):
        m = dec & (d["requests"] == n)
        pl, dr = m & (d["drafts"] == 0), m & (d["drafts"] > 0)
        if pl.sum() >= 2 and dr.sum() >= 1:
            extra = t[dr] - np.median(t[pl]) - c_tok * d["drafts"][dr]
            out.setdefault(int(n), []).extend(extra.tolist())
    for lo, hi in [(1, 2), (3, 8), (9, 16), (17, 32), (33, 48), (49, 64)]:
        v = [x for n, xs in out.items() if lo <= n <= hi for x in xs]
        if v:
            print(f"{name} requests {lo:2d}-{hi:2d}: drafted steps {len(v):3d} price net of c_tok*drafts: median "
                  f"{np.median(v)*1e3:6.1f} ms mean {np.mean(v)*1e3:6.1f} ms")
