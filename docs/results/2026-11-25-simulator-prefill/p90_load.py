"""Length-aware placement with each sample's load at its forecast's p90 instead of its mean (ad hoc: the
simulator's predictor patched so that `.mean` reads `.p90`; in simulate_batch only placement and admission order
read `.mean`). das under h100-7b at 8 engines on the three bundled trace sets."""
import dataclasses
import sys

import das.scheduler.simulator as sim
from das.drafter.records import load_rollouts
from das.scheduler.cost_model import load_cost_model
from das.scheduler.length import LengthPredictor


class P90Load(LengthPredictor):
    def predict(self, problem_ids, generated):
        p = super().predict(problem_ids, generated)
        return dataclasses.replace(p, mean=p.p90)


cost = load_cost_model("h100-7b")
for traces in sys.argv[1:]:
    records = load_rollouts(f"tests/fixtures/{traces}.jsonl.gz")
    sim.LengthPredictor = LengthPredictor
    mean = sim.simulate(records, cost, 8, "das", "length-aware").makespan_s
    rr = sim.simulate(records, cost, 8, "das", "round-robin").makespan_s
    sim.LengthPredictor = P90Load
    p90 = sim.simulate(records, cost, 8, "das", "length-aware").makespan_s
    print(f"{traces}: length-aware mean {mean:.3f}  p90 {p90:.3f}  round-robin {rr:.3f}  "
          f"p90/rr {p90 / rr:.3f}  mean/rr {mean / rr:.3f}", flush=True)
