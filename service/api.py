"""Typed requests and results that cross a boundary (HTTP, Ray, the engine): pydantic models, unknown keys
rejected, so a typo in a sampling key is an error and not a silently ignored setting."""

from __future__ import annotations

from typing import Any, Literal

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


# --- the HTTP batch API ----------------------------------------------------------------------------------------

MSGPACK = "application/msgpack"
NDJSON = "application/x-ndjson"


class RolloutRequest(BaseModel):
    """A batch of groups. `batch_id` is the idempotency key: repeat it to resume the same batch."""

    model_config = ConfigDict(extra="forbid")

    batch_id: str | None = Field(None, pattern=r"^[A-Za-z0-9._:-]{1,128}$")
    groups: list[GroupRequest] = Field(min_length=1)
    logprobs: bool = False
    return_prompt_token_ids: bool = Field(False, description="each sample carries its prompt's token ids (what "
                                                             "a history file needs)")
    resume_from: int = Field(0, ge=0, description="when attaching to an existing batch, skip its first records "
                                                  "(the number the client already has)")


class SampleRecord(BaseModel):
    """One finished sample on the wire. `group_index`: the group's position in the request; `latency_s`: seconds
    from the batch's start to the sample reaching the gateway; `text` None without a tokenizer; `logprobs` and
    `prompt_token_ids` only when the batch asked for them."""

    model_config = ConfigDict(extra="forbid")

    group_index: int
    problem_id: str
    sample_index: int
    output_token_ids: list[int]
    text: str | None
    logprobs: list[float] | None = None
    prompt_token_ids: list[int] | None = None
    finish_reason: FinishReason
    policy_version: int
    draft_tokens: int
    accepted_tokens: int
    latency_s: float
    error: str | None = None
    engine: str | None = Field(None, description="the engine that produced the sample")


BatchStatus = Literal["queued", "running", "done", "aborted", "failed"]


class BatchSummary(BaseModel):
    """A batch's status and counts so far (final once `status` is done, aborted or failed). `makespan_s`: start
    to the latest sample so far, None before the first."""

    model_config = ConfigDict(extra="forbid")

    batch_id: str
    status: BatchStatus
    groups: int
    samples_expected: int
    samples: int
    tokens: int
    draft_tokens: int
    accepted_tokens: int
    errors: int
    makespan_s: float | None
    error: str | None = None


class WeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1, description="checkpoint directory, inside the weights root")
    version: int = Field(ge=0, description="policy version of these weights; must be newer than the served one")


class WeightsResponse(BaseModel):
    policy_version: int
    reload_s: float = Field(description="seconds, including the wait for running batches")


class HistoryRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    records: list[dict[str, Any]] = Field(description="history-file records (problem_id, policy_version, "
                                                      "sample_index, prompt_token_ids, output_token_ids, ...)")


class HistoryResponse(BaseModel):
    added: int


class ProblemSummary(BaseModel):
    """What the store holds for one problem (GET /v1/history/{problem_id})."""

    problem_id: str
    rollouts: int
    output_tokens: int
    policy_versions: list[int] = Field(description="versions of the rollouts held, increasing")
    prompt_tokens: int
    length_p50: float | None = Field(description="median output length (tokens) of the held rollouts")
    length_max: int | None
    finish_reasons: dict[str, int] = Field(description="counts over the versions the difficulty record holds")
