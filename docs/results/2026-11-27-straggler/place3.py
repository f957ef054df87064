"""LPT (length-aware) against round robin over random group orders: python place3.py TRACES COST E SHUFFLES"""
import sys
import numpy as np
from das.drafter.records import load_rollouts
from das.scheduler.cost_model import load_cost_model
from das.scheduler.simulator import simulate_batch, make_policy
from das.drafter.history import DrafterConfig
recs = load_rollouts(sys.argv[1]); cost = load_cost_model(sys.argv[2]); E = int(sys.argv[3]); S = int(sys.argv[4])
by_v = {}
for r in recs: by_v.setdefault(r.policy_version, []).append(r)
pol = make_policy("das"); rng = np.random.default_rng(0)
for v in sorted(by_v)[1:]:
    history = [r for u in by_v if v - 4 <= u < v for r in by_v[u]]
    batch = sorted(by_v[v], key=lambda r: (r.problem_id, r.sample_index))
    la = simulate_batch(batch, history, cost, E, pol, "length-aware", 16, DrafterConfig(window=4))[0]
    rr0 = simulate_batch(batch, history, cost, E, pol, "round-robin", 16, DrafterConfig(window=4))[0]
    pids = sorted({r.problem_id for r in batch}); rrs = []
    for s in range(S):
        order = {p: k for k, p in enumerate(rng.permutation(pids))}
        shuffled = sorted(batch, key=lambda r: (order[r.problem_id], r.sample_index))
        rrs.append(simulate_batch(shuffled, history, cost, E, pol, "round-robin", 16, DrafterConfig(window=4))[0])
    rrs = np.array(rrs)
    print(f"version {v}: length-aware {la:.3f}, round robin in trace order {rr0:.3f}, round robin over {S} random orders "
          f"median {np.median(rrs):.3f} (min {rrs.min():.3f}, max {rrs.max():.3f}); LA / median RR {la/np.median(rrs):.3f}, "
          f"share of random orders LA beats {np.mean(la < rrs):.2f}", flush=True)
