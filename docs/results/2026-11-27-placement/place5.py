"""Length-aware (LPT) against round robin over several trace sets and engine counts, with round robin also over
random group orders (a random placement):
python docs/results/2026-11-27-placement/place5.py COST ENGINES[,ENGINES...] SHUFFLES TRACES..."""
import sys
import numpy as np
from das.drafter.history import DrafterConfig
from das.drafter.records import load_rollouts
from das.scheduler.cost_model import load_cost_model
from das.scheduler.simulator import make_policy, simulate_batch

cost = load_cost_model(sys.argv[1])
engine_counts = [int(e) for e in sys.argv[2].split(",")]
shuffles = int(sys.argv[3])
policy = make_policy("das")
for traces in sys.argv[4:]:
    recs = load_rollouts(traces)
    by_v = {}
    for r in recs:
        by_v.setdefault(r.policy_version, []).append(r)
    for engines in engine_counts:
        rng = np.random.default_rng(0)
        la = rr = 0.0
        random_rr = np.zeros(shuffles)
        for v in sorted(by_v)[1:]:
            history = [r for u in by_v if v - 4 <= u < v for r in by_v[u]]
            batch = sorted(by_v[v], key=lambda r: (r.problem_id, r.sample_index))
            run = lambda b, kind: simulate_batch(b, history, cost, engines, policy, kind, 16, DrafterConfig(window=4))[0]
            la += run(batch, "length-aware")
            rr += run(batch, "round-robin")
            pids = sorted({r.problem_id for r in batch})
            for s in range(shuffles):
                order = {p: k for k, p in enumerate(rng.permutation(pids))}
                random_rr[s] += run(sorted(batch, key=lambda r: (order[r.problem_id], r.sample_index)), "round-robin")
        groups = len({r.problem_id for r in recs})
        print(f"{traces.split('/')[-1]} ({groups} problems), {engines} engines: LA {la:.3f}, RR {rr:.3f} (LA/RR "
              f"{la / rr:.3f}); RR over {shuffles} random orders median {np.median(random_rr):.3f} "
              f"(min {random_rr.min():.3f}, max {random_rr.max():.3f}): LA / median {la / np.median(random_rr):.3f}, "
              f"LA beats {int((la < random_rr).sum())} of {shuffles}", flush=True)
