"""How often a sample that repeats an L-token window of its own output runs to the length limit, on a history file.
`python loops.py TRACES.jsonl.gz L` (docs/results/2026-11-26-server-gap.md, section 5)."""
import sys, collections
from das.drafter.records import load_rollouts
recs = load_rollouts(sys.argv[1])
L = int(sys.argv[2]) if len(sys.argv) > 2 else 16
maxlen = max(len(r.output_token_ids) for r in recs)
def onset(toks):
    seen = set()
    for t in range(L, len(toks) + 1):
        key = tuple(toks[t - L:t])
        if key in seen:
            return t
        seen.add(key)
    return None
stats = collections.Counter()
onsets = []
for r in recs:
    o = onset(list(r.output_token_ids))
    hit = r.finish_reason == "length"
    stats[(o is not None, hit)] += 1
    if o is not None:
        onsets.append((o, len(r.output_token_ids), hit))
n = len(recs)
print(f"{sys.argv[1]}: {n} samples, max {maxlen} tokens, loop = a {L}-token window seen earlier in the sample")
print(f"  hit the limit: {stats[(True, True)] + stats[(False, True)]} ({(stats[(True, True)] + stats[(False, True)]) / n:.0%})")
print(f"  with a loop: {stats[(True, True)] + stats[(True, False)]}; of those hit the limit {stats[(True, True)]} "
      f"({stats[(True, True)] / max(1, stats[(True, True)] + stats[(True, False)]):.0%})")
print(f"  without a loop: {stats[(False, True)] + stats[(False, False)]}; of those hit the limit {stats[(False, True)]}")
hits = [o for o, ln, h in onsets if h]
if hits:
    hits.sort()
    print(f"  loop onset in samples that hit the limit: median {hits[len(hits)//2]} tokens, p25 {hits[len(hits)//4]}, p75 {hits[3*len(hits)//4]}")
stops = [ln - o for o, ln, h in onsets if not h]
if stops:
    stops.sort()
    print(f"  looping samples that stopped: tokens after onset median {stops[len(stops)//2]}")
