"""The budget plans the batch's passes N from each request's p90 (it must not under-plan the longest), but prices a
request's draft tokens over the rest of its life with that same p90, while most requests end well before their p90:
their drafts stop when they end. Here the solver keeps p90 for N and the feasibility thresholds and prices the draft
tokens with another forecast of the remaining length (mean or p50). The package's `simulate_batch` patched from
its source (asserted one-line edits, patched.py), the solver a copy of `solve_budget` with that one change.
python mean_cost.py COST ENGINES mean,p50 TRACES..."""
import sys

import numpy as np

sys.path.insert(0, "../2026-11-27-length-signals")
from patched import patched_simulate_batch, simulate_with  # noqa: E402

from das.drafter.records import load_rollouts  # noqa: E402
from das.scheduler import simulator  # noqa: E402
from das.scheduler.budget import BatchState, DraftPlan, _without_drafts  # noqa: E402
from das.scheduler.cost_model import load_cost_model  # noqa: E402


def solve_split(batch: BatchState, rem_cost: np.ndarray) -> np.ndarray:
    """solve_budget's K_i, the draft tokens priced with rem_cost instead of batch.remaining."""
    rem = batch.remaining
    n = rem.size
    depth = min(batch.k_max, batch.acceptance.shape[1])
    l_max = float(rem.max()) if n else 0.0
    if n == 0 or l_max == 0.0 or depth == 0 or batch.c_base_s == 0.0:
        return _without_drafts(n, l_max).draft_lengths
    q = batch.acceptance[:, :depth]
    f = 1.0 + q.cumsum(axis=1)
    passes = rem[:, None] / f
    n_min = float(passes[:, -1].max())
    live = rem > n_min
    if not live.any():
        return _without_drafts(n, l_max).draft_lengths
    t = passes[live]
    threshold = np.empty_like(t)
    threshold[:, 0] = rem[live]
    threshold[:, 1:] = t[:, :-1]
    tokens = (np.minimum(rem_cost, rem)[live, None] / f[live]) * np.arange(1.0, depth + 1.0)
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
        return _without_drafts(n, l_max).draft_lengths
    k = np.zeros(n, dtype=np.int32)
    k[live] = (threshold > float(candidates[best])).sum(axis=1)
    return k


def plan_split(policy, state: BatchState, rem_cost: np.ndarray) -> DraftPlan:
    if policy.name != "das":
        return policy.plan(state)
    return DraftPlan(solve_split(state, rem_cost), np.zeros(len(state)))


BUDGET = "                ends = predictor.predict([problems[i] for i in active], pos[active]).p90\n"
PLAN = "            plan = policy.plan(state)\n"
cost, engines = load_cost_model(sys.argv[1]), int(sys.argv[2])
for traces in sys.argv[4:]:
    records = load_rollouts(traces)
    base = simulate_with(simulator.simulate_batch, records, cost, engines, "das").makespan_s
    row = [f"as is {base:.3f}"]
    for which in sys.argv[3].split(","):
        fn = patched_simulate_batch(
            (BUDGET, "                forecast = predictor.predict([problems[i] for i in active], pos[active]); "
                     f"ends = forecast.p90; cost_ends = forecast.{which}\n"),
            (PLAN, "            plan = PLAN(policy, state, np.maximum(cost_ends - pos[active], 1.0))\n"),
            PLAN=plan_split)
        t = simulate_with(fn, records, cost, engines, "das").makespan_s
        row.append(f"drafts priced at {which} {t:.3f} ({t / base:.3f})")
    print(f"{traces.split('/')[-1]}, {sys.argv[1]}, {engines} engines: " + ", ".join(row), flush=True)
