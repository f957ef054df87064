"""`das bench simulate`: a discrete-event replay of recorded batches under an engine cost model.

Every policy version after the first is one batch. Its groups (one problem's samples) are placed on E engines;
each engine runs vLLM's schedule over its requests (`EngineLimits`: admission up to max_num_seqs, decodes first,
then prompt chunks up to the step's token budget), one forward pass after another, each pass costing
c_base + c_tok * (decode tokens, drafts included) + c_prefill * (prompt tokens) (+ c_spec + c_spec_req *
requests if it verifies drafts).
Drafts come from the engine's own draft step (`draft_step.DraftStep`, what the proposer runs inside vLLM: the
real drafter, a HistoryBank holding the earlier versions and fed with the batch's own tokens as they are generated,
planned by the engine's budget hook with the cost model fixed and no guard), cut by the policy's per-token
probability floor where it has one; the verifier is simulated: accepted = longest prefix
of the draft equal to the recorded continuation; a pass verifies the draft tokens actually proposed; a request
advances by accepted + 1 and ends at its recorded length; a request the policy leaves without a draft keeps a
shadow draft (`HistoryBank.shadow`) whose outcome feeds its measured acceptance, as in the engine. So the
modelled parts are the step cost and the scheduler's limits; preemption and prefix-cache hits are not modelled
(every prompt is computed). Each engine drafts from its own bank, holding the history of the problems placed on
it (what it pulls from the history store), and measures acceptance on its own, as in the service.

Four references run beside the arms, to show where a policy's time goes (`SimulationBench.references`):
  * every group alone: one engine per group, so no group shares its steps (what placement could reach at best
    on any number of engines, up to the drafter history the engines share);
  * oracle lengths: the placement policy with every request's true remaining length in place of the predictor's
    (placement and budget both), i.e. what a perfect length predictor would give;
  * drafts free: every request drafts K_max every step and its draft tokens cost nothing (a step costs what a
    plain step of its requests costs: c_base + c_tok * requests, no drafted-step price): about the fewest passes
    this drafter allows at the plain steps' price, so no budget policy gets far below it. Not a strict bound: a
    shorter draft can land the next step on a position where the drafter does better.
  * exact drafts: every request drafts its own recorded future, K_max tokens every step, all accepted, each step
    priced in full: the limit of speculation at K_max under this cost model whatever the drafter (the engine
    bench's `oracle-k` arm, simulated), against which das's saving is a share.

The host's price (`host_s`, `das bench simulate --host-ms`): vLLM runs an engine without speculation with async
scheduling, its host work a step (scheduling, input preparation, output handling) overlapped with the device's
forward pass, and an engine with a `custom_class` proposer (ours) without it, so that work lies between its
forward passes. The `none` arm is priced as the former (the cost model as given); every arm that drafts, and every
reference, as the latter: host_s added to every step, drafted or not (`CostModel.with_host`), and their budgets
plan with that price.

All figures printed from here are simulated and labelled so.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

import numpy as np

from das.drafter.history import DrafterConfig, HistoryBank, StepDrafts
from das.drafter.records import RolloutRecord
from das.scheduler.acceptance import AcceptanceCounts
from das.scheduler.budget import BudgetPolicy
from das.scheduler.budget_hook import BatchView, PolicyBudget, StepSample
from das.scheduler.cost_model import CostModel
from das.scheduler.difficulty import DifficultyBook
from das.scheduler.draft_step import DraftStep
from das.scheduler.length import LengthPredictor
from das.scheduler.placement import Placement, place_groups, round_robin
from das.scheduler.policies import BudgetBase, parse_budget

NO_SPECULATION = "none"  # the arm without speculation; every other arm is a budget name (`policies.GRAMMAR`)
ARMS = (NO_SPECULATION, "uniform-4", "uniform-8", "uniform-16", "classes", "das-token", "das-lengths", "das")
PLACEMENTS = ("round-robin", "length-aware")
# Every fixed policy the default must beat (issue 55): uniform K for each K up to K_max, the classes, and das's
# counts-based variants. `arm_list("fixed", k_max)` names them.
FIXED = "fixed"


def arm_list(spec: str, k_max: int) -> list[str]:
    """Arm names from a comma-separated list (`das bench simulate --arms`): `none` or a budget name
    (`arm_settings`), `uniform-A..B` for uniform-A to uniform-B, `fixed` for every fixed policy (uniform-1..k_max,
    classes, das-token, das-lengths). Duplicates dropped, order kept; an unknown name raises ValueError."""
    out: list[str] = []
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        if item == FIXED:
            names = [f"uniform-{k}" for k in range(1, k_max + 1)] + ["classes", "das-token", "das-lengths"]
        elif item.startswith("uniform-") and ".." in item:
            lo, _, hi = item.removeprefix("uniform-").partition("..")
            if not (lo.isdigit() and hi.isdigit() and int(lo) <= int(hi)):
                raise ValueError(f"bad arm range {item!r}: write uniform-A..B with A <= B")
            names = [f"uniform-{k}" for k in range(int(lo), int(hi) + 1)]
        else:
            arm_settings(item)
            names = [item]
        out.extend(n for n in names if n not in out)
    if not out:
        raise ValueError("no arms given")
    return out


def arm_settings(name: str) -> BudgetBase | None:
    """An arm's budget (`policies.parse_budget`, e.g. uniform-8, classes, das, das-lengths,
    das-token), or None for `none`: no speculation at all, the drafter is not consulted. The simulator prices
    steps by its own cost model, so an arm naming one (das:COST_MODEL) is refused."""
    if name == NO_SPECULATION:
        return None
    try:
        budget = parse_budget(name)
    except ValueError as exc:
        raise ValueError(f"arm {name!r}: an arm is {NO_SPECULATION} (no speculation) or a budget; {exc}") from None
    if budget.names_cost_model():
        raise ValueError(f"arm {name!r}: the simulator prices every arm by its --cost-model; name the budget "
                         f"without :COST_MODEL")
    return budget


def make_policy(name: str, k_max: int) -> BudgetPolicy | None:
    """The scheduler.budget policy of arm `name` (`arm_settings`) for drafts of at most `k_max` tokens; None means
    no speculation at all."""
    budget = arm_settings(name)
    return None if budget is None else budget.budget_policy(k_max)


@dataclass
class ArmResult:
    """Totals over the measured batches. Seconds are simulated seconds."""

    makespan_s: float = 0.0          # sum over batches of the batch makespan
    tail_share: float = 0.0          # mean over batches of (makespan - median sample finish) / makespan
    forward_passes: int = 0          # over all engines
    tokens_verified: int = 0         # decode tokens of the forward passes, drafts included (prompts not counted)
    accepted_tokens: int = 0         # draft tokens accepted
    batches: list[float] = field(default_factory=list)  # makespan per batch


@dataclass(frozen=True)
class EngineLimits:
    """The scheduler limits of one simulated engine, vLLM's names and its defaults for an engine: at most
    `max_num_seqs` requests running, at most `step_tokens` (max_num_batched_tokens) tokens computed per step,
    prompt chunks included."""

    max_num_seqs: int = 256
    step_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.step_tokens < 1:
            raise ValueError("max_num_seqs and step_tokens must be >= 1")


PlaceGroups = Callable[[np.ndarray, int], Placement]
"""A placement seam: the groups' predicted loads (tokens) and the engine count -> where each group runs."""


