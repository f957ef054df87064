"""The budget's length forecast: the engine plans with its length curve, the forecast's p90 at the tokens generated
so far. Would p50 or the mean serve better? The package's `simulate_batch` patched from its source (one asserted
one-line edit, patched.py: `.p90` -> `.<quantile>`), das only.
python forecast_quantile.py COST ENGINES QUANTILE[,QUANTILE...] TRACES..."""
import sys

from patched import patched_simulate_batch, simulate_with

from das.drafter.records import load_rollouts
from das.scheduler.cost_model import load_cost_model

cost, engines, quantiles = load_cost_model(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
line = "                ends = predictor.predict([problems[i] for i in active], pos[active]).p90\n"
variants = {q: patched_simulate_batch((line, line.replace(".p90", f".{q}"))) for q in quantiles}
for traces in sys.argv[4:]:
    records = load_rollouts(traces)
    results = {q: simulate_with(fn, records, cost, engines, "das").makespan_s for q, fn in variants.items()}
    base = results.get("p90")
    print(f"{traces.split('/')[-1]}, {sys.argv[1]}, {engines} engines: " + ", ".join(
        f"{q} {v:.3f} s" + (f" ({v / base:.3f})" if base else "") for q, v in results.items()), flush=True)
