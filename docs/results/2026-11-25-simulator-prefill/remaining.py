"""What the budget's length forecast costs das on the 66x16 traces under h100-7b at 8 engines (ad hoc: the
simulator's predictor patched; placement and admission read `.mean`, the budget `.p90`)."""
import dataclasses
import sys

import numpy as np

import das.scheduler.simulator as sim
from das.drafter.records import load_rollouts
from das.scheduler.cost_model import load_cost_model
from das.scheduler.length import LengthPredictor

CAP = 1024
variant = sys.argv[1]


class Patched(LengthPredictor):
    def predict(self, problem_ids, generated):
        p = super().predict(problem_ids, generated)
        g = np.asarray(generated, dtype=np.float64)
        if variant == "cap":
            return dataclasses.replace(p, p90=np.full_like(p.p90, CAP))
        if variant == "double":  # at least twice what was generated so far, within the cap
            return dataclasses.replace(p, p90=np.minimum(np.maximum(p.p90, 2 * g), CAP))
        return p


sim.LengthPredictor = Patched
records = load_rollouts(f"tests/fixtures/{sys.argv[2]}.jsonl.gz")
cost = load_cost_model("h100-7b")
for policy in sys.argv[3:]:
    r = sim.simulate(records, cost, 8, policy, "length-aware")
    print(f"{variant} {policy}: {r.makespan_s:.3f} s, passes {r.forward_passes}, verified {r.tokens_verified}, "
          f"accepted {r.accepted_tokens}", flush=True)
