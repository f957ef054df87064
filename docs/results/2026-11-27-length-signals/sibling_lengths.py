"""Would the forecast gain from the batch's own finished siblings? The engine's length curve is fixed at submission
from the problem's earlier versions; here, as each sample finishes, its length joins the forecaster's book (the
same problem's current version), so the running siblings' forecasts condition on it from the next pass on. The
package's `simulate_batch` patched from its source (one asserted one-line edit), das only.
python sibling_lengths.py COST ENGINES TRACES..."""
import inspect
import sys

from das.drafter.records import load_rollouts
from das.scheduler import simulator
from das.scheduler.cost_model import load_cost_model

cost, engines = load_cost_model(sys.argv[1]), int(sys.argv[2])
old = "        finish[done] = now + step\n"
new = "        finish[done] = now + step\n        book.add_records(batch[i] for i in done.tolist())\n"
source = inspect.getsource(simulator.simulate_batch)
assert source.count(old) == 1
namespace = dict(vars(simulator))
exec(compile(source.replace(old, new), simulator.__file__, "exec"), namespace)
patched, original = namespace["simulate_batch"], simulator.simulate_batch
for traces in sys.argv[3:]:
    records = load_rollouts(traces)
    results = {}
    for name, fn in (("as is", original), ("finished siblings in the book", patched)):
        simulator.simulate_batch = fn
        results[name] = simulator.simulate(records, cost, engines, "das").makespan_s
    simulator.simulate_batch = original
    a, b = results.values()
    print(f"{traces.split('/')[-1]}, {sys.argv[1]}, {engines} engines: as is {a:.3f} s, with finished siblings "
          f"{b:.3f} s ({b / a:.3f})", flush=True)
