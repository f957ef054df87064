"""Upper bounds of candidate quality on a trace replay (K cap), das drafter as is.
python oracle.py TRACES K"""
import sys
import numpy as np
from das.drafter.history import DrafterConfig, HistoryBank, accepted_prefix
from das.drafter.records import load_rollouts
recs = load_rollouts(sys.argv[1]); K = int(sys.argv[2])
by_v = {}
for r in sorted(recs, key=lambda r: (r.policy_version, r.problem_id, r.sample_index)):
    by_v.setdefault(r.policy_version, []).append(r)
bank = HistoryBank(DrafterConfig())
steps = chosen = oracle_src = oracle_all = drafted = 0
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
    pos = [len(p) for p in prompts]
    active = list(range(len(batch)))
    while active:
        still = []
        for i in active:
            seq, at = full[i], pos[i]
            truth = seq[at:at + K]
            ctx = np.ascontiguousarray(seq[:at], np.int32)
            # every source's candidate, as the proposal below sees them (choose has no side effects)
            sources, cfg = bank._source_list(bank._requests[ids[i]].problem), bank.config
            choice = bank.chooser.choose(sources.indices, sources.kinds, ctx[-cfg.max_depth:], K, cfg.min_prob,
                                         cfg.match_factor, cfg.prior)
            prop = bank.propose(ids[i], seq[:at], K)
            acc = accepted_prefix(prop.tokens, truth)
            best_src = max([accepted_prefix(np.asarray(d.tokens, np.int32), truth) for d in choice.drafts] + [0])
            # shorter matches of every source
            best_all = best_src
            for ix in sources.indices:
                for m in (1, 2, 3, 4, 6, 8, 12, 16):
                    d = ix.speculate(ctx[-m:], K, 0.0, 0.0, 2.0)
                    best_all = max(best_all, accepted_prefix(np.asarray(d.tokens, np.int32), truth))
            adv = min(acc + 1, len(seq) - at)
            bank.extend(ids[i], seq[at:at + adv])
            steps += 1; chosen += acc; oracle_src += best_src; oracle_all += best_all; drafted += len(prop.tokens)
            pos[i] = at + adv
            (still.append(i) if pos[i] < len(seq) else bank.finish_request(ids[i]))
        active = still
    bank.seal(v)
print(f"steps {steps} drafted/step {drafted/steps:.2f} accepted/step: chosen {chosen/steps:.3f} "
      f"oracle source {oracle_src/steps:.3f} oracle source x match {oracle_all/steps:.3f}")
