"""The engine's budget caps every request's predicted final length at its max_tokens (BatchView.remaining); the
simulator's budget did not. Here the budget's p90 is capped at the traces' max_tokens (the length of the samples
that finished by length). The package's `simulate_batch` patched from its source (one asserted one-line edit,
patched.py), das only.
python cap.py COST ENGINES TRACES..."""
import sys

sys.path.insert(0, "../2026-11-27-length-signals")
from patched import patched_simulate_batch, simulate_with  # noqa: E402

from das.drafter.records import load_rollouts  # noqa: E402
from das.scheduler import simulator  # noqa: E402
from das.scheduler.cost_model import load_cost_model  # noqa: E402

BUDGET = "                ends = predictor.predict([problems[i] for i in active], pos[active]).p90\n"
CAPPED = ("                ends = np.minimum(predictor.predict([problems[i] for i in active], pos[active]).p90, "
          "CAP)\n")
cost, engines = load_cost_model(sys.argv[1]), int(sys.argv[2])
for traces in sys.argv[3:]:
    records = load_rollouts(traces)
    cap = max(len(r.output_token_ids) for r in records if r.finish_reason == "length")
    base = simulate_with(simulator.simulate_batch, records, cost, engines, "das").makespan_s
    t = simulate_with(patched_simulate_batch((BUDGET, CAPPED), CAP=float(cap)), records, cost, engines,
                      "das").makespan_s
    print(f"{traces.split('/')[-1]}, {sys.argv[1]}, {engines} engines: as is {base:.3f}, p90 capped at {cap} "
          f"{t:.3f} ({t / base:.3f})", flush=True)
