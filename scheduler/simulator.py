"""`das bench simulate`: a discrete-event replay of recorded batches under an engine cost model.

Every policy version after the first is one batch. Its groups (one problem's samples) are placed on E engines;
each engine decodes its requests together, one forward pass after another, each pass costing
c_base + c_tok * (tokens verified in it, drafts included). Drafts come from the real drafter (a HistoryBank holding
the earlier versions, fed with the batch's own tokens as they are generated), cut by the policy's per-token probability floor where it has
one; accepted = longest prefix of the draft equal to the recorded continuation; a pass verifies the draft tokens
actually proposed; a request advances by accepted + 1 and ends at its recorded length. So
the only modelled parts are the step cost and the absence of prefill and of queueing beyond the batch (every
request of an engine runs from the start). Engines interleave in simulated time because they share the drafter.

All figures printed from here are simulated and labelled so.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from das.drafter.history import DrafterConfig, HistoryBank
from das.drafter.records import RolloutRecord
from das.drafter.replay import accepted_prefix
from das.scheduler.acceptance import AcceptanceCounts
from das.scheduler.budget import BatchState, BudgetPolicy, ClassPolicy, OptimalPolicy, UniformPolicy
from das.scheduler.cost_model import CostModel
from das.scheduler.difficulty import DifficultyBook
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
    tokens_verified: int = 0         # tokens processed by forward passes, drafts included
    accepted_tokens: int = 0         # draft tokens accepted
    batches: list[float] = field(default_factory=list)  # makespan per batch


def _placement(kind: str, loads: np.ndarray, engines: int) -> Placement:
    return place_groups(loads, engines) if kind == "length-aware" else round_robin(loads, engines)


def simulate_batch(batch: Sequence[RolloutRecord], history: Sequence[RolloutRecord], cost: CostModel,
                   engines: int, policy: BudgetPolicy | None, placement: str, k_max: int,
                   drafter_config: DrafterConfig | None = None) -> tuple[float, float, int, int, int]:
    """One batch: (makespan_s, tail_share, forward_passes, tokens_verified, accepted_tokens)."""
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
    predicted = predictor.predict(problems, np.zeros(len(batch))).mean

    groups: dict[str, list[int]] = {}
    for i, p in enumerate(problems):
        groups.setdefault(p, []).append(i)
    group_ids = list(groups)
    group_load = np.array([predicted[groups[g]].sum() for g in group_ids])
    plan = _placement(placement, group_load, engines)
    engine_requests: list[np.ndarray] = []
    for e in range(engines):
        members = [i for gi in plan.order[e] for i in groups[group_ids[gi]]]
        # longest predicted first: the order in which an engine admits and schedules them
        engine_requests.append(np.array(sorted(members, key=lambda i: -predicted[i]), dtype=np.int64))

    ids = [f"{r.problem_id}/{i}" for i, r in enumerate(batch)]
    if policy is not None:
        for i, r in enumerate(batch):
            bank.start_request(ids[i], r.problem_id, full[i][:prompt_len[i]], r.policy_version)
    pos = np.zeros(len(batch), dtype=np.int64)
    finish = np.zeros(len(batch))
    acceptance = AcceptanceCounts(k_max)
    slot = np.array([acceptance.start(i) for i in ids], dtype=np.int64)
    clock = [(0.0, e) for e in range(engines) if len(engine_requests[e])]
    heapq.heapify(clock)
    passes = verified = accepted_total = 0
    while clock:
        now, e = heapq.heappop(clock)
        active = engine_requests[e][pos[engine_requests[e]] < lengths[engine_requests[e]]]
        if not len(active):
            continue
        k = np.zeros(len(active), dtype=np.int64)
        floor = np.zeros(len(active))
        if policy is not None:
            forecast = predictor.predict([problems[i] for i in active], pos[active])
            drafter = acceptance.params(slot[active])
            state = BatchState(remaining=np.maximum(forecast.p90 - pos[active], 1.0), capacity=drafter.capacity,
                               efficiency=drafter.efficiency, c_base_s=cost.c_base_s, c_tok_s=cost.c_tok_s,
                               k_max=k_max)
            plan = policy.plan(state)  # the engine cannot know where a sample ends
            k, floor = plan.lengths.astype(np.int64), plan.min_prob
        drafted = np.zeros(len(active), dtype=np.int64)
        advanced = np.ones(len(active), dtype=np.int64)
        accepted = np.zeros(len(active), dtype=np.int64)
        for j, i in enumerate(active):
            at = prompt_len[i] + pos[i]
            if k[j] > 0:
                draft = bank.propose(ids[i], full[i][:at], int(k[j]), float(floor[j])).tokens
                drafted[j] = draft.size
                accepted[j] = accepted_prefix(draft, full[i][at:at + len(draft)])
                advanced[j] = min(accepted[j] + 1, lengths[i] - pos[i])
            if policy is not None:
                bank.extend(ids[i], full[i][at:at + advanced[j]])
        step = cost.step_time(float(len(active) + drafted.sum()))
        pos[active] += advanced
        acceptance.record(slot[active], drafted, accepted)
        passes += 1
        verified += int(len(active) + drafted.sum())
        accepted_total += int(accepted.sum())
        done = active[pos[active] >= lengths[active]]
        finish[done] = now + step
        if policy is not None:
            for i in done:
                bank.finish_request(ids[i])
        if len(done) < len(active):
            heapq.heappush(clock, (now + step, e))
    makespan = float(finish.max())
    tail = (makespan - float(np.median(finish))) / makespan if makespan > 0 else 0.0
    return makespan, tail, passes, verified, accepted_total


def longest_group(batch: Sequence[RolloutRecord]) -> list[RolloutRecord]:
    """The samples of the problem whose longest sample is the batch's longest (ties: the first problem by id)."""
    longest = min(batch, key=lambda r: (-len(r.output_token_ids), r.problem_id))
    return [r for r in batch if r.problem_id == longest.problem_id]


