"""Prototype: the budget reads each request's acceptance from its current best candidate (the source chooser's
calibrated expected accepted tokens E, shaped by the draft's own cumulative probabilities: q_j = min(1, p_j E /
score)) instead of (MODE=replace) or blended with (MODE=blend) its measured acceptance. Simulated, on the
simulator's own simulate_batch with the plan's acceptance line changed (as-is: unchanged).
python docs/results/2026-11-27-exact-token-term/candidate.py TRACES COST ENGINES MODE   MODE: as-is, replace, blend"""
import inspect
import sys

import numpy as np

import das.scheduler.simulator as sim
from das.drafter.records import load_rollouts
from das.scheduler.cost_model import load_cost_model

MODE = sys.argv[4]


def candidate_acceptance(bank, rid, context, depth, measured):
    sources = bank._source_list(bank._requests[rid].problem)
    cfg = bank.config
    ctx = np.ascontiguousarray(context[-cfg.max_depth:], np.int32)
    choice = bank.chooser.choose(sources.indices, sources.kinds, ctx, depth, cfg.min_prob, cfg.match_factor,
                                 cfg.prior)
    q = np.zeros(depth)
    if choice.best >= 0:
        d = choice.drafts[choice.best]
        e = bank.chooser.expected(choice.cells[choice.best], d.score)
        p = np.asarray(d.probs, np.float64)
        q[:p.size] = np.minimum(1.0, p * e / max(d.score, 1e-9))
    return 0.5 * (q + measured) if MODE == "blend" else q


def patched_simulate_batch():
    """The simulator's simulate_batch with each planned request's acceptance replaced by `candidate_acceptance`."""
    source = inspect.getsource(sim.simulate_batch)
    line = "            drafter = counts.params(slot[active])\n"
    assert source.count(line) == 1, "simulate_batch changed: the acceptance line to replace is not there"
    source = source.replace(line, line + (
        "            drafter = type(drafter)(np.array([candidate_acceptance(bank, ids[i], full[i][:prompt_len[i] + "
        "pos[i]], drafter.acceptance.shape[1], q) for i, q in zip(active, drafter.acceptance)]), "
        "drafter.unmeasured, drafter.measured)\n"))
    namespace = {**vars(sim), "candidate_acceptance": candidate_acceptance}
    exec(source, namespace)
    return namespace["simulate_batch"]


recs = load_rollouts(sys.argv[1]); cost = load_cost_model(sys.argv[2]); engines = int(sys.argv[3])
if MODE != "as-is":
    sim.simulate_batch = patched_simulate_batch()
arm = sim.simulate(recs, cost, engines, "das", k_max=16)
print(f"{MODE}: das makespan {arm.makespan_s:.3f} s simulated, batches {[round(b, 3) for b in arm.batches]}, passes "
      f"{arm.forward_passes}, verified {arm.tokens_verified}, accepted {arm.accepted_tokens}", flush=True)
