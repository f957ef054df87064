"""The drafter's configuration, `DrafterConfig`: what the history bank runs with, validated where a service starts
and handed to its engines as plain data (the fields set, `given()`). Free of the native index, so the processes
that only configure engines (the service's driver) do not load it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Matched context a draft is chosen on beyond its own tokens: an index of depth K + 8 drafts as far as a deeper one
# on every bundled trace set, while its cost is O(depth) per stored token (docs/design "The drafter").
MATCH_CONTEXT = 8


class DrafterConfig(BaseModel):
    """Drafter settings. Sizes and budgets are in tokens. A field not set keeps its default, except `max_depth`,
    which `sized_for` / `for_drafts` fit to the draft length unless it was set."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_depth: int = Field(32, ge=1, le=255, description="suffix index depth D: longest match + draft followed")
    window: int = Field(4, ge=1, description="sealed policy versions kept per problem")
    min_prob: float = Field(0.0, ge=0.0, le=1.0, description="stop walks (index estimate) and drafts (calibrated) "
                                                            "whose cumulative probability falls below")
    match_factor: float = Field(0.0, ge=0.0, description="draft at most match_factor * matched-context tokens "
                                                         "(0: no cap)")
    prior: float = Field(2.0, ge=0.0, description="pseudo-count added to a node's continuations: discounts thin "
                                                   "evidence")
    choice_pseudo_count: float = Field(5.0, gt=0.0, description="weight of a candidate's own score before feedback")
    choice_horizon: float = Field(2000.0, ge=1.0, description="observations per calibration cell before old ones "
                                                              "fade")
    token_budget: int = Field(50_000_000, ge=1, description="all stored history tokens, all problems")
    global_tokens: int = Field(2_000_000, ge=0, description="share of token_budget for the cross-problem fallback")
    shadow_gap: int = Field(8, ge=0, description="tokens a request commits between a settled shadow draft and its "
                                                 "next")
    context_tokens: int = Field(8_000_000, ge=0, description="session contexts kept; beyond, the least recently "
                                                             "used idle ones go")

    @model_validator(mode="after")
    def _global_within_budget(self) -> DrafterConfig:
        if self.global_tokens > self.token_budget:
            raise ValueError(f"global_tokens ({self.global_tokens}) must not exceed token_budget "
                             f"({self.token_budget})")
        return self

    @classmethod
    def for_drafts(cls, max_draft: int, **settings: Any) -> DrafterConfig:
        """`cls(**settings).sized_for(max_draft)`."""
        return cls(**settings).sized_for(max_draft)

    def sized_for(self, max_draft: int) -> DrafterConfig:
        """This configuration for drafts of at most `max_draft` (>= 1) tokens: `max_depth` max_draft +
        MATCH_CONTEXT (at most 255) unless it was set. The index costs O(max_depth) per stored token and per
        lookup, and a deeper one drafts no further."""
        if isinstance(max_draft, bool) or not isinstance(max_draft, int) or max_draft < 1:
            raise ValueError(f"max_draft must be an integer >= 1, got {max_draft!r}")
        if "max_depth" in self.model_fields_set:
            return self
        return self.model_copy(update={"max_depth": min(255, max_draft + MATCH_CONTEXT)})

    def given(self) -> dict[str, Any]:
        """The fields set, as plain data (what an engine's `model_validate` rebuilds this from)."""
        return self.model_dump(exclude_unset=True)