def placement_by_name(kind: str) -> PlaceGroups:
    """"length-aware" (`placement.place_groups`) or "round-robin"."""
    if kind not in PLACEMENTS:
        raise ValueError(f"unknown placement {kind!r}; known: {list(PLACEMENTS)}")
    return place_groups if kind == "length-aware" else round_robin


class LengthSignal(Protocol):
    """A length seam: what placement, admission order and the draft budget read of the batch's lengths (output
    tokens). `totals` is read once, before the batch runs; `ends` every step; `finished` after every step."""

    def totals(self) -> np.ndarray:
        """Each request's predicted total output length (float64 [requests]): placement and admission order."""
        ...

    def ends(self, rows: np.ndarray, generated: np.ndarray) -> np.ndarray:
        """The predicted final output length of requests `rows` that generated `generated` tokens so far (float64):
        what the draft budget plans with (the engine reads it from each request's length curve)."""
        ...

    def finished(self, rows: np.ndarray) -> None:
        """Requests `rows` have just ended (a signal may learn from them)."""
        ...


class PredictedLengths:
    """The service's signal: the length predictor over the batch's history (placement: its mean; the budget: its
    p90 given the tokens generated so far, as the request's LengthCurve gives it in the engine)."""

    def __init__(self, batch: Sequence[RolloutRecord], history: Sequence[RolloutRecord]) -> None:
        book = DifficultyBook()
        book.add_records(history)
        self.predictor = LengthPredictor(book)
        self.problems = [r.problem_id for r in batch]

    def totals(self) -> np.ndarray:
        return self.predictor.predict(self.problems, np.zeros(len(self.problems))).mean

    def ends(self, rows: np.ndarray, generated: np.ndarray) -> np.ndarray:
        return self.predictor.predict([self.problems[i] for i in rows], generated).p90

    def finished(self, rows: np.ndarray) -> None:
        pass


