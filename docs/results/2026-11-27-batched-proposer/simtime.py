"""Simulated makespan and wall time of policies on one trace set: python simtime.py TRACES COST ENGINES POLICY[,POLICY...]"""
import sys, time
from das.drafter.records import load_rollouts
from das.scheduler.cost_model import load_cost_model
from das.scheduler.simulator import simulate
recs = load_rollouts(sys.argv[1]); cost = load_cost_model(sys.argv[2]); engines = int(sys.argv[3])
for policy in sys.argv[4].split(","):
    t0 = time.time()
    arm = simulate(recs, cost, engines, policy, k_max=16)
    print(f"{policy}: makespan {arm.makespan_s:.3f} batches {[round(b, 3) for b in arm.batches]} passes {arm.forward_passes} "
          f"verified {arm.tokens_verified} accepted {arm.accepted_tokens} ({time.time() - t0:.1f} s wall)", flush=True)
