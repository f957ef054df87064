"""Would the forecast gain from the batch's own finished siblings? The engine's length curve is fixed at submission
from the problem's earlier versions; here, as each sample finishes, its length joins the forecaster's book (the
same problem's current version), so the running siblings' forecasts condition on it from the next pass on. The
package's `simulate_batch` patched from its source (one asserted one-line edit, patched.py), das only.
python sibling_lengths.py COST ENGINES TRACES..."""
import sys

from patched import patched_simulate_batch, simulate_with

from das.drafter.records import load_rollouts
from das.scheduler import simulator
from das.scheduler.cost_model import load_cost_model

cost, engines = load_cost_model(sys.argv[1]), int(sys.argv[2])
patched = patched_simulate_batch(("        finish[done] = now + step\n",
                                  "        finish[done] = now + step\n"
                                  "        book.add_records(batch[i] for i in done.tolist())\n"))
for traces in sys.argv[3:]:
    records = load_rollouts(traces)
    a, b = (simulate_with(fn, records, cost, engines, "das").makespan_s for fn in (simulator.simulate_batch, patched))
    print(f"{traces.split('/')[-1]}, {sys.argv[1]}, {engines} engines: as is {a:.3f} s, with finished siblings "
          f"{b:.3f} s ({b / a:.3f})", flush=True)
