"""LPT on predicted group loads shrunk towards their mean by RHO: python place4.py TRACES COST E RHO..."""
import sys, numpy as np
import das.scheduler.simulator as sim
from das.drafter.records import load_rollouts
from das.scheduler.cost_model import load_cost_model
from das.scheduler.placement import place_groups
from das.drafter.history import DrafterConfig
recs = load_rollouts(sys.argv[1]); cost = load_cost_model(sys.argv[2]); E = int(sys.argv[3])
by_v = {}
for r in recs: by_v.setdefault(r.policy_version, []).append(r)
pol = sim.make_policy("das")
for rho in map(float, sys.argv[4:]):
    sim._placement = lambda kind, loads, engines, rho=rho: place_groups(loads.mean() + rho * (loads - loads.mean()), engines)
    out = []
    for v in sorted(by_v)[1:]:
        history = [r for u in by_v if v - 4 <= u < v for r in by_v[u]]
        batch = sorted(by_v[v], key=lambda r: (r.problem_id, r.sample_index))
        out.append(sim.simulate_batch(batch, history, cost, E, pol, "length-aware", 16, DrafterConfig(window=4))[0])
    print(f"rho {rho}: " + ", ".join(f"{m:.3f}" for m in out), flush=True)
