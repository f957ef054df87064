"""The host time our proposer adds to an engine step, at the batch sizes of a 7B model on a GPU (64-512 running
requests): what an engine without async scheduling pays between its forward passes for drafting.

Measured on the simulator's engine (`BatchSimulation`), which runs the proposer's own draft step
(`DraftStep`: the native history bank's commit and draft calls and the budget's plan) over a
recorded batch, on one engine admitting `requests` at a time. Each step's `settle` (score the committed tokens,
feed the live segments) and `draft` (plan K_i, draft) are timed, and inside `draft` the budget's `plan`. Left out:
DasProposer's glue around the step inside vLLM (reading the runner's batch: O(changed requests)) and the
keyed draw (`das bench gpu-cost` times it on the device). Figures are medians over the steps that ran with the
batch full (at least 90% of `requests` decoding), in milliseconds, on this machine's CPU: the host of a GPU node
is faster or slower by its own single-core speed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from das.drafter.records import RolloutRecord
from das.scheduler.cost_model import CostModel
from das.scheduler.simulator import BatchSimulation, EngineLimits, make_policy


@dataclass(frozen=True)
class ProposerCost:
    """One batch size: steps measured (batch full), median ms a step of the whole draft step (settle + draft) and
    of the budget's plan within it, and the mean draft tokens a step."""

    requests: int
    steps: int
    step_ms: float
    settle_ms: float
    draft_ms: float
    budget_ms: float
    draft_tokens: float


def _timed(method: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - start)
    return wrapper


def proposer_cost(records: Sequence[RolloutRecord], cost: CostModel, requests: int, policy: str = "das",
                  k_max: int = 8, window: int = 4) -> ProposerCost:
    """The draft step's host time at `requests` running requests, over the largest policy version of `records`
    (its earlier versions as history); ValueError if no version has `requests` samples."""
    by_version: dict[int, list[RolloutRecord]] = {}
    for r in records:
        by_version.setdefault(r.policy_version, []).append(r)
    versions = [v for v in sorted(by_version) if len(by_version[v]) >= requests and v > min(by_version)]
    if not versions:
        raise ValueError(f"no policy version after the first has {requests} samples (largest: "
                         f"{max(map(len, by_version.values()))})")
    v = versions[-1]
    batch = sorted(by_version[v], key=lambda r: (r.problem_id, r.sample_index))
    history = [r for u in by_version if v - window <= u < v for r in by_version[u]]
    from das.drafter.history import DrafterConfig

    sim = BatchSimulation(batch, history, cost, 1, make_policy(policy, k_max), k_max,
                          DrafterConfig.for_drafts(k_max, window=window),
                          limits=EngineLimits(max_num_seqs=requests, step_tokens=max(8192, 2 * requests * (k_max + 1))))
    step = sim.engines[0].step
    assert step is not None
    settle: list[float] = []
    draft: list[float] = []
    plan: list[float] = []
    running: list[int] = []
    drafted: list[int] = []
    step.budget.plan = _timed(step.budget.plan, plan)  # type: ignore[method-assign]
    step.settle = _timed(step.settle, settle)  # type: ignore[method-assign]
    original_draft = step.draft

    def counted_draft(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        drafts, made = original_draft(*args, **kwargs)
        draft.append(time.perf_counter() - start)
        running.append(len(args[0]))
        drafted.append(int(drafts.offsets[-1]))
        return drafts, made

    step.draft = counted_draft  # type: ignore[method-assign]
    sim.run()
    full = [i for i, n in enumerate(running) if n >= 0.9 * requests and i < len(settle)]
    if not full:
        raise ValueError(f"no step ran with {requests} requests decoding")
    ms = lambda values: round(statistics.median(values[i] for i in full) * 1e3, 4)  # noqa: E731
    return ProposerCost(requests, len(full), ms([s + d for s, d in zip(settle, draft)]), ms(settle), ms(draft),
                        ms(plan), round(statistics.mean(drafted[i] for i in full), 2))
