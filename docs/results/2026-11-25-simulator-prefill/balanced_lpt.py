"""LPT with balanced group counts (each engine takes at most ceil(G / E) groups): load balance where the
predictor sees it, round robin's count balance against the stragglers it does not. Ad hoc: the simulator's
length-aware placement patched. das under h100-7b at 8 engines."""
import heapq
import sys

import numpy as np

import das.scheduler.simulator as sim
from das.drafter.records import load_rollouts
from das.scheduler.cost_model import load_cost_model
from das.scheduler.placement import Placement, place_groups


def balanced(loads, engines):
    loads = np.asarray(loads, dtype=np.float64)
    cap = -(-loads.size // engines)
    by_load = np.argsort(-loads, kind="stable")
    total = np.zeros(engines)
    count = np.zeros(engines, dtype=np.int64)
    assignment = np.empty(loads.size, dtype=np.int64)
    for g in by_load.tolist():
        open_ = np.flatnonzero(count < cap)
        e = int(open_[np.argmin(total[open_])])
        assignment[g] = e
        total[e] += loads[g]
        count[e] += 1
    order = tuple(by_load[assignment[by_load] == i] for i in range(engines))
    return Placement(assignment, total, order)


cost = load_cost_model("h100-7b")
for traces in sys.argv[1:]:
    records = load_rollouts(f"tests/fixtures/{traces}.jsonl.gz")
    sim.place_groups = place_groups
    lpt = sim.simulate(records, cost, 8, "das", "length-aware").makespan_s
    rr = sim.simulate(records, cost, 8, "das", "round-robin").makespan_s
    sim.place_groups = balanced
    bal = sim.simulate(records, cost, 8, "das", "length-aware").makespan_s
    print(f"{traces}: LPT {lpt:.3f}  balanced LPT {bal:.3f}  round-robin {rr:.3f}  balanced/rr {bal / rr:.3f}  "
          f"lpt/rr {lpt / rr:.3f}", flush=True)
