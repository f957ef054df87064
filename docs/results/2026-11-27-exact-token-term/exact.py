"""Simulated makespan of das with the budget's token term as is (every proposed draft token charged) against the
exact one (only rejected draft tokens: an accepted one replaces a token its request would feed later).
python docs/results/2026-11-27-exact-token-term/exact.py TRACES COST ENGINES [K_MAX]"""
import inspect
import sys
import time

import das.scheduler.budget as budget
from das.drafter.records import load_rollouts
from das.scheduler.cost_model import load_cost_model
from das.scheduler.simulator import simulate

original = budget.solve_budget


def exact_solver():
    """solve_budget with its token term `K T_iK` replaced by `T_iK (K + 1 - f_i(K))` (f_i(K) = l_i / T_iK): the
    package's own function with that one line changed, so the two differ in nothing else."""
    source = inspect.getsource(budget.solve_budget)
    line = "tokens = t * np.arange(1.0, depth + 1.0)"
    assert source.count(line) == 1, "solve_budget changed: the token term to replace is not there"
    namespace = dict(vars(budget))
    exec(source.replace(line, "tokens = t * (np.arange(1.0, depth + 1.0) + 1.0 - rem[live, None] / t)"), namespace)
    return namespace["solve_budget"]


recs = load_rollouts(sys.argv[1]); cost = load_cost_model(sys.argv[2]); engines = int(sys.argv[3])
k_max = int(sys.argv[4]) if len(sys.argv) > 4 else 16
out = {}
for name, solver in (("as is", original), ("exact", exact_solver())):
    budget.solve_budget = solver
    t0 = time.time()
    arm = simulate(recs, cost, engines, "das", k_max=k_max)
    out[name] = arm
    print(f"{name}: makespan {arm.makespan_s:.3f} s simulated, batches {[round(b, 3) for b in arm.batches]}, "
          f"passes {arm.forward_passes}, verified {arm.tokens_verified}, accepted {arm.accepted_tokens} "
          f"({time.time() - t0:.0f} s wall)", flush=True)
none = simulate(recs, cost, engines, "none", k_max=k_max)
print(f"none: makespan {none.makespan_s:.3f}; das as is / none {out['as is'].makespan_s / none.makespan_s:.3f}, "
      f"exact / none {out['exact'].makespan_s / none.makespan_s:.3f}, exact / as is "
      f"{out['exact'].makespan_s / out['as is'].makespan_s:.3f}")
