"""Group loads for length-aware placement other than the sum of the samples' predicted mean lengths: the sum of
their p90s, or of their squared means (weighing the samples that would run long, which under das set an engine's
tail). LPT with each against round robin in the traces' order and over random group orders (as place5.py).
The package's `simulate_batch` patched from its source (one asserted one-line edit, patched.py), das only.
python place_loads.py COST ENGINES SHUFFLES TRACES..."""
import sys

import numpy as np
from patched import patched_simulate_batch

from das.drafter.history import DrafterConfig
from das.drafter.records import load_rollouts
from das.scheduler import simulator
from das.scheduler.cost_model import load_cost_model

cost, engines, shuffles = load_cost_model(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
line = "    group_load = np.array([predicted[groups[g]].sum() for g in group_ids])\n"
loads = {
    "mean (as is)": line,
    "p90": "    p90 = predictor.predict(problems, np.zeros(len(batch))).p90\n"
           "    group_load = np.array([p90[groups[g]].sum() for g in group_ids])\n",
    "mean squared": "    group_load = np.array([(predicted[groups[g]] ** 2).sum() for g in group_ids])\n",
}
variants = {name: patched_simulate_batch((line, replacement)) for name, replacement in loads.items()}
policy = simulator.make_policy("das")
for traces in sys.argv[4:]:
    by_version: dict[int, list] = {}
    for r in load_rollouts(traces):
        by_version.setdefault(r.policy_version, []).append(r)
    totals = {name: 0.0 for name in variants}
    rr, random_rr = 0.0, np.zeros(shuffles)
    rng = np.random.default_rng(0)
    for v in sorted(by_version)[1:]:
        history = [r for u in by_version if v - 4 <= u < v for r in by_version[u]]
        batch = sorted(by_version[v], key=lambda r: (r.problem_id, r.sample_index))
        config = DrafterConfig.for_drafts(16, window=4)
        for name, fn in variants.items():
            totals[name] += fn(batch, history, cost, engines, policy, "length-aware", 16, config)[0]
        rr += variants["mean (as is)"](batch, history, cost, engines, policy, "round-robin", 16, config)[0]
        pids = sorted({r.problem_id for r in batch})
        for s in range(shuffles):
            order = {p: k for k, p in enumerate(rng.permutation(pids))}
            shuffled = sorted(batch, key=lambda r: (order[r.problem_id], r.sample_index))
            random_rr[s] += variants["mean (as is)"](shuffled, history, cost, engines, policy, "round-robin", 16,
                                                     config)[0]
    median = float(np.median(random_rr))
    print(f"{traces.split('/')[-1]}, {sys.argv[1]}, {engines} engines: round robin {rr:.3f} s, random orders' median "
          f"{median:.3f} s; " + ", ".join(f"LA {name} {t:.3f} s (/RR {t / rr:.3f}, /median {t / median:.3f})"
                                         for name, t in totals.items()), flush=True)
