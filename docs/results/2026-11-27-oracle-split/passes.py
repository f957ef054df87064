"""Forward passes, tokens verified and draft tokens accepted by das with the forecast and with the true lengths in
the budget only (split.py's "budget" edit), summed over the engines and both measured batches.
python passes.py COST ENGINES TRACES"""
import sys

sys.path.insert(0, "../2026-11-27-length-signals")
from patched import patched_simulate_batch, simulate_with  # noqa: E402

from das.drafter.records import load_rollouts  # noqa: E402
from das.scheduler import simulator  # noqa: E402
from das.scheduler.cost_model import load_cost_model  # noqa: E402

BUDGET = "                ends = predictor.predict([problems[i] for i in active], pos[active]).p90\n"
records, cost, engines = load_rollouts(sys.argv[3]), load_cost_model(sys.argv[1]), int(sys.argv[2])
for name, fn in (("as is", simulator.simulate_batch),
                 ("budget oracle", patched_simulate_batch((BUDGET, "                ends = lengths[active]"
                                                                   ".astype(np.float64)\n")))):
    r = simulate_with(fn, records, cost, engines, "das")
    print(f"{name}: makespan {r.makespan_s:.3f} s, forward passes {r.forward_passes}, tokens verified "
          f"{r.tokens_verified}, accepted {r.accepted_tokens}", flush=True)
