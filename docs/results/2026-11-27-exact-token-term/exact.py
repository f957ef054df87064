"""Simulated makespan of das with the budget's token term as is (every proposed draft token charged) against the
exact one (only rejected draft tokens: an accepted one replaces a token its request would feed later).
python docs/results/2026-11-27-exact-token-term/exact.py TRACES COST ENGINES [K_MAX]"""
import sys, time
import numpy as np
import das.scheduler.budget as budget
from das.drafter.records import load_rollouts
from das.scheduler.cost_model import load_cost_model
from das.scheduler.simulator import simulate

original = budget.solve_budget


def exact_solve(batch):
    """solve_budget with tokens = T_iK (K + 1 - f_i(K)) instead of K T_iK."""
    rem = batch.remaining
    n = rem.size
    depth = min(batch.k_max, batch.acceptance.shape[1])
    l_max = float(rem[rem.argmax()]) if n else 0.0
    if n == 0 or l_max == 0.0 or depth == 0 or batch.c_base_s == 0.0:
        return budget._without_drafts(n, l_max)
    q = batch.acceptance[:, :depth]
    f = q.cumsum(axis=1) + 1.0
    passes = rem[:, None] / f
    n_min = float(passes[:, -1].max())
    live = rem > n_min
    if not live.any():
        return budget._without_drafts(n, l_max)
    t = passes[live]
    threshold = np.empty_like(t)
    threshold[:, 0] = rem[live]
    threshold[:, 1:] = t[:, :-1]
    tokens = t * (np.arange(1.0, depth + 1.0) + 1.0 - f[live])   # rejected draft tokens over its life
    step_up = tokens.copy()
    step_up[:, 1:] -= tokens[:, :-1]
    flat = threshold.ravel()
    order = flat.argsort()
    sorted_thresholds = flat[order]
    suffix = np.zeros(flat.size + 1)
    suffix[:-1] = step_up.ravel()[order][::-1].cumsum()[::-1]
    candidates = np.concatenate((flat, t[:, -1]))
    total = (batch.c_base_s + batch.c_spec_s) * candidates
    total += batch.c_tok_s * suffix[sorted_thresholds.searchsorted(candidates, "right")]
    total[candidates < n_min] = np.inf
    best = int(total.argmin())
    if not total[best] < batch.c_base_s * l_max:
        return budget._without_drafts(n, l_max)
    x = float(candidates[best])
    k = np.zeros(n, dtype=np.int32)
    k[live] = (threshold > x).sum(axis=1)
    rows = np.flatnonzero(k)
    proposed = np.zeros(n)
    proposed[rows] = k[rows] * passes[rows, k[rows] - 1]
    marginal = np.full(n, np.inf)
    marginal[rows] = q[rows, k[rows] - 1] if batch.c_tok_s > 0.0 else 0.0
    return budget.BudgetSolution(x, proposed, k, marginal)


recs = load_rollouts(sys.argv[1]); cost = load_cost_model(sys.argv[2]); engines = int(sys.argv[3])
k_max = int(sys.argv[4]) if len(sys.argv) > 4 else 16
out = {}
for name, solver in (("as is", original), ("exact", exact_solve)):
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
