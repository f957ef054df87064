"""The budget's length forecast: the engine plans with its length curve, the forecast's p90 at the tokens generated
so far. Would p50 or the mean serve better? The package's `simulate_batch` patched from its source (one asserted
one-line edit: `.p90` -> `.<quantile>`), das only.
python forecast_quantile.py COST ENGINES QUANTILE[,QUANTILE...] TRACES..."""
import inspect
import sys

from das.drafter.records import load_rollouts
from das.scheduler import simulator
from das.scheduler.cost_model import load_cost_model

cost, engines, quantiles = load_cost_model(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
line = "                ends = predictor.predict([problems[i] for i in active], pos[active]).p90\n"
source = inspect.getsource(simulator.simulate_batch)
assert source.count(line) == 1
original = simulator.simulate_batch
variants = {}
for q in quantiles:
    namespace = dict(vars(simulator))
    exec(compile(source.replace(line, line.replace(".p90", f".{q}")), simulator.__file__, "exec"), namespace)
    variants[q] = namespace["simulate_batch"]
for traces in sys.argv[4:]:
    records = load_rollouts(traces)
    results = {}
    for q, fn in variants.items():
        simulator.simulate_batch = fn
        results[q] = simulator.simulate(records, cost, engines, "das").makespan_s
    simulator.simulate_batch = original
    base = results.get("p90")
    print(f"{traces.split('/')[-1]}, {sys.argv[1]}, {engines} engines: " + ", ".join(
        f"{q} {v:.3f} s" + (f" ({v / base:.3f})" if base else "") for q, v in results.items()), flush=True)
