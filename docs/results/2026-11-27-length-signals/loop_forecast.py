"""Would the budget gain from knowing that a sample repeats itself? A sample whose last W output tokens already
occurred earlier in its own output is forecast to run to the cap (max over the traces' lengths); everything else
as the engine forecasts (its length curve's p90). The package's `simulate_batch` is patched from its source (two
asserted one-line edits, patched.py), das only, against the unpatched simulator and the oracle lengths.
python loop_forecast.py COST ENGINES W TRACES..."""
import sys

import numpy as np
from patched import patched_simulate_batch, simulate_with

from das.drafter.records import load_rollouts
from das.scheduler import simulator
from das.scheduler.cost_model import load_cost_model

cost, engines, window = load_cost_model(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])


def loop_positions(batch, w: int = window) -> np.ndarray:
    """Per sample, the output tokens generated when its last w tokens first repeat earlier output (inf: never)."""
    out = np.full(len(batch), np.inf)
    for i, r in enumerate(batch):
        seen, tokens = set(), r.output_token_ids
        for g in range(w, len(tokens) + 1):
            key = tuple(tokens[g - w:g])
            if key in seen:
                out[i] = g
                break
            seen.add(key)
    return out


EDITS = [
    ("    lengths = np.array([len(r.output_token_ids) for r in batch], dtype=np.int64)\n",
     "    lengths = np.array([len(r.output_token_ids) for r in batch], dtype=np.int64)\n"
     "    loop_at = LOOP_POSITIONS(batch)\n"),
    ("                ends = predictor.predict([problems[i] for i in active], pos[active]).p90\n",
     "                ends = predictor.predict([problems[i] for i in active], pos[active]).p90\n"
     "                ends = np.where(loop_at[active] <= pos[active], CAP, ends)\n"),
]
for traces in sys.argv[4:]:
    records = load_rollouts(traces)
    cap = float(max(len(r.output_token_ids) for r in records))
    patched = patched_simulate_batch(*EDITS, CAP=cap, LOOP_POSITIONS=loop_positions)
    results = {}
    for name, fn, oracle in (("as is", simulator.simulate_batch, False), ("loop forecast", patched, False),
                             ("oracle lengths", simulator.simulate_batch, True)):
        results[name] = simulate_with(fn, records, cost, engines, "das", oracle_lengths=oracle).makespan_s
    print(f"{traces.split('/')[-1]}, {sys.argv[1]}, {engines} engines, W={window}: "
          + ", ".join(f"{k} {v:.3f} s" for k, v in results.items())
          + f"; loop / as is {results['loop forecast'] / results['as is']:.3f}, "
            f"oracle / as is {results['oracle lengths'] / results['as is']:.3f}", flush=True)
