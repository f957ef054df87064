"""Placement as the service now does it for one request per prompt (2026-11-27, the coordinator's placed-work
ledger): each group, in arrival order, onto the engine with the least predicted work placed and not yet done,
against LPT over the whole batch (one request with every group) and round robin. The package's `simulate_batch`
with its placement line patched (patched.py); das only; each policy version after the first is one batch, all
requests arriving at once. Arrival orders: the traces' order and R random shuffles (seeded).
"Engine 0 only" is what per-prompt requests got before the ledger: every one-group batch on the first engine.
python arrivals.py COST ENGINES R TRACES..."""
import sys

import numpy as np

sys.path.insert(0, "../2026-11-27-length-signals")
from patched import patched_simulate_batch, simulate_with

from das.drafter.records import load_rollouts
from das.scheduler import simulator
from das.scheduler.cost_model import load_cost_model
from das.scheduler.placement import Placement, place_groups

PLACE = "    plan = _placement(placement, group_load, engines)\n"


def arrivals(order_seed: int | None):
    """Placement of the groups one at a time in an arrival order, each onto the least loaded engine so far."""
    def place(loads: np.ndarray, engines: int) -> Placement:
        order = np.arange(loads.size)
        if order_seed is not None:
            np.random.default_rng(order_seed).shuffle(order)
        current = np.zeros(engines)
        assignment = np.empty(loads.size, dtype=np.int64)
        for g in order:
            step = place_groups(loads[[g]], engines, existing_loads=current)
            assignment[g], current = step.assignment[0], step.loads
        return Placement(assignment, current, tuple(order[assignment[order] == e] for e in range(engines)))
    return place


def main(cost_name: str, engines: int, repeats: int, traces: list[str]) -> None:
    cost = load_cost_model(cost_name)
    for path in traces:
        records = load_rollouts(path)
        lpt = simulate_with(simulator.simulate_batch, records, cost, engines, "das").makespan_s
        rr = simulate_with(simulator.simulate_batch, records, cost, engines, "das", placement="round-robin").makespan_s
        one = simulate_with(simulator.simulate_batch, records, cost, 1, "das").makespan_s
        row = [f"LPT {lpt:.3f} s", f"round robin {rr / lpt:.3f}", f"engine 0 only {one / lpt:.3f}"]
        ratios = []
        for seed in [None, *range(repeats)]:
            fn = patched_simulate_batch((PLACE, "    plan = ARRIVALS(group_load, engines)\n"),
                                        ARRIVALS=arrivals(seed))
            t = simulate_with(fn, records, cost, engines, "das").makespan_s
            if seed is None:
                row.append(f"arrivals in trace order {t / lpt:.3f}")
            else:
                ratios.append(t / lpt)
        if ratios:
            row.append(f"arrivals in {repeats} random orders median {np.median(ratios):.3f} "
                       f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
        print(f"{path.split('/')[-1]}, {cost_name}, {engines} engines (ratios to LPT): " + ", ".join(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
