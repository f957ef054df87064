"""`das bench simulate`: a discrete-event replay of recorded batches under an engine cost model.

Every policy version after the first is one batch. Its groups (one problem's samples) are placed on E engines;
each engine runs vLLM's schedule over its requests (`EngineLimits`: admission up to max_num_seqs, decodes first,
then prompt chunks up to the step's token budget), one forward pass after another, each pass costing
c_base + c_tok * (decode tokens, drafts included) + c_prefill * (prompt tokens) (+ c_spec + c_spec_req *
requests if it verifies drafts).
Drafts come from the real drafter (a HistoryBank holding the earlier versions, fed with the batch's own tokens as
they are generated), cut by the policy's per-token probability floor where it has one; accepted = longest prefix
of the draft equal to the recorded continuation; a pass verifies the draft tokens actually proposed; a request
advances by accepted + 1 and ends at its recorded length; a request the policy leaves without a draft keeps a
shadow draft (`HistoryBank.shadow`) whose outcome feeds its measured acceptance, as in the engine. So the
modelled parts are the step cost and the scheduler's limits; preemption and prefix-cache hits are not modelled
(every prompt is computed). Each engine drafts from its own bank, holding the history of the problems placed on
it (what it pulls from the history store), and measures acceptance on its own, as in the service.

Three references run beside the arms, to show where a policy's time goes (`SimulationBench.references`):
  * every group alone: one engine per group, so no group shares its steps (what placement could reach at best
    on any number of engines, up to the drafter history the engines share);
  * oracle lengths: the placement policy with every request's true remaining length in place of the predictor's
    (placement and budget both), i.e. what a perfect length predictor would give;
  * drafts free: every request drafts K_max every step at c_tok = 0 (each step costs c_base): about the fewest
    passes this drafter allows, so no budget policy gets far below it. Not a strict bound: a shorter draft can
    land the next step on a position where the drafter does better.

All figures printed from here are simulated and labelled so.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from das.drafter.history import DrafterConfig, HistoryBank, StepDrafts
from das.drafter.records import RolloutRecord
from das.scheduler.acceptance import AcceptanceCounts
from das.scheduler.budget import BatchState, BudgetPolicy, ClassPolicy, OptimalPolicy, UniformPolicy
from das.scheduler.cost_model import CostModel
from das.scheduler.difficulty import DifficultyBook
from das.scheduler.exploration import Exploration
from das.scheduler.length import LengthPredictor
from das.scheduler.placement import Placement, place_groups, round_robin

ARMS = ("none", "uniform-4", "uniform-8", "uniform-16", "classes", "das-token", "das")
PLACEMENTS = ("round-robin", "length-aware")


def make_policy(name: str) -> BudgetPolicy | None:
    """None means no speculation at all (the drafter is not consulted)."""
    if name == "none":
        return None
    if name.startswith("uniform-"):
        return UniformPolicy(int(name.split("-", 1)[1]))
    if name == "classes":
        return ClassPolicy()
    if name == "das":
        return OptimalPolicy()
    if name == "das-token":
        return OptimalPolicy(per_token=True)
    raise ValueError(f"unknown policy {name!r}; known: {list(ARMS)}")


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


def _placement(kind: str, loads: np.ndarray, engines: int) -> Placement:
    return place_groups(loads, engines) if kind == "length-aware" else round_robin(loads, engines)


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
    engine_of = np.zeros(len(batch), dtype=np.int64)
    for e in range(engines):
        for gi in plan.order[e]:
            engine_of[groups[group_ids[gi]]] = e
    # as in the service, each engine drafts from its own bank, holding the history of the problems it was given
    # (what it pulls from the history store), and measures acceptance on its own
    banks = [HistoryBank(drafter_config) for _ in range(engines)]
    if policy is not None:
        placed = {problems[i]: int(engine_of[i]) for i in range(len(batch))}
        for e, bank in enumerate(banks):
            bank.add_rollouts(r for r in history if placed.get(r.problem_id) == e)
    acceptance = [AcceptanceCounts(k_max) for _ in range(engines)]

    ids = [f"{r.problem_id}/{i}" for i, r in enumerate(batch)]
    # every request's whole recorded text, a row each: the drafter reads its context and commits from it in place
    table = np.zeros((len(batch), max(map(len, full), default=1)), np.int32)
    for i, tokens in enumerate(full):
        table[i, :tokens.size] = tokens
    bank_slot = np.zeros(len(batch), np.int32)
    if policy is not None:
        for i, r in enumerate(batch):
            bank_slot[i] = banks[engine_of[i]].start_request(ids[i], r.problem_id, full[i][:prompt_len[i]],
                                                             r.policy_version)
    pos = np.zeros(len(batch), dtype=np.int64)
    unprefilled = prompt_len.copy()  # prompt tokens not computed yet
    finish = np.zeros(len(batch))
    slot = np.array([acceptance[engine_of[i]].start(rid) for i, rid in enumerate(ids)], dtype=np.int64)
    clock = [(0.0, e) for e in range(engines) if waiting[e]]
    exploration = [Exploration() for _ in range(engines)]  # each engine explores on its own credit
    heapq.heapify(clock)
    passes = verified = accepted_total = 0
    while clock:
        now, e = heapq.heappop(clock)
        bank, counts = banks[e], acceptance[e]
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
            drafter = counts.params(slot[active])
            state = BatchState(remaining=np.maximum(ends - pos[active], 1.0), acceptance=drafter.acceptance,
                               c_base_s=cost.c_base_s, c_tok_s=cost.c_tok_s, k_max=k_max,
                               c_spec_s=cost.spec_price(len(active)))
            plan = policy.plan(state)
            if isinstance(policy, OptimalPolicy):
                plan = exploration[e].apply(plan, state, drafter.unmeasured, drafter.measured)
            k, floor, explored = plan.lengths.astype(np.int64), plan.min_prob, plan.explored
        drafted = np.zeros(len(active), dtype=np.int64)
        accepted = np.zeros(len(active), dtype=np.int64)
        advanced = np.ones(len(active), dtype=np.int64)
        shadowed = None  # (slots, drafted, accepted) of the shadow drafts settled this pass
        if policy is not None and len(active):
            # as the proposer: drafts from what every request had committed before this pass, then its commits;
            # a request the plan leaves without a draft keeps a shadow draft (acceptance where nothing is drafted)
            at = prompt_len[active] + pos[active]
            drafts = bank.draft_step(bank_slot[active], table, at, k.astype(np.int32), floor,
                                     np.where(k > 0, 0, k_max).astype(np.int32), rows=active)
            drafted = np.diff(drafts.offsets)
            accepted = _accepted_prefixes(drafts, table, active, at, prompt_len[active] + lengths[active])
            advanced = np.where(drafted > 0, np.minimum(accepted + 1, lengths[active] - pos[active]), 1)
            settled = bank.commit_step(bank_slot[active], table, at, at + advanced, rows=active)
            done_shadows = np.flatnonzero(settled.shadow_drafted)
            shadowed = (slot[active][done_shadows], settled.shadow_drafted[done_shadows],
                        settled.shadow_accepted[done_shadows])
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
        counts.record(slot[active], drafted, accepted)
        if shadowed is not None and shadowed[0].size:
            counts.record(*(np.asarray(col, np.int64) for col in shadowed))
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
             oracle_lengths: bool = False, engine: EngineLimits = EngineLimits()) -> ArmResult:
    """Every policy version after the first, as one batch, with the `window` versions before it as history.
    engine_per_group: as many engines as the batch has groups (`engines` is ignored), each group alone on one.
    oracle_lengths: placement and budget know every request's true length (see `simulate_batch`)."""
    if engines < 1:
        raise ValueError("engines must be >= 1")
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; known: {list(PLACEMENTS)}")
    policy = make_policy(policy_name)
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
            DrafterConfig.for_drafts(k_max, window=window), oracle_lengths, engine)
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
    policy = make_policy(policy_name)
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


