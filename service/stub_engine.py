"""`StubEngine`: the `Engine` interface without a model, for tests and load tests of the Ray service.

Each sample is `tokens` tokens long (capped by max_tokens) of a fixed pattern, produced at `token_s` seconds a
token. It drafts nothing: `draft_tokens` and `accepted_tokens` are 0, so no figure from it can pass for a
speedup. It counts the history it was given (`history_records`), which is what service tests check. It refuses
what the engine refuses without needing vLLM: the API's bounds (service/api.py, vLLM's own sampling limits) and the
model's (prompt and stop token ids within the vocabulary, the prompt within the context).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from das.service.api import GroupRequest, SampleResult
from das.service.engine.async_engine import EngineInputError, SpecDecodeTally, validate_rollouts


class StubEngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens: int = Field(16, ge=0, description="output tokens per sample (before max_tokens)")
    token_s: float = Field(0.0, ge=0, description="seconds per output token of a sample")
    max_model_len: int = Field(2048, ge=2)
    vocab_size: int = Field(32000, ge=2)


class StubEngine:
    """Implements the parts of `Engine` that the service uses."""

    def __init__(self, config: StubEngineConfig) -> None:
        self.config = config
        self.policy_version = 0
        self.spec_tally = SpecDecodeTally()
        self.history_records = 0

    @classmethod
    async def create(cls, config: StubEngineConfig) -> StubEngine:
        return cls(config)

    def prompt_token_ids(self, group: GroupRequest) -> list[int]:
        if group.prompt_token_ids is not None:
            ids = list(group.prompt_token_ids)
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise EngineInputError(f"prompt_token_ids: {len(bad)} token id(s) outside the vocabulary "
                                       f"[0, {self.config.vocab_size}), first {bad[0]}")
        else:
            text = group.prompt if group.prompt is not None else " ".join(m.content for m in group.messages or ())
            ids = [1 + len(word) % (self.config.vocab_size - 1) for word in text.split()] or [1]
        if len(ids) >= self.config.max_model_len:
            raise EngineInputError(f"prompt is {len(ids)} tokens; the context holds {self.config.max_model_len} "
                                   f"and at least one output token must fit")
        outside = [t for t in group.sampling.stop_token_ids if not 0 <= t < self.config.vocab_size]
        if outside:
            raise EngineInputError(f"sampling.stop_token_ids: {outside[0]} is outside the vocabulary "
                                   f"[0, {self.config.vocab_size})")
        return ids

    async def generate(self, group: GroupRequest) -> AsyncIterator[SampleResult]:
        prompt = self.prompt_token_ids(group)
        length = min(self.config.tokens, group.sampling.max_tokens)
        start = time.perf_counter()
        self.spec_tally.running += group.n  # the group's samples, until the group ends
        try:
            for index in range(group.n):
                if self.config.token_s:
                    await asyncio.sleep(length * self.config.token_s / group.n)
                yield SampleResult(
                    problem_id=group.problem_id, sample_index=index,
                    token_ids=[(7 * i + index) % self.config.vocab_size for i in range(length)],
                    logprobs=[-1.0] * length, finish_reason="length" if length == group.sampling.max_tokens else
                    "stop", policy_version=self.policy_version, decode_steps=length,
                    total_s=time.perf_counter() - start, prompt_token_ids=prompt)
        finally:
            self.spec_tally.running -= group.n

    async def reload_weights(self, checkpoint: str | os.PathLike[str], version: int | None = None) -> int:
        new = self.policy_version + 1 if version is None else version
        if new <= self.policy_version:
            raise EngineInputError(f"version: must be newer than the served version {self.policy_version}, "
                                   f"got {new}")
        self.policy_version = new
        return new

    async def add_history(self, rollouts: list[dict[str, Any]]) -> int:
        validate_rollouts(rollouts)
        self.history_records += len(rollouts)
        return len(rollouts)

    async def drafter_stats(self) -> dict[str, Any]:
        return {"history_records": self.history_records}

    async def close(self) -> None:
        return None
