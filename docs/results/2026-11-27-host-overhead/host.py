"""Sensitivity of the simulated H100 figures to a host-side price per das step that the simulator does not charge:
the proposer's own time (~0.3-1 ms a step on the 2-core CPU, docs/results/2026-11-27-batched-proposer.md) and the
host work vLLM stops overlapping with the forward pass when async scheduling is off (it is for a custom_class
proposer, on for `none`). Each pass of das and of uniform-4 (our proposer too) is charged HOST_MS more; `none` as
the simulator does. The budget is not told (in an engine its live fit would see the price in c_base).
python docs/results/2026-11-27-host-overhead/host.py TRACES COST ENGINES HOST_MS[,HOST_MS...]"""
import sys
from das.drafter.records import load_rollouts
from das.scheduler.cost_model import CostModel, load_cost_model
from das.scheduler.simulator import simulate

recs = load_rollouts(sys.argv[1]); cost = load_cost_model(sys.argv[2]); engines = int(sys.argv[3])
step_time = CostModel.step_time
none = simulate(recs, cost, engines, "none", k_max=16).makespan_s
print(f"none {none:.3f} s (simulated)")
for host_ms in (float(x) for x in sys.argv[4].split(",")):
    CostModel.step_time = lambda self, *a, _h=host_ms / 1e3, **k: step_time(self, *a, **k) + _h
    das = simulate(recs, cost, engines, "das", k_max=16).makespan_s
    uniform = simulate(recs, cost, engines, "uniform-4", k_max=16).makespan_s
    CostModel.step_time = step_time
    print(f"host {host_ms:.1f} ms a step: das {das:.3f} s, uniform-4 {uniform:.3f} s; das / none {das / none:.3f}, "
          f"das / uniform-4 {das / uniform:.3f}", flush=True)
