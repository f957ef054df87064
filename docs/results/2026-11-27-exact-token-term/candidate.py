"""Prototype: the budget reads each request's acceptance from its current best candidate (the source chooser's
calibrated expected accepted tokens E, shaped by the draft's own cumulative probabilities: q_j = min(1, p_j E /
score)) instead of (MODE=replace) or blended with (MODE=blend) its measured acceptance. Simulated.
python docs/results/2026-11-27-exact-token-term/candidate.py TRACES COST ENGINES MODE (as-is, replace, blend)
(a copy of scheduler/simulator.py simulate_batch as of f40be3f (request by request, one drafter for all engines), with the plan's
acceptance replaced)"""
import sys
import heapq
from collections import deque
import numpy as np
from das.drafter.history import DrafterConfig, HistoryBank, accepted_prefix
from das.drafter.records import load_rollouts
from das.scheduler.acceptance import AcceptanceCounts
from das.scheduler.budget import BatchState, OptimalPolicy
from das.scheduler.cost_model import load_cost_model, CostModel
from das.scheduler.difficulty import DifficultyBook
from das.scheduler.exploration import Exploration
from das.scheduler.length import LengthPredictor
import das.scheduler.simulator as sim
from das.scheduler.simulator import EngineLimits, _placement
from das.scheduler.budget import BudgetPolicy
from collections.abc import Sequence
from das.drafter.records import RolloutRecord

MODE = sys.argv[4]


def candidate_acceptance(bank, rid, context, depth, measured):
    req = bank._requests[rid]
    indices, kinds = bank._source_list(req.problem)
    cfg = bank.config
    ctx = np.ascontiguousarray(context[-cfg.max_depth:], np.int32)
    choice = bank.chooser.choose(indices, kinds, ctx, depth, cfg.min_prob, cfg.match_factor, cfg.prior)
    q = np.zeros(depth)
    if choice.best >= 0:
        d = choice.drafts[choice.best]
        e = bank.chooser.expected(choice.cells[choice.best], d.score)
        p = np.asarray(d.probs, np.float64)
        q[:p.size] = np.minimum(1.0, p * e / max(d.score, 1e-9))
    if MODE == "blend":
        return 0.5 * (q + measured)
    return q


