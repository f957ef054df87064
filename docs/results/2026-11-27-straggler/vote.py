"""Prototype drafter for the replay: every draft token chosen by pooled n-gram counts of all a problem's sources
(earlier versions, this version's samples so far, the prompt), orders 1..16 interpolated recursively with a
Dirichlet weight beta (PPM-like); a draft stops at K tokens or when its cumulative estimate falls below the floor.
A drafter for `das bench drafter`'s replay (bench/drafter_replay.py `replay_arm`).
python vote.py TRACES BETA K:FLOOR [K:FLOOR ...]"""
import sys
from collections import defaultdict

import numpy as np

from das.bench.drafter_replay import replay_arm
from das.drafter.records import load_rollouts

ORDERS = (1, 2, 3, 4, 6, 8, 12, 16)

class Model:
    def __init__(self):
        self.tab = defaultdict(lambda: defaultdict(int))   # (order, ctx tuple) -> token -> count
        self.n = 0
    def add(self, seq, start):
        # add transitions predicting seq[j] for j >= start
        for j in range(max(start, 1), len(seq)):
            t = seq[j]; self.n += 1
            for d in ORDERS:
                if j - d < 0: break
                self.tab[(d, tuple(seq[j - d:j]))][t] += 1

def predict(models, ctx, beta):
    """argmax token and its interpolated probability, pooled over models (model, weight)."""
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

class VoteDrafter:
    """Sources: the problem's earlier versions (sealed at each version's end), this version's samples so far (every
    sibling's and the request's own, token by token) and its prompt."""

    name = "vote"

    def __init__(self, beta, floor):
        self.beta, self.floor = beta, floor
        self.sealed = defaultdict(Model)  # problem -> all earlier versions' outputs
        self.seqs, self.problem, self.prompt_len = {}, {}, {}

    def begin_version(self, policy_version):
        self.live, self.prompts, self.finished = defaultdict(Model), defaultdict(Model), []

    def start_request(self, request_id, problem_id, prompt):
        self.seqs[request_id], self.problem[request_id] = list(map(int, prompt)), problem_id
        self.prompt_len[request_id] = len(prompt)
        if self.prompts[problem_id].n == 0:
            self.prompts[problem_id].add(self.seqs[request_id], 1)

    def propose(self, request_id, context, max_tokens):
        pid = self.problem[request_id]
        models = [(self.sealed[pid], 1.0), (self.live[pid], 1.0), (self.prompts[pid], 1.0)]
        ctx, draft, cum = list(map(int, context)), [], 1.0
        while len(draft) < max_tokens:
            t, p = predict(models, ctx, self.beta)
            if t is None or cum * p < self.floor:
                break
            cum *= p
            draft.append(t)
            ctx.append(t)
        return np.asarray(draft, np.int32)

    def extend(self, request_id, tokens):
        seq, live = self.seqs[request_id], self.live[self.problem[request_id]]
        for t in map(int, tokens):
            seq.append(t)
            live.add(seq, len(seq) - 1)  # the transition predicting this token

    def finish_request(self, request_id):
        self.finished.append(request_id)

    def end_version(self, policy_version):
        for rid in self.finished:
            self.sealed[self.problem[rid]].add(self.seqs.pop(rid), self.prompt_len[rid])

    def memory_bytes(self):
        return 0

    def stored_tokens(self):
        return 1


if __name__ == "__main__":
    records = load_rollouts(sys.argv[1])
    beta = float(sys.argv[2])
    for setting in sys.argv[3:]:
        k, floor = int(setting.split(":")[0]), float(setting.split(":")[1])
        stats = replay_arm(VoteDrafter(beta, floor), records, k)
        print(f"K={k} floor={floor}: draft/step {stats.draft_tokens_per_step:.2f} "
              f"tokens/step {stats.tokens_per_step:.3f}", flush=True)
