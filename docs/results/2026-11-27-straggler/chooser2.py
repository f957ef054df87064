"""Prototype chooser with candidates at several context lengths per source, for the replay.
python chooser2.py TRACES K LENGTHS   (LENGTHS: comma list of context caps, 0 = the longest match, e.g. 0 or 0,8,4)
Candidates: every source of the problem (as HistoryBank's), one draft per context cap; a table keyed by (source
kind, matched length bucket, first-token probability bucket, sources agreeing on the first token) learns the mean
accepted tokens per cell (pseudo-count 5 on the draft's own score, as the native calibrator); the best expected
candidate is proposed; every candidate is scored against the committed tokens."""
import sys, numpy as np
from collections import defaultdict
from das.drafter.history import DrafterConfig, HistoryBank, accepted_prefix
from das.drafter.records import load_rollouts

def mbucket(m):
    for b, u in enumerate((1, 2, 3, 5, 8, 12, 20)):
        if m <= u: return b
    return 7

recs = load_rollouts(sys.argv[1]); K = int(sys.argv[2]); caps = [int(x) for x in sys.argv[3].split(",")]
by_v = defaultdict(list)
for r in sorted(recs, key=lambda r: (r.policy_version, r.problem_id, r.sample_index)):
    by_v[r.policy_version].append(r)
bank = HistoryBank(DrafterConfig())
sums = defaultdict(float); cnts = defaultdict(float); PC = 5.0
steps = acc_total = drafted = 0
for vi, v in enumerate(sorted(by_v)):
    batch = by_v[v]
    ids = [f"{r.problem_id}/{v}/{r.sample_index}" for r in batch]
    prompts = [np.asarray(r.prompt_token_ids, np.int32) for r in batch]
    full = [np.concatenate([p, np.asarray(r.output_token_ids, np.int32)]) for p, r in zip(prompts, batch)]
    for rid, r, p in zip(ids, batch, prompts):
        bank.start_request(rid, r.problem_id, p, v)
    if vi == 0:
        for rid, f, p in zip(ids, full, prompts):
            bank.extend(rid, f[len(p):]); bank.finish_request(rid)
        bank.seal(v); continue
    pos = [len(p) for p in prompts]; active = list(range(len(batch)))
    while active:
        still = []
        for i in active:
            seq, at = full[i], pos[i]
            truth = seq[at:at + K]
            indices, kinds = bank._source_list(bank._requests[ids[i]].problem)
            ctx = np.ascontiguousarray(seq[:at], np.int32)
            cands = []
            for ix, kind in zip(indices, kinds):
                seen = set()
                for c in caps:
                    d = ix.speculate(ctx if c == 0 else ctx[-c:], K, 0.0, 0.0, 2.0)
                    t = tuple(np.asarray(d.tokens).tolist())
                    if not t or (t, d.match_len) in seen: continue
                    seen.add((t, d.match_len))
                    cands.append((kind, d.match_len, float(d.probs[0]), float(d.score), t))
            best, bv, cells = None, -1.0, []
            for kind, m, p0, score, t in cands:
                agree = min(3, sum(1 for c in cands if c[4][0] == t[0]))
                cell = (kind, mbucket(m), min(7, int(p0 * 8)), agree)
                val = (sums[cell] + PC * score) / (cnts[cell] + PC)
                cells.append((cell, t))
                if val > bv: best, bv = t, val
            draft = np.asarray(best if best else (), np.int32)
            acc = accepted_prefix(draft, truth)
            adv = min(acc + 1, len(seq) - at)
            committed = seq[at:at + adv]
            for cell, t in cells:  # censored at the committed tokens, as the native calibrator
                k = accepted_prefix(np.asarray(t, np.int32), committed)
                if cnts[cell] >= 2000: sums[cell] *= 1999 / 2000; cnts[cell] *= 1999 / 2000
                sums[cell] += k; cnts[cell] += 1
            bank._requests[ids[i]].pending = None  # the native chooser is not used
            bank.extend(ids[i], committed)
            steps += 1; acc_total += acc; drafted += len(draft)
            pos[i] = at + adv
            (still.append(i) if pos[i] < len(seq) else bank.finish_request(ids[i]))
        active = still
    bank.seal(v)
print(f"K={K} caps={caps}: draft/step {drafted/steps:.2f} tokens/step {1 + acc_total/steps:.3f}")
