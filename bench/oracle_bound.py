"""The limit of speculation for one batch: the decode steps its critical path needs when every step commits K + 1
tokens per request (K draft tokens, all accepted, plus the verifier's own), priced by the engine's measured step
cost. The oracle arm (`das bench e2e`) drafts the exact future through the real proposer and budget; this bound is
what it would take with no machinery in the way (no budget caution, no scheduling gaps, no prefill: prompt
tokens are not priced, so the bound is a lower bound of the decode time).

Per engine: step s (0-based) runs the requests whose length L exceeds s (K + 1), each scheduling min(K + 1,
L - s (K + 1)) tokens; the batch needs ceil(max L / (K + 1)) steps, and each is priced at its shape. With several
engines the batch's makespan bound is the slowest engine's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from das.service.engine.vllm.step_profile import StepProfile


@dataclass(frozen=True)
class StepPrice:
    """An engine step's cost, seconds: base_s + per_token_s * scheduled tokens, plus spec_s + spec_req_s * requests
    when it verifies draft tokens (`CostModel`'s shape). `source`: where it was measured."""

    base_s: float
    per_token_s: float
    source: str
    spec_s: float = 0.0
    spec_req_s: float = 0.0

    def __post_init__(self) -> None:
        values = (self.base_s, self.per_token_s, self.spec_s, self.spec_req_s)
        if not all(math.isfinite(v) and v >= 0 for v in values) or self.base_s + self.per_token_s <= 0:
            raise ValueError(f"step price ({self.source}): costs must be finite and >= 0, base and per token not "
                             f"both 0; got {values}")

    @classmethod
    def from_fit(cls, fit: Mapping[str, Any], source: str = "cost fit") -> StepPrice:
        """From the proposer's live cost fit (`BudgetHook.stats()`: c_base_s, c_tok_s, c_spec_s, c_spec_req_s)."""
        return cls(float(fit["c_base_s"]), float(fit["c_tok_s"]), source, float(fit.get("c_spec_s") or 0.0),
                   float(fit.get("c_spec_req_s") or 0.0))

    @classmethod
    def from_profile(cls, profile: StepProfile) -> StepPrice | None:
        """From an epoch's step profile (its whole-step cost fit, milliseconds); None where the epoch could not
        show the base and per-token terms. A drafted-step surcharge fitted below 0 (noise where nearly every step
        drafted) is taken as 0."""
        if profile.cost_base_ms is None or profile.cost_ms_per_token is None:
            return None
        return cls(profile.cost_base_ms / 1e3, profile.cost_ms_per_token / 1e3, "step profile",
                   max(profile.cost_spec_ms or 0.0, 0.0) / 1e3)

    def step_s(self, requests: np.ndarray, tokens: np.ndarray, drafted: np.ndarray) -> np.ndarray:
        """The price of steps with `requests` running, `tokens` scheduled, `drafted` (bool) verifying drafts."""
        spec = np.where(drafted, self.spec_s + self.spec_req_s * requests, 0.0)
        return self.base_s + self.per_token_s * tokens + spec


@dataclass(frozen=True)
class Bound:
    """steps: decode steps of the critical path (the longest sample's); seconds: their price (the slowest engine's
    sum over its steps)."""

    steps: int
    seconds: float


def engine_bound(lengths: Sequence[int], k: int, price: StepPrice) -> Bound:
    """The bound of one engine running samples of `lengths` output tokens with K = `k` (see the module
    docstring)."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    per_step = k + 1
    lens = np.asarray([n for n in lengths if n > 0], np.int64)
    if not lens.size:
        return Bound(0, 0.0)
    steps = int(-(-lens.max() // per_step))
    done = np.arange(steps, dtype=np.int64)[:, None] * per_step  # tokens each request had before step s
    scheduled = np.clip(lens[None, :] - done, 0, per_step)  # steps x requests
    requests = (scheduled > 0).sum(axis=1)
    tokens = scheduled.sum(axis=1)
    drafted = (scheduled > 1).any(axis=1)
    return Bound(steps, float(price.step_s(requests, tokens, drafted).sum()))


def batch_bound(engines: Sequence[Sequence[int]], k: int, price: StepPrice) -> Bound:
    """The batch's bound over engines (each a list of its samples' lengths): the slowest engine's."""
    bounds = [engine_bound(lengths, k, price) for lengths in engines]
    return max(bounds, key=lambda b: b.seconds, default=Bound(0, 0.0))
