"""When in a batch do the true lengths pay? The budget sees the forecast's p90 until its engine's running requests
fall to a share x of the requests placed on it, the true lengths from then on (x = 1: from the first step, the
budget-only oracle of split.py; x = 0: never, the package as is). The package's `simulate_batch` patched from its
source (one asserted one-line edit, patched.py), das only.
python reveal.py COST ENGINES SHARES TRACES...   e.g. SHARES = 1,0.75,0.5,0.25,0.1"""
import sys

sys.path.insert(0, "../2026-11-27-length-signals")
from patched import patched_simulate_batch, simulate_with  # noqa: E402

from das.drafter.records import load_rollouts  # noqa: E402
from das.scheduler import simulator  # noqa: E402
from das.scheduler.cost_model import load_cost_model  # noqa: E402

BUDGET = "                ends = predictor.predict([problems[i] for i in active], pos[active]).p90\n"
REVEALED = ("                ends = predictor.predict([problems[i] for i in active], pos[active]).p90\n"
            "                if len(running[e]) + len(waiting[e]) <= SHARE * np.count_nonzero(engine_of == e):\n"
            "                    ends = lengths[active].astype(np.float64)\n")
cost, engines = load_cost_model(sys.argv[1]), int(sys.argv[2])
shares = [float(s) for s in sys.argv[3].split(",")]
for traces in sys.argv[4:]:
    records = load_rollouts(traces)
    base = simulate_with(simulator.simulate_batch, records, cost, engines, "das").makespan_s
    row = [f"as is {base:.3f}"]
    for share in shares:
        t = simulate_with(patched_simulate_batch((BUDGET, REVEALED), SHARE=share), records, cost, engines,
                          "das").makespan_s
        row.append(f"x={share:g} {t:.3f} ({t / base:.3f})")
    print(f"{traces.split('/')[-1]}, {sys.argv[1]}, {engines} engines: " + ", ".join(row), flush=True)
