"""The drafter's settings: `DrafterConfig` (what the history bank runs with) and `DrafterSettings`, the same fields
as settings a service validates where it starts and hands to its engines as plain data. Free of the native index,
so the processes that only configure engines (the service's driver) do not load it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

# Matched context a draft is chosen on beyond its own tokens: an index of depth K + 8 drafts as far as a deeper one
# on every bundled trace set, while its cost is O(depth) per stored token (docs/design "The drafter").
MATCH_CONTEXT = 8


@dataclass(frozen=True)
class DrafterConfig:
    """Drafter settings. Sizes and budgets are in tokens. `for_drafts` sizes the index to a draft length."""

    max_depth: int = 32          # suffix index depth D: longest match + draft that can be followed
    window: int = 4              # sealed policy versions kept per problem
    min_prob: float = 0.0        # stop walks (index estimate) and drafts (calibrated) whose cumulative prob falls below
    match_factor: float = 0.0    # draft at most match_factor * matched-context tokens (0: no cap)
    prior: float = 2.0           # pseudo-count added to a node's continuations: discounts thin evidence
    choice_pseudo_count: float = 5.0  # weight of a candidate's own score before feedback arrives
    choice_horizon: float = 2000.0    # observations per calibration cell before old ones fade
    token_budget: int = 50_000_000   # all stored history tokens, all problems
    global_tokens: int = 2_000_000   # share of the budget for the cross-problem fallback
    shadow_gap: int = 8              # tokens a request commits between a settled shadow draft and its next
    context_tokens: int = 8_000_000  # session contexts kept; beyond, the least recently used idle ones go

    def __post_init__(self) -> None:
        checks = {
            "max_depth": 1 <= self.max_depth <= 255,
            "window": self.window >= 1,
            "min_prob": 0.0 <= self.min_prob <= 1.0,
            "match_factor": 0.0 <= self.match_factor,
            "prior": 0.0 <= self.prior,
            "choice_pseudo_count": self.choice_pseudo_count > 0,
            "choice_horizon": self.choice_horizon >= 1,
            "token_budget": self.token_budget >= 1,
            "global_tokens": 0 <= self.global_tokens <= self.token_budget,
            "shadow_gap": self.shadow_gap >= 0,
            "context_tokens": self.context_tokens >= 0,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid drafter config field(s): {', '.join(bad)} ({self})")

    @classmethod
    def for_drafts(cls, max_draft: int, **settings: Any) -> DrafterConfig:
        """Settings for drafts of at most `max_draft` (>= 1) tokens: `max_depth` max_draft + MATCH_CONTEXT (at most
        255) unless `settings` name one. The index costs O(max_depth) per stored token and per lookup, and a deeper
        one drafts no further."""
        if isinstance(max_draft, bool) or not isinstance(max_draft, int) or max_draft < 1:
            raise ValueError(f"max_draft must be an integer >= 1, got {max_draft!r}")
        settings.setdefault("max_depth", min(255, max_draft + MATCH_CONTEXT))
        return cls(**settings)


class DrafterSettings(BaseModel):
    """`DrafterConfig` fields to set, unset ones None (DrafterConfig's default; for `max_depth`, `for_drafts`'s).
    Valid exactly when `DrafterConfig.for_drafts` takes them (its checks are the only ones)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_depth: int | None = None
    window: int | None = None
    min_prob: float | None = None
    match_factor: float | None = None
    prior: float | None = None
    choice_pseudo_count: float | None = None
    choice_horizon: float | None = None
    token_budget: int | None = None
    global_tokens: int | None = None
    shadow_gap: int | None = None
    context_tokens: int | None = None

    @model_validator(mode="after")
    def _valid(self) -> DrafterSettings:
        self.config(1)
        return self

    def given(self) -> dict[str, Any]:
        """The fields set, as plain data."""
        return self.model_dump(exclude_none=True)

    def config(self, max_draft: int) -> DrafterConfig:
        """The drafter's config for drafts of at most `max_draft` tokens. ValueError for invalid settings."""
        return DrafterConfig.for_drafts(max_draft, **self.given())

