"""An agent session as the session routes answer it (GET/DELETE /v1/sessions/{session_id}): the wire half of
service/cluster/sessions.py, so the trainer client reads it without the server's modules."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

SessionState = Literal["idle", "running", "closed", "aborted", "expired", "evicted"]


class TurnSummary(BaseModel):
    """One finished turn. `policy_spans` as SampleResult's: None when every token is of `policy_version`."""

    index: int
    batch_id: str
    engine: str | None
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    policy_version: int
    policy_spans: list[tuple[int, int]] | None = None
    seconds: float = Field(description="the turn's batch start to its sample's arrival")


class SessionSummary(BaseModel):
    """A session as GET/DELETE /v1/sessions/{session_id} answer it. Seconds since the session's first turn began;
    `engine` holds its prefix (None before its first turn ran)."""

    session_id: str
    problem_id: str
    state: SessionState
    engine: str | None
    turns: list[TurnSummary]
    context_tokens: int = Field(description="the latest turn's prompt plus output tokens")
    output_tokens: int = Field(description="output tokens over every turn")
    moves: int = Field(description="turns placed away from the engine holding the prefix")
    makespan_s: float | None = Field(description="first turn's start to last turn's end, tool time included")