REFERENCES = ("every_group_alone", "oracle_lengths", "drafts_free")


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
        return out

    def print(self, console) -> None:  # noqa: ANN001 - rich Console
        from rich.table import Table

        cfg = self.config
        title = (f"SIMULATED rollout makespan: {cfg['traces']} under cost model {cfg['cost_model']} "
                 f"({cfg['engines']} engines, K_max {cfg['k_max']})")
        references = {name.replace("_", " "): r for name, r in self.references.items()}
        for label, rows in (("policy (length-aware placement)", self.arms),
                            (f"placement (policy {cfg['placement_policy']})", self.placement),
                            (f"references (policy {cfg['placement_policy']}; drafts free: uniform-{cfg['k_max']}, "
                             f"c_tok = 0)", references)):
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
                         progress: bool = True) -> SimulationBench:
    from rich.progress import Progress

    for a in [*arms, placement_policy]:
        make_policy(a)  # reject unknown names before any work
    batches = len({r.policy_version for r in records}) - 1
    bench = SimulationBench(config={"traces": traces, "cost_model": cost.name, "cost_model_source": cost.source,
                                    "c_base_s": cost.c_base_s, "c_tok_s": cost.c_tok_s,
                                    "c_prefill_s": cost.prefill_token_s, "engine_limits": asdict(EngineLimits()),
                                    "engines": engines, "k_max": k_max, "placement_policy": placement_policy})
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("simulating", total=max(1, batches) * (len(arms) + len(PLACEMENTS) + len(REFERENCES)))
        for name in arms:
            bar.update(task, description=f"simulating {name}")
            bench.arms[name] = simulate(records, cost, engines, name, "length-aware", k_max,
                                        on_batch=lambda: bar.advance(task))
        for kind in PLACEMENTS:
            if kind == "length-aware" and placement_policy in bench.arms:
                bench.placement[kind] = bench.arms[placement_policy]
                bar.advance(task, batches)
                continue
            bar.update(task, description=f"simulating {placement_policy} with {kind} placement")
            bench.placement[kind] = simulate(records, cost, engines, placement_policy, kind, k_max,
                                             on_batch=lambda: bar.advance(task))
        bar.update(task, description=f"simulating {placement_policy} with one engine per group")
        bench.references["every_group_alone"] = simulate(records, cost, engines, placement_policy, k_max=k_max,
                                                         on_batch=lambda: bar.advance(task), engine_per_group=True)
        bar.update(task, description=f"simulating {placement_policy} with the true lengths")
        bench.references["oracle_lengths"] = simulate(records, cost, engines, placement_policy, k_max=k_max,
                                                      on_batch=lambda: bar.advance(task), oracle_lengths=True)
        bar.update(task, description=f"simulating uniform-{k_max} with free drafts")
        free = CostModel(f"{cost.name} without c_tok", cost.c_base_s, 0.0, cost.source,
                         c_prefill_s=cost.prefill_token_s)
        bench.references["drafts_free"] = simulate(records, free, engines, f"uniform-{k_max}", k_max=k_max,
                                                   on_batch=lambda: bar.advance(task))
    return bench
