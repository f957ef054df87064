"""Typed requests and results that cross a boundary (HTTP, Ray, the engine): pydantic models, unknown keys
rejected, so a typo in a sampling key is an error and not a silently ignored setting."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from das.scheduler.length import LengthCurve


class SamplingSpec(BaseModel):
    """How the samples of one group are drawn. Temperature 0 is greedy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(256, ge=1, description="output tokens per sample, at most")
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0: no top-k cut")
    stop: tuple[str, ...] = Field((), description="stop strings (not included in the output)")
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["system", "user", "assistant"]
    content: str


# The service's own curves have at most window x max_per_version + 64 steps (321 at the defaults).
MAX_CURVE_POINTS = 4096


class GroupRequest(BaseModel):
    """One prompt, `n` samples: the unit an RL trainer asks for. Exactly one of `prompt_token_ids`, `prompt`
    (text) and `messages` (chat; the model's template is applied)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    problem_id: str = Field(min_length=1, max_length=512)
    n: int = Field(1, ge=1, le=4096)
    prompt_token_ids: tuple[int, ...] | None = None
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    sampling: SamplingSpec = SamplingSpec()
    predicted_tokens: float | None = Field(None, gt=0, description="the scheduler's predicted output length")
    length_curve: LengthCurve | None = Field(
        None, description="the scheduler's predicted output length as a function of the tokens a sample has "
                          "generated (what the draft budget reads every step); the service fills it in when neither "
                          "this nor predicted_tokens is given")

    @model_validator(mode="after")
    def _one_prompt(self) -> GroupRequest:
        given = [name for name in ("prompt_token_ids", "prompt", "messages") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of prompt_token_ids, prompt, messages (got {given or 'none'})")
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) == 0:
            raise ValueError("prompt_token_ids is empty")
        if self.messages is not None and len(self.messages) == 0:
            raise ValueError("messages is empty")
        return self

    @field_validator("length_curve")
    @classmethod
    def _bounded_curve(cls, curve: LengthCurve | None) -> LengthCurve | None:
        if curve is not None and len(curve.starts) > MAX_CURVE_POINTS:
            raise ValueError(f"{len(curve.starts)} steps, at most {MAX_CURVE_POINTS}")
        return curve


FinishReason = Literal["stop", "length", "abort", "error"]


class SampleResult(BaseModel):
    """One finished sample. logprobs[i] is the log-probability of token_ids[i] under the distribution it was
    sampled from (vLLM's processed logprobs: after temperature, top-p and top-k). `text`: the detokenized output
    (special tokens skipped), None where no tokenizer ran. `engine`: which engine produced it; `prompt_token_ids`:
    the prompt it continued, where the engine reports it. Times in seconds."""

    model_config = ConfigDict(extra="forbid")

    problem_id: str
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int
    draft_tokens: int = 0
    accepted_tokens: int = 0
    decode_steps: int = 0
    first_token_s: float | None = None
    total_s: float = 0.0
    error: str | None = None
    text: str | None = None
    engine: str | None = None
    prompt_token_ids: list[int] | None = Field(None, description="the prompt as the engine tokenized it")
