"""Prototype drafter for the replay: every draft token chosen by pooled n-gram counts of all a problem's sources
(earlier versions, this version's samples so far, the prompt), orders 1..16 interpolated recursively with a
Dirichlet weight beta (PPM-like); a draft stops at K tokens or when its cumulative estimate falls below the floor.
Same replay as `das bench drafter` (siblings advance together; accepted = common prefix with the recorded sample).
python vote.py TRACES BETA K:FLOOR [K:FLOOR ...]"""
import sys
import numpy as np
from collections import defaultdict
from das.drafter.history import accepted_prefix
from das.drafter.records import load_rollouts
ORDERS = (1, 2, 3, 4, 6, 8, 12, 16)

class Model:
    def __init__(self):
        self.tab = defaultdict(lambda: defaultdict(int))   # (order, ctx tuple) -> token -> count
        self.uni = defaultdict(int); self.n = 0
    def add(self, seq, start):
        # add transitions predicting seq[j] for j >= start
        for j in range(max(start, 1), len(seq)):
            t = seq[j]; self.uni[t] += 1; self.n += 1
            for d in ORDERS:
                if j - d < 0: break
                self.tab[(d, tuple(seq[j - d:j]))][t] += 1

def predict(models, ctx, beta):
    """argmax token and its interpolated probability, pooled over models."""
    dists = []
    for d in ORDERS:
        if len(ctx) < d: break
        key = (d, tuple(ctx[-d:]))
        pooled = defaultdict(float)
        for m, w in models:
            c = m.tab.get(key)
            if c:
                for t, k in c.items(): pooled[t] += w * k
        if not pooled: break   # longer contexts cannot match either
        dists.append(pooled)
    if not dists: return None, 0.0
    cands = set(dists[-1])  # tokens seen after the longest context
    for dd in dists: cands |= set(dd) if len(dd) < 8 else set()
    best, bp = None, -1.0
    for t in cands:
        p = 0.0  # base: 0 for unseen
        for dd in dists:
            n = sum(dd.values())
            p = (dd.get(t, 0.0) + beta * p) / (n + beta)
        if p > bp: best, bp = t, p
    return best, bp

def run(path, beta, settings):
    recs = load_rollouts(path)
    by_v = defaultdict(list)
    for r in sorted(recs, key=lambda r: (r.policy_version, r.problem_id, r.sample_index)):
        by_v[r.policy_version].append(r)
    out = {}
    for K, floor in settings:
        hist = defaultdict(Model)  # problem -> sealed model (all earlier versions + prompts)
        steps = drafted = acc_total = 0
        for vi, v in enumerate(sorted(by_v)):
            batch = by_v[v]
            prompts = [list(r.prompt_token_ids) for r in batch]
            full = [p + list(r.output_token_ids) for p, r in zip(prompts, batch)]
            if vi == 0:
                for r, f, p in zip(batch, full, prompts):
                    hist[r.problem_id].add(f, len(p))
                continue
            live = defaultdict(Model)  # this version's samples so far, every sibling's and the request's own
            promptm = defaultdict(Model)
            for r, p in zip(batch, prompts):
                if promptm[r.problem_id].n == 0: promptm[r.problem_id].add(p, 1)
            pos = [len(p) for p in prompts]
            active = list(range(len(batch)))
            while active:
                still = []
                for i in active:
                    seq, at, pid = full[i], pos[i], batch[i].problem_id
                    models = [(hist[pid], 1.0), (live[pid], 1.0), (promptm[pid], 1.0)]
                    ctx = list(seq[:at]); draft = []; cum = 1.0
                    while len(draft) < K:
                        t, p = predict(models, ctx, beta)
                        if t is None or cum * p < floor: break
                        cum *= p; draft.append(t); ctx.append(t)
                    acc = accepted_prefix(np.asarray(draft), np.asarray(seq[at:at + len(draft)]))
                    adv = min(acc + 1, len(seq) - at)
                    # feed live model with the committed tokens (transitions predicting them)
                    for j in range(at, at + adv):
                        live[pid].add(seq[:j + 1], j)
                    steps += 1; drafted += len(draft); acc_total += acc
                    pos[i] = at + adv
                    if pos[i] < len(seq): still.append(i)
                active = still
            for r, f, p in zip(batch, full, prompts):
                hist[r.problem_id].add(f, len(p))
        out[(K, floor)] = (drafted / steps, 1 + acc_total / steps)
        print(f"K={K} floor={floor}: draft/step {drafted/steps:.2f} tokens/step {1+acc_total/steps:.3f}", flush=True)
    return out

if __name__ == "__main__":
    settings = [(int(a.split(':')[0]), float(a.split(':')[1])) for a in sys.argv[3:]]
    run(sys.argv[1], float(sys.argv[2]), settings)
