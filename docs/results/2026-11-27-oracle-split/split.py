"""Where the oracle lengths' gain comes from: true lengths for placement only, for the engines' admission order only,
for the budget only, and for all three (the simulator's `oracle_lengths`). The package's `simulate_batch` patched
from its source (asserted one-line edits, patched.py), das only.
python split.py COST ENGINES TRACES..."""
import sys

sys.path.insert(0, "../2026-11-27-length-signals")
from patched import patched_simulate_batch, simulate_with

from das.drafter.records import load_rollouts
from das.scheduler import simulator
from das.scheduler.cost_model import load_cost_model

PLACE = "    group_load = np.array([predicted[groups[g]].sum() for g in group_ids])\n"
ORDER = "        waiting.append(deque(sorted(members, key=lambda i: -predicted[i])))\n"
BUDGET = "                ends = predictor.predict([problems[i] for i in active], pos[active]).p90\n"
EDITS = {
    "placement": [(PLACE, PLACE.replace("predicted[", "lengths["))],
    "admission": [(ORDER, ORDER.replace("predicted[", "lengths["))],
    "budget": [(BUDGET, "                ends = lengths[active].astype(np.float64)\n")],
}
cost, engines = load_cost_model(sys.argv[1]), int(sys.argv[2])
for traces in sys.argv[3:]:
    records = load_rollouts(traces)
    base = simulate_with(simulator.simulate_batch, records, cost, engines, "das").makespan_s
    row = [f"as is {base:.3f}"]
    for name, edits in EDITS.items():
        t = simulate_with(patched_simulate_batch(*edits), records, cost, engines, "das").makespan_s
        row.append(f"{name} {t:.3f} ({t / base:.3f})")
    t = simulator.simulate(records, cost, engines, "das", oracle_lengths=True).makespan_s
    row.append(f"all {t:.3f} ({t / base:.3f})")
    print(f"{traces.split('/')[-1]}, {sys.argv[1]}, {engines} engines: " + ", ".join(row), flush=True)