class TrueLengths:
    """An oracle: every request's recorded length, for placement and budget alike."""

    def __init__(self, batch: Sequence[RolloutRecord]) -> None:
        self.lengths = np.array([len(r.output_token_ids) for r in batch], dtype=np.float64)

    def totals(self) -> np.ndarray:
        return self.lengths

    def ends(self, rows: np.ndarray, generated: np.ndarray) -> np.ndarray:
        return self.lengths[rows]

    def finished(self, rows: np.ndarray) -> None:
        pass


@dataclass(frozen=True)
class BatchOutcome:
    """One simulated batch: makespan (simulated seconds), tail share ((makespan - median sample finish) / makespan),
    forward passes over all engines, decode tokens verified (drafts included) and draft tokens accepted."""

    makespan_s: float
    tail_share: float
    forward_passes: int
    tokens_verified: int
    accepted_tokens: int


_NO_CAP = np.iinfo(np.int64).max // 2  # a recorded request has no output cap beyond its recorded length


class _SimulatedEngine:
    """One engine's queues and, with a policy, its drafting: its own history bank (the history of the problems
    placed on it, what it pulls from the history store), acceptance counts and budget hook, as in the service."""

    def __init__(self, waiting: deque[int], step: DraftStep | None) -> None:
        self.waiting = waiting
        self.running: list[int] = []
        self.step = step