def simulate_batch(batch: Sequence[RolloutRecord], history: Sequence[RolloutRecord], cost: CostModel,
                   engines: int, policy: BudgetPolicy | None, placement: str, k_max: int,
                   drafter_config: DrafterConfig | None = None, oracle_lengths: bool = False,
                   engine: EngineLimits = EngineLimits()) -> tuple[float, float, int, int, int]:
    """One batch: (makespan_s, tail_share, forward_passes, tokens_verified, accepted_tokens).
    oracle_lengths: placement and budget see each request's true length instead of the predictor's.

    Each engine runs vLLM's schedule: up to `engine.max_num_seqs` requests admitted in order (longest predicted
    first), each step the decoding requests first (one token each plus their drafts), then the admitted requests'
    prompts in chunks up to `engine.step_tokens` tokens in all; the step that computes a prompt's last chunk
    samples its first output token. A step costs `cost.step_time(decode tokens, drafted, prompt tokens, decoding
    requests)`."""
    book = DifficultyBook()
    book.add_records(history)
    predictor = LengthPredictor(book)
    bank = HistoryBank(drafter_config)
    if policy is not None:
        bank.add_rollouts(history)

    problems = [r.problem_id for r in batch]
    lengths = np.array([len(r.output_token_ids) for r in batch], dtype=np.int64)
    full = [np.asarray(r.prompt_token_ids + r.output_token_ids, dtype=np.int32) for r in batch]
    prompt_len = np.array([len(r.prompt_token_ids) for r in batch], dtype=np.int64)
    if oracle_lengths:
        predicted = lengths.astype(np.float64)
    else:
        predicted = predictor.predict(problems, np.zeros(len(batch))).mean

    groups: dict[str, list[int]] = {}
    for i, p in enumerate(problems):
        groups.setdefault(p, []).append(i)
    group_ids = list(groups)
    group_load = np.array([predicted[groups[g]].sum() for g in group_ids])
    plan = _placement(placement, group_load, engines)
    waiting: list[deque[int]] = []
    for e in range(engines):
        members = [i for gi in plan.order[e] for i in groups[group_ids[gi]]]
        # longest predicted first: the order in which an engine admits and schedules them
        waiting.append(deque(sorted(members, key=lambda i: -predicted[i])))
    running: list[list[int]] = [[] for _ in range(engines)]

    ids = [f"{r.problem_id}/{i}" for i, r in enumerate(batch)]
    if policy is not None:
        for i, r in enumerate(batch):
            bank.start_request(ids[i], r.problem_id, full[i][:prompt_len[i]], r.policy_version)
    pos = np.zeros(len(batch), dtype=np.int64)
    unprefilled = prompt_len.copy()  # prompt tokens not computed yet
    finish = np.zeros(len(batch))
    acceptance = AcceptanceCounts(k_max)
    slot = np.array([acceptance.start(i) for i in ids], dtype=np.int64)
    clock = [(0.0, e) for e in range(engines) if waiting[e]]
    exploration = [Exploration() for _ in range(engines)]  # each engine explores on its own credit
    heapq.heapify(clock)
    passes = verified = accepted_total = 0
    while clock:
        now, e = heapq.heappop(clock)
        while waiting[e] and len(running[e]) < engine.max_num_seqs:
            running[e].append(waiting[e].popleft())
        admitted = np.array(running[e], dtype=np.int64)
        active = admitted[unprefilled[admitted] == 0]
        k = np.zeros(len(active), dtype=np.int64)
        floor = np.zeros(len(active))
        explored = None  # exploration's requests this pass (DraftPlan.explored)
        if policy is not None and len(active):
            if oracle_lengths:
                ends = lengths[active]
            else:  # the engine cannot know where a sample ends: it reads this p90 from the request's LengthCurve
                ends = predictor.predict([problems[i] for i in active], pos[active]).p90
            drafter = acceptance.params(slot[active])
            q = drafter.acceptance
            if MODE != "as-is":
                q = q.copy()
                for j, i in enumerate(active):
                    q[j] = candidate_acceptance(bank, ids[i], full[i][:prompt_len[i] + pos[i]], q.shape[1], q[j])
            state = BatchState(remaining=np.maximum(ends - pos[active], 1.0), acceptance=q,
                               c_base_s=cost.c_base_s, c_tok_s=cost.c_tok_s, k_max=k_max,
                               c_spec_s=cost.spec_price(len(active)))
            plan = policy.plan(state)
            if isinstance(policy, OptimalPolicy):
                plan = exploration[e].apply(plan, state, drafter.unmeasured, drafter.measured)
            k, floor, explored = plan.lengths.astype(np.int64), plan.min_prob, plan.explored
        drafted = np.zeros(len(active), dtype=np.int64)
        advanced = np.ones(len(active), dtype=np.int64)
        shadowed: list[tuple[int, int, int]] = []  # (slot, drafted, accepted) of shadow drafts settled this pass
        accepted = np.zeros(len(active), dtype=np.int64)
        for j, i in enumerate(active):
            at = prompt_len[i] + pos[i]
            if k[j] > 0:
                draft = bank.propose(ids[i], full[i][:at], int(k[j]), float(floor[j])).tokens
                drafted[j] = draft.size
                accepted[j] = accepted_prefix(draft, full[i][at:at + len(draft)])
                advanced[j] = min(accepted[j] + 1, lengths[i] - pos[i])
            elif policy is not None:  # as the proposer: acceptance measured where nothing is drafted
                bank.shadow(ids[i], full[i][:at], k_max)
            if policy is not None:
                outcome = bank.extend(ids[i], full[i][at:at + advanced[j]])
                if outcome is not None:
                    shadowed.append((slot[i], outcome.drafted, outcome.accepted))
        decode_tokens = int(len(active) + drafted.sum())
        room = max(engine.step_tokens - decode_tokens, 0)
        chunks = 0
        first: list[int] = []  # requests whose prompt is done this step: it samples their first token
        for i in admitted[unprefilled[admitted] > 0]:
            if room == 0:
                break
            chunk = int(min(room, unprefilled[i]))
            unprefilled[i] -= chunk
            room -= chunk
            chunks += chunk
            if unprefilled[i] == 0:
                first.append(i)
        step = cost.step_time(float(decode_tokens), drafted=bool(drafted.any()), prompt_tokens=float(chunks),
                              requests=float(len(active)))
        pos[active] += advanced
        for i in first:
            pos[i] = min(1, lengths[i])
            if policy is not None:
                bank.extend(ids[i], full[i][prompt_len[i]:prompt_len[i] + pos[i]])
        acceptance.record(slot[active], drafted, accepted)
        if shadowed:
            acceptance.record(*(np.array(col, np.int64) for col in zip(*shadowed)))
        if explored is not None:  # as the engine's budget hook
            exploration[e].refund(int(accepted[explored].sum()), cost, len(active))
        passes += 1
        verified += decode_tokens
        accepted_total += int(accepted.sum())
        stepped = np.concatenate([active, np.array(first, dtype=np.int64)])
        done = stepped[pos[stepped] >= lengths[stepped]]
        finish[done] = now + step
        if len(done):
            ended = set(done.tolist())
            running[e] = [i for i in running[e] if i not in ended]
            if policy is not None:
                for i in done:
                    bank.finish_request(ids[i])
        if running[e] or waiting[e]:
            heapq.heappush(clock, (now + step, e))
    makespan = float(finish.max())
    tail = (makespan - float(np.median(finish))) / makespan if makespan > 0 else 0.0
    return makespan, tail, passes, verified, accepted_total



recs = load_rollouts(sys.argv[1]); cost = load_cost_model(sys.argv[2]); engines = int(sys.argv[3])
sim.simulate_batch = simulate_batch
arm = sim.simulate(recs, cost, engines, "das", k_max=16)
print(f"{MODE}: das makespan {arm.makespan_s:.3f} s simulated, batches {[round(b, 3) for b in arm.batches]}, passes "
      f"{arm.forward_passes}, verified {arm.tokens_verified}, accepted {arm.accepted_tokens}", flush=True)
