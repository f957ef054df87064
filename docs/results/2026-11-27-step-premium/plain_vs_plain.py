"""Does a das engine's step cost more than a plain engine's at the same shape? Raw step columns (STEPS from
docs/results/2026-11-26-cpu-block-size/run_with_block_size.py, one JSON object per take; a take with any draft is
das's, the others none's): per request count, das's plain steps and its drafted steps against the median `none`
step of that count, by part (ms), pooled over the counts of a bucket (medians).
python plain_vs_plain.py STEPS.jsonl[.gz]"""
import gzip
import json
import sys

import numpy as np

with (gzip.open if sys.argv[1].endswith(".gz") else open)(sys.argv[1], "rt") as f:
    takes = [{k: np.array(v, dtype=float) for k, v in r.items()} for r in map(json.loads, f) if r["tokens"]]
decode = [t | {"decode": (t["tokens"] - t["requests"] - t["drafts"]) <= 0} for t in takes]
none = [t for t in decode if not t["drafts"].any()]
das = [t for t in decode if t["drafts"].any()]
parts = ("forward_s", "sample_s", "propose_s", "rest_s", "gap_s")


def pooled(group, mask_of):
    out = {}
    for t in group:
        m = t["decode"] & mask_of(t)
        for n in np.unique(t["requests"][m]):
            sel = m & (t["requests"] == n)
            for p in parts + ("drafts",):
                out.setdefault(int(n), {}).setdefault(p, []).extend(t[p][sel].tolist())
    return out


def slope(group) -> float:
    """none's forward pass: ms per request (one more decoded token), least squares over its decode steps."""
    n = np.concatenate([t["requests"][t["decode"]] for t in group])
    f = np.concatenate([t["forward_s"][t["decode"]] for t in group])
    return float(np.polyfit(n, f, 1)[0] * 1e3)


print(f"none's forward pass: {slope(none):.2f} ms per decoded token (least squares over its decode steps)")
base = pooled(none, lambda t: np.ones_like(t["drafts"], bool))
for label, mask in (("das plain", lambda t: t["drafts"] == 0), ("das drafted", lambda t: t["drafts"] > 0)):
    arm = pooled(das, mask)
    for lo, hi in ((1, 4), (5, 12), (13, 24), (25, 32)):
        diffs = {p: [] for p in parts}
        steps, drafts = 0, []
        for n in range(lo, hi + 1):
            if n in arm and n in base and len(base[n]["forward_s"]) >= 3:
                steps += len(arm[n]["forward_s"])
                drafts.extend(arm[n]["drafts"])
                for p in parts:
                    diffs[p].extend((np.array(arm[n][p]) - np.median(base[n][p])).tolist())
        if steps:
            print(f"{label:11s} requests {lo:2d}-{hi:2d}: {steps:4d} steps, {np.median(drafts):.0f} drafts (median); "
                  f"vs none's median at the same count: " +
                  " ".join(f"{p[:-2]} {np.median(v) * 1e3:+6.2f}" for p, v in diffs.items()), flush=True)
