"""das under h100-7b, 8 engines, with one acceptance knob changed (ad hoc patches of scheduler.acceptance)."""
import sys

import das.scheduler.acceptance as acc
import das.scheduler.simulator as sim
from das.drafter.records import load_rollouts
from das.scheduler.cost_model import load_cost_model

knob, value = sys.argv[1], float(sys.argv[2])
if knob == "prior_steps":
    orig = acc.AcceptanceCounts.params
    acc.AcceptanceCounts.params = lambda self, slots, prior_steps=value: orig(self, slots, prior_steps)
elif knob == "explore":
    acc.EXPLORE_DRAFTS = int(value)
cost = load_cost_model(sys.argv[4] if len(sys.argv) > 4 else "h100-7b")
engines = 8 if cost.name == "h100-7b" else 1
for traces in sys.argv[3].split(","):
    records = load_rollouts(f"tests/fixtures/{traces}.jsonl.gz")
    kmax = 16
    r = sim.simulate(records, cost, engines, "das", "length-aware", k_max=kmax)
    print(f"{knob}={value} {traces}: das {r.makespan_s:.3f} s passes {r.forward_passes} verified {r.tokens_verified} "
          f"accepted {r.accepted_tokens}", flush=True)
