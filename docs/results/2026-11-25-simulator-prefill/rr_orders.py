"""Round robin's makespan depends on the order groups arrive in; LPT's does not. Replays das on the 66x16 SmolLM2
traces under h100-7b at 8 engines with round-robin placement over random group orders (problem ids relabelled
consistently across versions, so only the arrival order changes), beside length-aware placement.
Usage: python rr_orders.py ORDERS SEED"""
import dataclasses
import json
import sys

import numpy as np

from das.drafter.records import load_rollouts
from das.scheduler.cost_model import load_cost_model
from das.scheduler.simulator import simulate

orders, seed = int(sys.argv[1]), int(sys.argv[2])
records = load_rollouts("tests/fixtures/traces-smollm2-66x16.jsonl.gz")
cost = load_cost_model("h100-7b")
problems = sorted({r.problem_id for r in records})
out = {"length-aware": simulate(records, cost, 8, "das", "length-aware").makespan_s, "round-robin": []}
print("length-aware", out["length-aware"], flush=True)
rng = np.random.default_rng(seed)
for k in range(orders):
    perm = rng.permutation(len(problems))
    rename = {p: f"{perm[i]:03d}/{p}" for i, p in enumerate(problems)}
    shuffled = [dataclasses.replace(r, problem_id=rename[r.problem_id]) for r in records]
    m = simulate(shuffled, cost, 8, "das", "round-robin").makespan_s
    out["round-robin"].append(m)
    print("round-robin", k, m, flush=True)
rr = np.array(out["round-robin"])
out["summary"] = {"rr_median": float(np.median(rr)), "rr_min": float(rr.min()), "rr_max": float(rr.max()),
                  "length_aware_over_rr_median": out["length-aware"] / float(np.median(rr)),
                  "rr_orders_beating_length_aware": int((rr < out["length-aware"]).sum())}
print(json.dumps(out["summary"]))
json.dump(out, open(sys.argv[3] if len(sys.argv) > 3 else "/tmp/place/rr_orders.json", "w"), indent=1)
