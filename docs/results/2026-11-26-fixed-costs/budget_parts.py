"""Per-step cost of the budget hook's parts (microseconds, best of 3 x 2000 calls) for N requests on an idle core.
Usage (from the repository root): python docs/results/2026-11-26-fixed-costs/budget_parts.py N"""
import sys, timeit
sys.path.insert(0, ".")  # run from the repository root
import numpy as np
from das.scheduler.cost_model import OnlineCostModel, SHIPPED
from das.scheduler.acceptance import AcceptanceCounts
from das.scheduler.budget import BatchState, OptimalPolicy
from das.service.engine.budget_hook import budget_hook_from_config, RequestView, StepSample
n = int(sys.argv[1])
fit = OnlineCostModel(SHIPPED["smollm2"])
acc = AcceptanceCounts(8)
slots = np.array([acc.start(f"r{i}") for i in range(n)])
acc.record(slots, np.full(n, 3), np.full(n, 1))
hook = budget_hook_from_config({"prior": SHIPPED["smollm2"].__dict__}, 8)
views = [RequestView(50 + i, 300.0, 512, 8) for i in range(n)]
params = acc.params(slots)
cost = fit.current()
def T(label, f, number=2000):
    t = min(timeit.repeat(f, number=number, repeat=3)) / number * 1e6
    print(f"{label:28s} {t:7.1f} us")
T("fit.observe", lambda: fit.observe(n + 2, True, 0.05))
T("fit.current", fit.current)
T("acc.params", lambda: acc.params(slots))
T("BatchState", lambda: BatchState(np.full(n, 300.0), params.capacity, params.efficiency, cost.c_base_s, cost.c_tok_s, 8, c_spec_s=cost.c_spec_s))
st = BatchState(np.full(n, 300.0), params.capacity, params.efficiency, cost.c_base_s, cost.c_tok_s, 8, c_spec_s=cost.c_spec_s)
T("OptimalPolicy.plan", lambda: OptimalPolicy().plan(st))
T("hook.plan (all)", lambda: hook.plan(views, params))
T("hook.observe (all)", lambda: hook.observe(StepSample(0.05, n + 2, n, 2, 1)))