def simulate(records: Sequence[RolloutRecord], cost: CostModel, engines: int, policy_name: str,
             placement: str = "length-aware", k_max: int = 16, window: int = 4,
             on_batch: Callable[[], None] | None = None, longest_group_only: bool = False) -> ArmResult:
    """Every policy version after the first, as one batch, with the `window` versions before it as history.
    longest_group_only: each batch reduced to its longest group (see `longest_group`) on one engine: the critical
    path no placement can shorten, apart from what the batch's other requests add to its steps."""
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
        if longest_group_only:
            batch, engines = longest_group(batch), 1
        makespan, tail, passes, verified, accepted = simulate_batch(
            batch, history, cost, engines, policy, placement, k_max, DrafterConfig(window=window))
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


@dataclass
class SimulationBench:
    """Every arm (length-aware placement) plus both placements under one policy, on the same traces."""

    config: dict[str, object]
    arms: dict[str, ArmResult] = field(default_factory=dict)
    placement: dict[str, ArmResult] = field(default_factory=dict)
    longest_group: ArmResult | None = None  # the placement policy on each batch's longest group alone

    def to_dict(self) -> dict[str, object]:
        keys = ("makespan_s", "tail_share", "forward_passes", "tokens_verified", "accepted_tokens", "batches")
        pick = lambda r: {k: asdict(r)[k] for k in keys}  # noqa: E731
        return {"simulated": True, "config": self.config,
                "arms": {k: pick(v) for k, v in self.arms.items()},
                "placement": {k: pick(v) for k, v in self.placement.items()},
                "longest_group_alone": pick(self.longest_group) if self.longest_group else None,
                "ratios": self.ratios()}

    def ratios(self) -> dict[str, float]:
        out: dict[str, float] = {}
        a = self.arms
        if "das" in a and "none" in a:
            out["das/none"] = a["das"].makespan_s / a["none"].makespan_s
        uniform = [n for n in a if n.startswith("uniform-")]
        if "das" in a and uniform:
            best = min(uniform, key=lambda n: a[n].makespan_s)
            out[f"das/best-uniform ({best})"] = a["das"].makespan_s / a[best].makespan_s
        if len(self.placement) == 2:
            out["length-aware/round-robin"] = (self.placement["length-aware"].makespan_s
                                               / self.placement["round-robin"].makespan_s)
        if self.longest_group and "round-robin" in self.placement:
            # the best any placement could do relative to round robin, up to batch effects on step cost
            out["longest-group-alone/round-robin"] = (self.longest_group.makespan_s
                                                      / self.placement["round-robin"].makespan_s)
        return out

    def print(self, console) -> None:  # noqa: ANN001 - rich Console
        from rich.table import Table

        cfg = self.config
        title = (f"SIMULATED rollout makespan: {cfg['traces']} under cost model {cfg['cost_model']} "
                 f"({cfg['engines']} engines, K_max {cfg['k_max']})")
        placements = {**self.placement, **({"longest group alone": self.longest_group} if self.longest_group else {})}
        for label, rows in (("policy (length-aware placement)", self.arms),
                            (f"placement (policy {cfg['placement_policy']})", placements)):
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
                                    "c_base_s": cost.c_base_s, "c_tok_s": cost.c_tok_s, "engines": engines,
                                    "k_max": k_max, "placement_policy": placement_policy})
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("simulating", total=max(1, batches) * (len(arms) + 2))
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
        bar.update(task, description=f"simulating {placement_policy} on each batch's longest group alone")
        bench.longest_group = simulate(records, cost, 1, placement_policy, k_max=k_max,
                                       on_batch=lambda: bar.advance(task), longest_group_only=True)
    return bench
