"""Predicted against true group loads on the 66 x 16 traces, and the true-token balance LPT and random placements
reach: python docs/results/2026-11-27-placement/place7.py"""
import numpy as np
from das.drafter.records import load_rollouts
from das.scheduler.difficulty import DifficultyBook
from das.scheduler.length import LengthPredictor
from das.scheduler.placement import place_groups, round_robin
recs = load_rollouts("tests/fixtures/traces-smollm2-66x16.jsonl.gz")
by_v = {}
for r in recs: by_v.setdefault(r.policy_version, []).append(r)
for V in (1, 2):
    history = [r for u in by_v if V - 4 <= u < V for r in by_v[u]]
    batch = sorted(by_v[V], key=lambda r: (r.problem_id, r.sample_index))
    book = DifficultyBook(); book.add_records(history); pred = LengthPredictor(book)
    groups = {}
    for r in batch: groups.setdefault(r.problem_id, []).append(len(r.output_token_ids))
    gids = sorted(groups)
    true_tot = np.array([sum(groups[g]) for g in gids]); true_max = np.array([max(groups[g]) for g in gids])
    n_long = np.array([sum(l >= 1000 for l in groups[g]) for g in gids])
    p = pred.predict(gids, np.zeros(len(gids)))
    load = p.mean * 16
    print(f"v{V}: corr(pred, true total) {np.corrcoef(load, true_tot)[0,1]:.2f}, corr(pred, true max) {np.corrcoef(load, true_max)[0,1]:.2f}, samples at cap {n_long.sum()}")
    for E in (2, 8):
        def stats(assign):
            tot = np.bincount(assign, true_tot, minlength=E); cap = np.bincount(assign, n_long, minlength=E)
            return tot.max() / tot.mean(), cap.max(), np.bincount(assign, minlength=E).max()
        la = place_groups(load, E).assignment
        rng = np.random.default_rng(0)
        rs = []
        for s in range(8):
            perm = rng.permutation(len(gids)); a = np.empty(len(gids), int); a[perm] = np.arange(len(gids)) % E; rs.append(stats(a))
        print(f"  E={E}: LA max/mean true tokens {stats(la)[0]:.3f}, capped samples on the fullest engine {stats(la)[1]}; "
              f"random: {np.median([r[0] for r in rs]):.3f}, {np.median([r[1] for r in rs])}")
