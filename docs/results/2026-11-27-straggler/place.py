import sys
from das.drafter.records import load_rollouts
from das.scheduler.cost_model import load_cost_model
from das.scheduler.simulator import simulate
recs = load_rollouts(sys.argv[1]); cost = load_cost_model(sys.argv[2]); E = int(sys.argv[3])
for pol in sys.argv[4].split(","):
    for oracle in (False, True):
        r = {pl: simulate(recs, cost, E, pol, pl, oracle_lengths=oracle) for pl in ("round-robin", "length-aware")}
        print(pol, "oracle" if oracle else "predicted", " ".join(f"{pl} {v.makespan_s:.2f} {[round(b,2) for b in v.batches]}" for pl, v in r.items()),
              f"LA/RR {r['length-aware'].makespan_s / r['round-robin'].makespan_s:.3f}", flush=True)