class BatchSimulation:
    """One batch replayed on `engines` simulated engines, step by step (`run`; one engine's step: `step`).

    Each engine runs vLLM's schedule: up to `limits.max_num_seqs` requests admitted in order (longest predicted
    first), each step the decoding requests first (one token each plus their drafts), then the admitted requests'
    prompts in chunks up to `limits.step_tokens` tokens in all; the step that computes a prompt's last chunk samples
    its first output token. A step costs `cost.step_time(decode tokens, drafted, prompt tokens, decoding requests)`.

    Drafting is the engine's own step (`draft_step.DraftStep`) over the engine's budget hook
    (`budget_hook.PolicyBudget` with `policy`, the cost model fixed at `cost` and no guard); the
    verifier is simulated: a draft's accepted tokens are its longest prefix equal to the recorded continuation.
    Seams: `signal` (the lengths placement and budget read; default `PredictedLengths`) and `place` (where groups
    run; default length-aware). `free_drafts`: draft tokens are not priced (the drafts-free reference)."""

    def __init__(self, batch: Sequence[RolloutRecord], history: Sequence[RolloutRecord], cost: CostModel,
                 engines: int, policy: BudgetPolicy | None, k_max: int, drafter_config: DrafterConfig | None = None,
                 signal: LengthSignal | None = None, place: PlaceGroups = place_groups,
                 limits: EngineLimits = EngineLimits(), exact_drafts: bool = False, free_drafts: bool = False) -> None:
        self.batch, self.cost, self.k_max, self.limits = batch, cost, k_max, limits
        self.exact_drafts, self.free_drafts = exact_drafts, free_drafts
        self.signal = signal if signal is not None else PredictedLengths(batch, history)
        self.problems = [r.problem_id for r in batch]
        self.lengths = np.array([len(r.output_token_ids) for r in batch], dtype=np.int64)
        self.full = [np.asarray(r.prompt_token_ids + r.output_token_ids, dtype=np.int32) for r in batch]
        self.prompt_len = np.array([len(r.prompt_token_ids) for r in batch], dtype=np.int64)
        self.ids = [f"{r.problem_id}/{i}" for i, r in enumerate(batch)]
        # every request's whole recorded text, a row each: the drafter reads its context and commits from it in place
        self.table = np.zeros((len(batch), max(map(len, self.full), default=1)), np.int32)
        for i, tokens in enumerate(self.full):
            self.table[i, :tokens.size] = tokens
        self.bank_slot = np.zeros(len(batch), np.int32)  # each request's slot in its engine's bank
        self.slot = np.zeros(len(batch), np.int64)  # and in its engine's acceptance counts
        self.engine_of = self._place(engines, place)
        self.engines = [self._engine(e, history, policy, drafter_config) for e in range(engines)]
        self.pos = np.zeros(len(batch), dtype=np.int64)
        self.unprefilled = self.prompt_len.copy()  # prompt tokens not computed yet
        self.finish = np.zeros(len(batch))
        self.passes = self.verified = self.accepted = 0

    def _place(self, engines: int, place: PlaceGroups) -> np.ndarray:
        """Places the groups (one problem's requests) by their predicted load and queues each engine's requests,
        longest predicted first; returns each request's engine."""
        predicted = self.signal.totals()
        groups: dict[str, list[int]] = {}
        for i, p in enumerate(self.problems):
            groups.setdefault(p, []).append(i)
        members = list(groups.values())
        plan = place(np.array([predicted[m].sum() for m in members]), engines)
        engine_of = np.zeros(len(self.batch), dtype=np.int64)
        self._queues: list[deque[int]] = []
        for e in range(engines):
            mine = [i for gi in plan.order[e] for i in members[gi]]
            engine_of[mine] = e
            self._queues.append(deque(sorted(mine, key=lambda i: -predicted[i])))
        return engine_of

    def _engine(self, e: int, history: Sequence[RolloutRecord], policy: BudgetPolicy | None,
                drafter_config: DrafterConfig | None) -> _SimulatedEngine:
        if policy is None:
            return _SimulatedEngine(self._queues[e], None)
        bank = HistoryBank(drafter_config)
        placed = {self.problems[i]: int(self.engine_of[i]) for i in range(len(self.batch))}
        bank.add_rollouts(r for r in history if placed.get(r.problem_id) == e)
        acceptance = AcceptanceCounts(self.k_max)
        hook = PolicyBudget(policy, self.k_max, self.cost, online=False, guard=False)
        for i in np.flatnonzero(self.engine_of == e):  # in batch order, as the requests arrive
            r = self.batch[i]
            self.bank_slot[i] = bank.start_request(self.ids[i], r.problem_id, self.full[i][:self.prompt_len[i]],
                                                   r.policy_version, sample_key=r.sample_key)
            self.slot[i] = acceptance.start(self.ids[i])
        return _SimulatedEngine(self._queues[e], DraftStep(bank, hook, acceptance, self.k_max))

    def run(self) -> BatchOutcome:
        """Every engine's steps, in simulated time order, until every request ended."""
        clock = [(0.0, e) for e, engine in enumerate(self.engines) if engine.waiting]
        heapq.heapify(clock)
        while clock:
            now, e = heapq.heappop(clock)
            step_s = self.step(e, now)
            engine = self.engines[e]
            if engine.running or engine.waiting:
                heapq.heappush(clock, (now + step_s, e))
        makespan = float(self.finish.max())
        tail = (makespan - float(np.median(self.finish))) / makespan if makespan > 0 else 0.0
        return BatchOutcome(makespan, tail, self.passes, self.verified, self.accepted)

    def step(self, e: int, now: float) -> float:
        """Engine e's step starting at simulated time `now`; returns its duration (simulated seconds)."""
        engine, limits = self.engines[e], self.limits
        while engine.waiting and len(engine.running) < limits.max_num_seqs:
            engine.running.append(engine.waiting.popleft())
        admitted = np.array(engine.running, dtype=np.int64)
        active = admitted[self.unprefilled[admitted] == 0]
        drafted = np.zeros(len(active), dtype=np.int64)
        accepted = np.zeros(len(active), dtype=np.int64)
        advanced = np.ones(len(active), dtype=np.int64)
        explored_accepted = 0
        if engine.step is not None and len(active):
            drafted, accepted, advanced, explored_accepted = self._draft_and_verify(engine.step, active)
        elif self.exact_drafts and len(active):  # the future itself: all accepted, the last token the bonus
            drafted = np.clip(self.lengths[active] - self.pos[active] - 1, 0, self.k_max)
            accepted, advanced = drafted, drafted + 1
        decode_tokens = int(len(active) + drafted.sum())
        first, chunks = self._prefill(admitted, max(limits.step_tokens - decode_tokens, 0))
        priced = len(active) if self.free_drafts else decode_tokens
        step_s = self.cost.step_time(float(priced), drafted=bool(drafted.any()) and not self.free_drafts,
                                     prompt_tokens=float(chunks), requests=float(len(active)))
        self.pos[active] += advanced
        for i in first:
            self.pos[i] = min(1, self.lengths[i])
            if engine.step is not None:
                engine.step.bank.extend(self.ids[i], self.full[i][self.prompt_len[i]:self.prompt_len[i] + self.pos[i]])
        if engine.step is not None and len(active):  # as the engine's proposer hands its budget hook the step
            engine.step.budget.observe(StepSample(step_s, decode_tokens, len(active), int(drafted.sum()),
                                                  int(accepted.sum()), explored_accepted=explored_accepted))
        self.passes += 1
        self.verified += decode_tokens
        self.accepted += int(accepted.sum())
        stepped = np.concatenate([active, np.array(first, dtype=np.int64)])
        done = stepped[self.pos[stepped] >= self.lengths[stepped]]
        self.finish[done] = now + step_s
        if len(done):
            ended = set(done.tolist())
            engine.running = [i for i in engine.running if i not in ended]
            if engine.step is not None:
                for i in done:
                    engine.step.bank.finish_request(self.ids[i])
            self.signal.finished(done)
        return step_s

    def _draft_and_verify(self, step: DraftStep, active: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """The engine's draft step for the decoding requests `active`, then the simulated verification and the
        commit that settles it: (draft tokens, accepted tokens, tokens advanced, per request; accepted tokens of
        exploration's drafts)."""
        pos, lengths = self.pos[active], self.lengths[active]
        view = BatchView(pos, self.signal.ends(active, pos).astype(np.float64), np.full(len(active), _NO_CAP),
                         np.full(len(active), np.nan))
        at = self.prompt_len[active] + pos
        drafts, plan = step.draft(self.slot[active], self.bank_slot[active], view, self.table, at,
                                  np.full(len(active), self.k_max), rows=active)
        drafted = np.diff(drafts.offsets).astype(np.int64)
        accepted = _accepted_prefixes(drafts, self.table, active, at, self.prompt_len[active] + lengths)
        advanced = np.where(drafted > 0, np.minimum(accepted + 1, lengths - pos), 1)
        settled = step.settle(self.slot[active], self.bank_slot[active], self.table, at, at + advanced,
                              explored=plan.explored, rows=active, verified_accepted=accepted)
        return drafted, accepted, advanced, settled.explored_accepted

    def _prefill(self, admitted: np.ndarray, room: int) -> tuple[list[int], int]:
        """Prompt chunks of the admitted requests, in order, up to `room` tokens: (the requests whose prompt is done
        this step, the prompt tokens computed)."""
        chunks = 0
        first: list[int] = []
        for i in admitted[self.unprefilled[admitted] > 0]:
            if room == 0:
                break
            chunk = int(min(room, self.unprefilled[i]))
            self.unprefilled[i] -= chunk
            room -= chunk
            chunks += chunk
            if self.unprefilled[i] == 0:
                first.append(i)
        return first, chunks


def simulate_batch(batch: Sequence[RolloutRecord], history: Sequence[RolloutRecord], cost: CostModel,
                   engines: int, policy: BudgetPolicy | None, placement: str, k_max: int,
                   drafter_config: DrafterConfig | None = None, oracle_lengths: bool = False,
                   engine: EngineLimits = EngineLimits(), exact_drafts: bool = False,
                   free_drafts: bool = False) -> tuple[float, float, int, int, int]:
    """One batch (`BatchSimulation`): (makespan_s, tail_share, forward_passes, tokens_verified, accepted_tokens).
    oracle_lengths: placement and budget see each request's true length instead of the predictor's.
    exact_drafts (with no policy): every request drafts its recorded future at K_max. free_drafts: draft tokens
    are not priced."""
    signal = TrueLengths(batch) if oracle_lengths else PredictedLengths(batch, history)
    out = BatchSimulation(batch, history, cost, engines, policy, k_max, drafter_config, signal,
                          placement_by_name(placement), engine, exact_drafts, free_drafts).run()
    return out.makespan_s, out.tail_share, out.forward_passes, out.tokens_verified, out.accepted_tokens


def _accepted_prefixes(drafts: StepDrafts, table: np.ndarray, rows: np.ndarray, at: np.ndarray,
                       ends: np.ndarray) -> np.ndarray:
    """Per request, the tokens of its draft that a verifier accepts along its recorded text table[rows[r]]: the
    longest prefix of the draft equal to the text from column at[r], which ends at column ends[r]. Vectorised."""
    lengths = np.diff(drafts.offsets)
    accepted = np.zeros(len(rows), dtype=np.int64)
    drafting = np.flatnonzero(lengths)
    if not drafting.size:
        return accepted
    owner = np.repeat(np.arange(len(rows)), lengths)
    offset = np.arange(drafts.tokens.size) - drafts.offsets[:-1][owner]
    column = at[owner] + offset
    holds = (column < ends[owner]) & (table[rows[owner], np.minimum(column, table.shape[1] - 1)] == drafts.tokens)
    first_miss = np.where(holds, np.iinfo(np.int64).max, offset)
    accepted[drafting] = np.minimum(np.minimum.reduceat(first_miss, drafts.offsets[:-1][drafting]), lengths[drafting])
    return accepted


def simulate(records: Sequence[RolloutRecord], cost: CostModel, engines: int, policy_name: str,
             placement: str = "length-aware", k_max: int = 16, window: int = 4,
             on_batch: Callable[[], None] | None = None, engine_per_group: bool = False,
             oracle_lengths: bool = False, engine: EngineLimits = EngineLimits(),
             exact_drafts: bool = False, free_drafts: bool = False) -> ArmResult:
    """Every policy version after the first, as one batch, with the `window` versions before it as history.
    engine_per_group: as many engines as the batch has groups (`engines` is ignored), each group alone on one.
    oracle_lengths: placement and budget know every request's true length (see `simulate_batch`).
    exact_drafts: policy_name "none" with every request drafting its recorded future at k_max. free_drafts: draft
    tokens are not priced (the drafts-free reference)."""
    if exact_drafts and policy_name != "none":
        raise ValueError("exact drafts replace the drafter and its budget: simulate them with policy 'none'")
    if engines < 1:
        raise ValueError("engines must be >= 1")
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; known: {list(PLACEMENTS)}")
    policy = make_policy(policy_name, k_max)
    by_version: dict[int, list[RolloutRecord]] = {}
    for r in records:
        by_version.setdefault(r.policy_version, []).append(r)
    versions = sorted(by_version)
    if len(versions) < 2:
        raise ValueError(f"the simulation needs at least two policy versions, found {versions}")
    result = ArmResult()
    tails = []
    for v in versions[1:]:
        history = [r for u in versions if v - window <= u < v for r in by_version[u]]
        batch = sorted(by_version[v], key=lambda r: (r.problem_id, r.sample_index))
        batch_engines = len({r.problem_id for r in batch}) if engine_per_group else engines
        makespan, tail, passes, verified, accepted = simulate_batch(
            batch, history, cost, batch_engines, policy, placement, k_max,
            DrafterConfig.for_drafts(k_max, window=window), oracle_lengths, engine, exact_drafts, free_drafts)
        result.makespan_s += makespan
        result.batches.append(makespan)
        result.forward_passes += passes
        result.tokens_verified += verified
        result.accepted_tokens += accepted
        tails.append(tail)
        if on_batch:
            on_batch()
    result.tail_share = float(np.mean(tails))
    return result


@dataclass(frozen=True)
class BatchReplay:
    """One policy version replayed as one batch (simulated seconds): what `replay_versions` returns per version."""

    version: int
    makespan_s: float
    tail_share: float
    forward_passes: int
    tokens_verified: int
    accepted_tokens: int


def replay_versions(records: Sequence[RolloutRecord], cost: CostModel, policy_name: str, engines: int = 1,
                    k_max: int = 16, window: int = 4, placement: str = "length-aware",
                    engine: EngineLimits = EngineLimits()) -> list[BatchReplay]:
    """Every policy version as one batch, the first included (with no history: the drafter and the length
    predictor start empty, as a fresh engine does), each with the `window` versions before it as history. This is
    `simulate` per batch for comparing with a measured run batch by batch (`das bench validate`)."""
    if engines < 1:
        raise ValueError("engines must be >= 1")
    policy = make_policy(policy_name, k_max)
    by_version: dict[int, list[RolloutRecord]] = {}
    for r in records:
        by_version.setdefault(r.policy_version, []).append(r)
    out = []
    for v in sorted(by_version):
        history = [r for u in sorted(by_version) if v - window <= u < v for r in by_version[u]]
        batch = sorted(by_version[v], key=lambda r: (r.problem_id, r.sample_index))
        makespan, tail, passes, verified, accepted = simulate_batch(
            batch, history, cost, engines, policy, placement, k_max, DrafterConfig.for_drafts(k_max, window=window),
            engine=engine)
        out.append(BatchReplay(v, makespan, tail, passes, verified, accepted))
    return out


REFERENCES = ("every_group_alone", "oracle_lengths", "drafts_free", "exact_drafts")


@dataclass
class SimulationBench:
    """Every arm (length-aware placement), both placements under one policy, and the references (module
    docstring; keys of REFERENCES), on the same traces."""

    config: dict[str, object]
    arms: dict[str, ArmResult] = field(default_factory=dict)
    placement: dict[str, ArmResult] = field(default_factory=dict)
    references: dict[str, ArmResult] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        keys = ("makespan_s", "tail_share", "forward_passes", "tokens_verified", "accepted_tokens", "batches")
        pick = lambda r: {k: asdict(r)[k] for k in keys}  # noqa: E731
        return {"simulated": True, "config": self.config,
                "arms": {k: pick(v) for k, v in self.arms.items()},
                "placement": {k: pick(v) for k, v in self.placement.items()},
                "references": {k: pick(v) for k, v in self.references.items()},
                "ratios": self.ratios()}

    def ratios(self) -> dict[str, float]:
        out: dict[str, float] = {}
        a = self.arms
        if "das" in a and "none" in a:
            out["das/none"] = a["das"].makespan_s / a["none"].makespan_s
        uniform = [n for n in a if n.startswith("uniform-")]
        best = min(uniform, key=lambda n: a[n].makespan_s) if uniform else None
        if "das" in a and best:
            out[f"das/best-uniform ({best})"] = a["das"].makespan_s / a[best].makespan_s
        fixed = [n for n in a if n not in ("none", "das")]
        if "das" in a and fixed:  # das against the best of every other drafting arm run
            best_fixed = min(fixed, key=lambda n: a[n].makespan_s)
            out[f"das/best-fixed ({best_fixed})"] = a["das"].makespan_s / a[best_fixed].makespan_s
        if len(self.placement) == 2:
            out["length-aware/round-robin"] = (self.placement["length-aware"].makespan_s
                                               / self.placement["round-robin"].makespan_s)
        ref = self.references
        policy = str(self.config["placement_policy"])
        if "every_group_alone" in ref and "round-robin" in self.placement:
            # the best any placement could do relative to round robin
            out["every-group-alone/round-robin"] = (ref["every_group_alone"].makespan_s
                                                    / self.placement["round-robin"].makespan_s)
        if "oracle_lengths" in ref and policy in a:
            out[f"oracle-lengths/{policy}"] = ref["oracle_lengths"].makespan_s / a[policy].makespan_s
        if "drafts_free" in ref:
            if "none" in a:
                out["drafts-free/none"] = ref["drafts_free"].makespan_s / a["none"].makespan_s
            if best:
                out[f"drafts-free/best-uniform ({best})"] = ref["drafts_free"].makespan_s / a[best].makespan_s
            if "das" in a:
                out["das/drafts-free"] = a["das"].makespan_s / ref["drafts_free"].makespan_s
        if "exact_drafts" in ref and "none" in a:
            none, exact = a["none"].makespan_s, ref["exact_drafts"].makespan_s
            out["exact-drafts/none"] = exact / none
            if "das" in a and exact < none:  # the share of perfect drafts' saving das reaches (issue 49's figure)
                out["das share of the exact drafts' saving"] = (none - a["das"].makespan_s) / (none - exact)
        return out

    def print(self, console) -> None:  # noqa: ANN001 - rich Console
        from rich.table import Table

        cfg = self.config
        title = (f"SIMULATED rollout makespan: {cfg['traces']} under cost model {cfg['cost_model']} "
                 f"({cfg['engines']} engines, K_max {cfg['k_max']}, host {cfg.get('host_ms_per_step', 0)} ms a "
                 f"drafting step)")
        references = {name.replace("_", " "): r for name, r in self.references.items()}
        for label, rows in (("policy (length-aware placement)", self.arms),
                            (f"placement (policy {cfg['placement_policy']})", self.placement),
                            (f"references (policy {cfg['placement_policy']}; drafts free: uniform-{cfg['k_max']}, "
                             f"draft tokens unpriced; exact drafts: the recorded future at K_max)", references)):
            table = Table(title=f"{title}: {label}")
            for col in ("arm", "makespan s (simulated)", "tail share", "forward passes", "tokens verified",
                        "accepted"):
                table.add_column(col, justify="left" if col == "arm" else "right")
            for name, r in rows.items():
                table.add_row(name, f"{r.makespan_s:.2f}", f"{r.tail_share:.3f}", str(r.forward_passes),
                              str(r.tokens_verified), str(r.accepted_tokens))
            console.print(table)
        for k, v in self.ratios().items():
            console.print(f"simulated {k}: x{v:.3f}")
        console.print(f"cost model source: {cfg['cost_model_source']}")


def run_simulation_bench(records: Sequence[RolloutRecord], traces: str, cost: CostModel, engines: int,
                         arms: Sequence[str] = ARMS, placement_policy: str = "das", k_max: int = 16,
                         progress: bool = True, host_s: float = 0.0,
                         references: Sequence[str] = REFERENCES, placements: bool = True) -> SimulationBench:
    """Every arm, both placements (unless not `placements`) and the `references` (SimulationBench); `host_s`: the
    host's price a step of an engine that drafts (module docstring), 0 for none."""
    from rich.progress import Progress

    for a in [*arms, placement_policy]:
        make_policy(a, k_max)  # reject unknown names before any work
    unknown = sorted(set(references) - set(REFERENCES))
    if unknown:
        raise ValueError(f"unknown references {unknown}; known: {list(REFERENCES)}")
    host_priced = cost.with_host(host_s)
    batches = len({r.policy_version for r in records}) - 1
    bench = SimulationBench(config={"traces": traces, "cost_model": cost.name, "cost_model_source": cost.source,
                                    "c_base_s": cost.c_base_s, "c_tok_s": cost.c_tok_s,
                                    "c_prefill_s": cost.prefill_token_s, "engine_limits": asdict(EngineLimits()),
                                    "engines": engines, "k_max": k_max, "placement_policy": placement_policy,
                                    "host_ms_per_step": round(host_s * 1e3, 4)})
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("simulating", total=max(1, batches) * (len(arms) + len(PLACEMENTS) * placements
                                                                  + len(references)))
        for name in arms:
            bar.update(task, description=f"simulating {name}")
            bench.arms[name] = simulate(records, cost if name == "none" else host_priced, engines, name, "length-aware",
                                        k_max, on_batch=lambda: bar.advance(task))
        for kind in PLACEMENTS if placements else ():
            if kind == "length-aware" and placement_policy in bench.arms:
                bench.placement[kind] = bench.arms[placement_policy]
                bar.advance(task, batches)
                continue
            bar.update(task, description=f"simulating {placement_policy} with {kind} placement")
            bench.placement[kind] = simulate(records, host_priced, engines, placement_policy, kind, k_max,
                                             on_batch=lambda: bar.advance(task))
        runs = {"every_group_alone": (f"{placement_policy} with one engine per group",
                                      dict(policy_name=placement_policy, engine_per_group=True)),
                "oracle_lengths": (f"{placement_policy} with the true lengths",
                                   dict(policy_name=placement_policy, oracle_lengths=True)),
                "drafts_free": (f"uniform-{k_max} with free drafts",
                                dict(policy_name=f"uniform-{k_max}", free_drafts=True)),
                "exact_drafts": (f"the recorded futures as drafts at K_max {k_max}",
                                 dict(policy_name="none", exact_drafts=True))}
        for name in REFERENCES:
            if name in references:
                label, kwargs = runs[name]
                bar.update(task, description=f"simulating {label}")
                bench.references[name] = simulate(records, host_priced, engines, k_max=k_max,
                                                  on_batch=lambda: bar.advance(task), **kwargs)
    return bench
