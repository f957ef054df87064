"""Where the proposer asks how many draft tokens each running request gets this step.

The policies themselves live in `das.scheduler.budget` (uniform K, the three length classes, the length-aware
optimum); this module turns the proposer's view of its batch into their `BatchState` and back. The scheduler
tunes a hook by its configuration (`{"policy": ..., ...}` in `additional_config["das"]["budget"]`) and informs it
per request through `RequestTags.length_curve` (the scheduler's forecast, re-read every step as the sample grows) or
`RequestTags.predicted_tokens` (one number, fixed at submission).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from das.scheduler.budget import (
    BatchState,
    BudgetPolicy,
    ClassPolicy,
    DrafterParams,
    DraftPlan,
    OptimalPolicy,
    UniformPolicy,
)
from das.scheduler.length import LengthCurve


@dataclass(frozen=True, slots=True)
class RequestView:
    """One running request as the budget hook sees it (tokens).

    generated: output tokens so far; predicted_tokens: predicted total output length, None if unknown;
    max_tokens: the request's output cap; room: the most draft tokens that fit before max_tokens or the context;
    length_curve: the predicted total output length given `generated` (conditioned on the sample having got this
    far), None if unknown.
    """

    generated: int
    predicted_tokens: float | None
    max_tokens: int
    room: int
    length_curve: LengthCurve | None = None

    @property
    def remaining(self) -> float:
        """Predicted remaining output tokens (>= 1): from the curve when there is one (a sample that outlives its
        problem's usual length is predicted to run on), else from predicted_tokens, else the cap. O(log curve)."""
        if self.length_curve is not None:
            total = self.length_curve.at(self.generated)
        else:
            total = self.predicted_tokens if self.predicted_tokens is not None else self.max_tokens
        return float(max(1.0, min(total, self.max_tokens) - self.generated))


class BudgetHook(Protocol):
    name: str

    def plan(self, batch: list[RequestView], drafter: DrafterParams | None = None) -> DraftPlan:
        """Per request, K_i >= 0 (int32; the proposer clips to room and K_max) and the least estimated acceptance
        probability a draft token must have. `drafter`: measured capacity and efficiency per request (the
        hook's constants where None)."""
        ...


class PolicyBudget:
    """A `scheduler.budget` policy fed from the proposer's batch.

    capacity / efficiency: the drafter parameters k and a of the budget model (DESIGN.md) for requests without
    measured ones (the proposer passes measured ones, scheduler/acceptance.py). c_base_s / c_tok_s: the engine's
    step cost model. Cost: one BatchState (three small numpy arrays) plus the policy, about 30-90 us for 256
    requests (scheduler/budget.py).
    """

    def __init__(self, policy: BudgetPolicy, k_max: int, *, c_base_s: float = 6.1e-3, c_tok_s: float = 30.7e-6,
                 capacity: float = 0.6, efficiency: float = 1.0) -> None:
        self.policy = policy
        self.name = policy.name
        self.k_max = k_max
        self.c_base_s, self.c_tok_s = c_base_s, c_tok_s
        self.capacity, self.efficiency = capacity, efficiency

    def plan(self, batch: list[RequestView], drafter: DrafterParams | None = None) -> DraftPlan:
        n = len(batch)
        capacity = drafter.capacity if drafter is not None else np.full(n, self.capacity)
        efficiency = drafter.efficiency if drafter is not None else np.full(n, self.efficiency)
        state = BatchState(np.fromiter((v.remaining for v in batch), np.float64, n), capacity, efficiency,
                           self.c_base_s, self.c_tok_s, self.k_max, drafter.unmeasured if drafter is not None else None)
        return self.policy.plan(state)


def budget_hook_from_config(config: dict[str, Any], k_max: int) -> BudgetHook:
    """`{"policy": "uniform", "k": K}` (default: uniform K_max), `{"policy": "classes", "long": 16, "medium": 8,
    "short": 4}`, or `{"policy": "das", "c_base_s": ..., "c_tok_s": ..., "capacity": ..., "efficiency": ...,
    "per_token": false}` (true: up to K_max tokens per request above a per-token probability floor instead of
    the model's K_i, scheduler/budget.py)."""
    config = dict(config)
    name = config.pop("policy", "uniform")
    cost = {key: float(config.pop(key)) for key in ("c_base_s", "c_tok_s", "capacity", "efficiency")
            if key in config}
    if name == "uniform":
        policy: BudgetPolicy = UniformPolicy(int(config.pop("k", k_max)))
    elif name == "classes":
        policy = ClassPolicy(**{key: int(config.pop(key)) for key in ("long", "medium", "short") if key in config})
    elif name == "das":
        policy = OptimalPolicy(per_token=bool(config.pop("per_token", False)))
    else:
        raise ValueError(f"unknown budget policy {name!r}; expected uniform, classes or das")
    if config:
        raise ValueError(f"unknown budget settings for policy {name!r}: {sorted(config)}")
    return PolicyBudget(policy, k_max, **cost)
