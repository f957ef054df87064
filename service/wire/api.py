"""Typed requests and results that cross a boundary (HTTP, Ray, the engine): pydantic models, unknown keys
rejected, so a typo in a sampling key is an error and not a silently ignored setting.

Bounds: what a request may carry is what every later stage can hold, so nothing accepted here fails later.
Integers fit an int64 (msgpack, which carries batches to the engines and history to snapshots, holds no more);
token ids and token counts an int32 (vLLM's and the drafter's buffers); floats are finite; strings are valid
Unicode (JSON can spell a lone UTF-16 surrogate, which no tokenizer, msgpack frame or file name takes); sampling
stays within what vLLM's `SamplingParams` accepts (temperature in [0, 2], top_p in (0, 1], top_k -1 or 0 for no
cut or a positive count, non-empty stop strings).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from das.service.wire.sample_keys import derive

INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1  # token ids and token counts (drafter.records.MAX_TOKEN_ID is the same bound)


def _unicode(text: str) -> str:
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError("not valid Unicode: a lone UTF-16 surrogate") from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_unicode)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
# A W3C trace context's traceparent header (version 00): trace id, parent span id, flags, in lowercase hex.
Traceparent = Annotated[str, Field(pattern=r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")]
# A NUL ends a path in every system call, so a path holding one is never the path meant; 4096 is Linux's PATH_MAX.
CheckpointPath = Annotated[str, Field(min_length=1, max_length=4096, pattern=r"^[^\x00]*$"), AfterValidator(_unicode)]


def wire_problem(value: Any, where: str = "value") -> str | None:
    """Why parsed JSON `value` cannot travel on as msgpack or be stored (an integer beyond int64, a float that is
    not finite, a string with a lone surrogate), naming the part at fault; None if it can."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return None if -INT64_MAX - 1 <= value <= INT64_MAX else f"{where}: integer beyond int64"
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{where}: {value} is not a finite number"
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return f"{where}: not valid Unicode (a lone UTF-16 surrogate)"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            problem = wire_problem(key, f"{where} key") or wire_problem(item, f"{where}.{key}")
            if problem:
                return problem
        return None
    if isinstance(value, (list, tuple)):
        # Token lists are the bulk of a history import: whole lists of plain ints in range pass without a walk.
        if value and all(type(v) is int for v in value) and -INT64_MAX - 1 <= min(value) and max(value) <= INT64_MAX:
            return None
        for i, item in enumerate(value):
            problem = wire_problem(item, f"{where}[{i}]")
            if problem:
                return problem
        return None
    return f"{where}: a {type(value).__name__} is not a JSON value"


class SamplingSpec(BaseModel):
    """How the samples of one group are drawn. Temperature 0 is greedy. The bounds are vLLM's (`SamplingParams`),
    so whatever passes here the engine runs."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    max_tokens: int = Field(256, ge=1, le=INT32_MAX, description="output tokens per sample, at most")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=INT32_MAX, description="0 or -1: no top-k cut")
    stop: tuple[NonEmptyText, ...] = Field((), description="stop strings (not included in the output)")
    stop_token_ids: tuple[TokenId, ...] = ()
    ignore_eos: bool = False
    seed: int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX, description=(
        "the group's randomness: sample i's token at position t is drawn with a key of (seed, i, t) "
        "(service/wire/sample_keys.py), so the same seed draws the same tokens with or without speculation, on any "
        "engine, after a re-dispatch; None: derived from the batch's seed (RolloutRequest.seed)"))


class FunctionCall(BaseModel):
    """A call the model made (OpenAI's `function` of a tool call): `arguments` is a JSON text, as the model wrote
    it, not parsed here."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: NonEmptyText
    arguments: Text


class ToolCall(BaseModel):
    """One tool call of an assistant turn (OpenAI's shape): in a chat's history, or parsed out of a sample's text."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: NonEmptyText
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionSpec(BaseModel):
    """A tool the model may call, as OpenAI's `tools[].function` defines it: `parameters` is its arguments' JSON
    Schema, passed to the chat template as given."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: NonEmptyText
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["function"] = "function"
    function: FunctionSpec


class ChatMessage(BaseModel):
    """One turn of a chat. A `tool` turn answers the call `tool_call_id` names; an assistant turn may carry the
    `tool_calls` it made (then `content` may be None). The chat template renders both."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["system", "user", "assistant", "tool"]
    content: Text | None = None
    tool_calls: tuple[ToolCall, ...] | None = None
    tool_call_id: NonEmptyText | None = None

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls: only an assistant turn carries them, not a {self.role} turn")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: a tool turn names the call it answers")
        if self.content is None and not self.tool_calls:
            raise ValueError("content: required (an assistant turn without it carries tool_calls)")
        return self


# The service's own curves have at most window x max_per_version + 64 steps (321 at the defaults).
MAX_CURVE_POINTS = 4096


# The one-prompt rule in JSON Schema, so a client generating requests from the OpenAPI schema knows it: exactly one
# of the three is present and not null (a prompt list or chat non-empty). `key_indices` holding n distinct indices is
# the one rule the schema cannot state; it names it in `x-key-indices`.
_PROMPT_SHAPES: dict[str, dict[str, Any]] = {
    "prompt_token_ids": {"type": "array", "minItems": 1}, "prompt": {"type": "string"},
    "messages": {"type": "array", "minItems": 1}}
_ONE_PROMPT_SCHEMA: dict[str, Any] = {
    "oneOf": [{"required": [name], "properties": {other: shape if other == name else {"type": "null"}
                                                  for other in _PROMPT_SHAPES}}
              for name, shape in _PROMPT_SHAPES.items()],
    "x-key-indices": "key_indices, when given, holds exactly n distinct indices"}


# LengthCurveSpec (the scheduler's LengthCurve on the wire) with the bounds its validation applies: int64 ints, at
# most MAX_CURVE_POINTS steps. Its ordering invariants (starts strictly increasing from 0, each end above its start,
# tail_from above the last start) are the part no JSON Schema keyword states: `x-invariants`.
_LENGTH_CURVE_SCHEMA: dict[str, Any] = {"anyOf": [{
    "type": "object", "required": ["starts", "ends", "tail_from", "tail_ratio"],
    "properties": {
        "starts": {"type": "array", "maxItems": MAX_CURVE_POINTS,
                   "items": {"type": "integer", "minimum": 0, "maximum": INT64_MAX}},
        "ends": {"type": "array", "maxItems": MAX_CURVE_POINTS, "items": {"type": "number"}},
        "tail_from": {"type": "integer", "minimum": 0, "maximum": INT64_MAX},
        "tail_ratio": {"type": "number", "minimum": 0}},
    "x-invariants": "one end per start; starts strictly increasing from 0; ends[j] > starts[j]; tail_from 0 "
                    "without starts, else above the last start"}, {"type": "null"}]}


class LengthCurveSpec(BaseModel):
    """A length curve as it travels: the fields of `das.scheduler.length.LengthCurve` (what the engine evaluates;
    `LengthCurve.from_dict(spec.model_dump())`), checked against the same invariants here in plain Python, so that
    the wire contract loads no numpy and a bad curve is refused at admission, naming `length_curve`.

    `starts` strictly increasing ints from 0 (at most MAX_CURVE_POINTS), one finite end per start with
    ends[j] > starts[j], `tail_from` 0 without starts, else above the last start, `tail_ratio` finite and >= 0;
    integers within int64."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    starts: tuple[int, ...]
    ends: tuple[float, ...]
    tail_from: int
    tail_ratio: float

    @model_validator(mode="after")
    def _curve(self) -> LengthCurveSpec:
        starts, ends = self.starts, self.ends
        if len(starts) > MAX_CURVE_POINTS:
            raise ValueError(f"{len(starts)} steps, at most {MAX_CURVE_POINTS}")
        if any(not -INT64_MAX - 1 <= s <= INT64_MAX for s in starts):
            raise ValueError("starts: integers must fit an int64")
        if not -INT64_MAX - 1 <= self.tail_from <= INT64_MAX:
            raise ValueError("tail_from: integers must fit an int64")
        if len(starts) != len(ends):
            raise ValueError(f"one end per start, got {len(starts)} starts and {len(ends)} ends")
        if starts and (starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:]))):
            raise ValueError("starts must be strictly increasing from 0")
        if not all(math.isfinite(e) and e > s for s, e in zip(starts, ends)):
            raise ValueError("ends must be finite and above their starts")
        if (self.tail_from != 0) if not starts else self.tail_from <= starts[-1]:
            raise ValueError(f"tail_from must be above the last start (0 without starts), got {self.tail_from}")
        if not (math.isfinite(self.tail_ratio) and self.tail_ratio >= 0):
            raise ValueError(f"tail_ratio must be finite and >= 0, got {self.tail_ratio}")
        return self


class GroupRequest(BaseModel):
    """One prompt, `n` samples: the unit an RL trainer asks for. Exactly one of `prompt_token_ids`, `prompt`
    (text) and `messages` (chat; the model's template is applied)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, json_schema_extra=_ONE_PROMPT_SCHEMA)

    problem_id: Annotated[str, Field(min_length=1, max_length=512), AfterValidator(_unicode)]
    session_id: Annotated[str, Field(min_length=1, max_length=512), AfterValidator(_unicode)] | None = Field(
        None, description="the agent trajectory this group is a turn of (n = 1): its turns run on the engine "
                          "holding its prefix (service/cluster/sessions.py); send the whole context as the prompt")
    n: int = Field(1, ge=1, le=4096)
    prompt_token_ids: tuple[TokenId, ...] | None = None
    prompt: NonEmptyText | None = None
    messages: tuple[ChatMessage, ...] | None = None
    sampling: SamplingSpec = SamplingSpec()
    predicted_tokens: float | None = Field(None, gt=0, le=INT32_MAX,
                                           description="the scheduler's predicted output length")
    key_indices: tuple[Annotated[int, Field(ge=0, le=INT32_MAX)], ...] | None = Field(
        None, description="sample j draws with the keys of sample key_indices[j] of the group's seed (default j); "
                          "the service sets it when it re-draws the samples an engine lost, so they come out as "
                          "first drawn. Results are still numbered 0..n-1")
    length_curve: Annotated[LengthCurveSpec | None, WithJsonSchema(_LENGTH_CURVE_SCHEMA)] = Field(
        None, description="the scheduler's predicted output length as a function of the tokens a sample has "
                          "generated (what the draft budget reads every step); the service fills it in when neither "
                          "this nor predicted_tokens is given")
    tools: tuple[ToolSpec, ...] | None = Field(None, description="the tools the model may call (OpenAI's `tools`): "
                                               "with messages the chat template shows them to the model; with "
                                               "prompt_token_ids the template was applied already, and they inform "
                                               "tool_parser only")
    tool_parser: NonEmptyText | None = Field(None, description="the vLLM tool-call parser (its "
                                             "ToolParserManager name, e.g. hermes) that splits each sample's text "
                                             "into content and tool calls (SampleResult.tool_calls); None: no "
                                             "parsing")
    prefix_token_ids: tuple[tuple[TokenId, ...], ...] | None = Field(
        None, description="per sample (n entries), output tokens it already has: the service sets it when it resumes "
                          "the samples an engine lost from the tokens they had delivered. Sample j continues from the "
                          "prompt + prefix_token_ids[j] as the undisturbed sample would (its keyed positions and "
                          "max_tokens count the prefix); its result's token_ids and text include the prefix, its "
                          "logprobs only the new tokens")
    trace_parents: tuple[Traceparent, ...] | None = Field(
        None, description="per sample (n entries), the W3C traceparent of the span the engine's own request span of "
                          "that sample hangs under: the gateway sets it to the sample's rollout.sample span, replacing "
                          "any given, when it records the batch's trace (das serve --otlp-traces-endpoint; "
                          "service/http/tracing.py); an engine started without that endpoint ignores it")

    @model_validator(mode="after")
    def _one_prompt(self) -> GroupRequest:
        given = [name for name in ("prompt_token_ids", "prompt", "messages") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of prompt_token_ids, prompt, messages (got {given or 'none'})")
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) == 0:
            raise ValueError("prompt_token_ids is empty")
        if self.messages is not None and len(self.messages) == 0:
            raise ValueError("messages is empty")
        if self.session_id is not None and self.n != 1:
            raise ValueError(f"a session's turn is one trajectory: n must be 1, got {self.n} (open a session per "
                             f"trajectory)")
        if self.key_indices is not None and (len(self.key_indices) != self.n
                                             or len(set(self.key_indices)) != self.n):
            raise ValueError(f"key_indices must be n = {self.n} distinct indices")
        if self.prefix_token_ids is not None:
            if len(self.prefix_token_ids) != self.n:
                raise ValueError(f"prefix_token_ids must have n = {self.n} entries")
            if any(len(p) >= self.sampling.max_tokens for p in self.prefix_token_ids):
                raise ValueError(f"prefix_token_ids: a prefix must be shorter than sampling.max_tokens "
                                 f"({self.sampling.max_tokens})")
        if self.trace_parents is not None and len(self.trace_parents) != self.n:
            raise ValueError(f"trace_parents must have n = {self.n} entries")
        return self

    def trace_headers(self, index: int) -> dict[str, str] | None:
        """The W3C trace context headers sample `index`'s engine request is made under (`trace_parents`); None
        without them."""
        if self.trace_parents is None:
            return None
        return {"traceparent": self.trace_parents[index]}

    def sample_key(self, index: int) -> int | None:
        """The key sample `index` of this group draws with under keyed sampling: derive(sampling.seed, j) with j
        its key index (key_indices[index], default index); None while the group has no seed."""
        if self.sampling.seed is None:
            return None
        return derive(self.sampling.seed, index if self.key_indices is None else self.key_indices[index])


FinishReason = Literal["stop", "length", "abort", "error"]


class EngineDeath(BaseModel):
    """An engine death a sample was drawn again after: the engine that died while it ran there, and when the
    coordinator saw the death (Unix seconds, the coordinator's clock: the gateway's process)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: str
    unix_s: float


class SampleResult(BaseModel):
    """One finished sample. logprobs[i] is the log-probability of token_ids[i] under the distribution it was
    sampled from (vLLM's processed logprobs: after temperature, top-p and top-k). `text`: the detokenized output
    (special tokens skipped), None where no tokenizer ran. `engine`: which engine produced it; `prompt_token_ids`:
    the prompt it continued, where the engine reports it. Times in seconds.

    Every sample index of a group arrives exactly once. A sample whose engine died before it arrived is drawn
    again on another engine (or the restarted one) under the same index and keys (SamplingSpec.seed): the same
    tokens, under the same weights; `engine` names the engine that drew it."""

    model_config = ConfigDict(extra="forbid")

    problem_id: str
    sample_index: int = Field(description="0 .. n-1 within its group, each exactly once; a sample re-run after its "
                                          "engine died keeps its index and keys (the same draw)")
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
    policy_spans: list[tuple[int, int]] | None = Field(
        None, description="the weights the tokens came from, when they changed while the sample ran (a weight "
                          "update under POST /pause?mode=keep): [policy version, index of its first token in "
                          "token_ids] pairs, first index 0, both increasing; None: every token is of "
                          "policy_version. policy_version is always the version of the first token")
    tool_calls: list[ToolCall] | None = Field(
        None, description="where the group named a tool_parser: the tool calls it found in `text` (maybe none); "
                          "None: not parsed. token_ids are the tokens generated, parsed or not")
    content: str | None = Field(None, description="where tool_calls is set: `text` less the tool-call markup "
                                                  "(None when nothing else was said)")
    predicted_tokens: float | None = Field(None, description="the output length, in tokens, the coordinator "
                                           "predicted for the sample's group and placed it by; None: no placement "
                                           "ran (an in-process backend)")
    redispatches: int = Field(0, ge=0, description="engine deaths the sample was drawn again after (on another "
                                                   "engine, or the restarted one)")
    engine_deaths: list[EngineDeath] | None = Field(None, description="those deaths, oldest first (as many as "
                                                    "redispatches); None: none")
    finished_unix_s: float | None = Field(None, description="when the sample left its engine (its engine actor's "
                                          "clock, Unix seconds); None where no engine actor ran it")


# --- the HTTP batch API ----------------------------------------------------------------------------------------

MSGPACK = "application/msgpack"
NDJSON = "application/x-ndjson"


def error_responses(described: dict[int, str],
                    model: type[BaseModel] | None = None) -> dict[int | str, dict[str, Any]]:
    """FastAPI's `responses=` for {status: when}: every status a route may answer goes in the OpenAPI schema
    (tests/service/http/test_schema_fuzz.py fuzzes it and refuses any other); `model`: the error body's shape."""
    return {status: {"description": when, **({"model": model} if model else {})} for status, when in described.items()}


class RolloutRequest(BaseModel):
    """A batch of groups. `batch_id` is the idempotency key: repeat it to resume the same batch."""

    model_config = ConfigDict(extra="forbid")

    batch_id: str | None = Field(None, pattern=r"^[A-Za-z0-9._:-]{1,128}$")
    groups: list[GroupRequest] = Field(min_length=1)
    logprobs: bool = False
    return_prompt_token_ids: bool = Field(False, description="each sample carries its prompt's token ids (what "
                                                             "a history file needs)")
    resume_from: int = Field(0, ge=0, le=INT64_MAX, description="when attaching to an existing batch, skip its "
                                                               "first records (the number the client already has)")
    progress: bool = Field(False, description="the stream also carries each running sample's new tokens as they "
                                              "are made, as {\"progress\": {...}} objects before its record "
                                              "(service/http/gateway.py says what they hold)")
    timings: bool = Field(False, description="each record carries finished_unix_s, when the sample left its engine "
                                             "(load tests: a sample's time from its engine to the client)")
    seed: int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX, description=(
        "the batch's seed: group g without a sampling.seed of its own samples with seed derive(seed, g), so the "
        "same batch with the same seed gives the same samples; None: a fresh one (BatchSummary.seed says which)"))


def seeded_groups(groups: Sequence[GroupRequest], batch_seed: int) -> list[GroupRequest]:
    """The groups of a batch seeded `batch_seed`: group g without a sampling.seed gets derive(batch_seed, g)."""
    return [g if g.sampling.seed is not None else
            g.model_copy(update={"sampling": g.sampling.model_copy(update={"seed": derive(batch_seed, i)})})
            for i, g in enumerate(groups)]


class SampleRecord(BaseModel):
    """One finished sample on the wire. `group_index`: the group's position in the request; `latency_s`: seconds
    from the batch's start to the sample reaching the gateway; `text` None without a tokenizer; `logprobs` and
    `prompt_token_ids` only when the batch asked for them."""

    model_config = ConfigDict(extra="forbid")

    group_index: int
    problem_id: str
    sample_index: int = Field(description="0 .. n-1 within its group, each exactly once; a sample re-run after its "
                                          "engine died keeps its index and keys (the same draw)")
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
    policy_spans: list[tuple[int, int]] | None = Field(None, description="as SampleResult.policy_spans: "
                                                       "[version, first token index] pairs where the weights "
                                                       "changed during the sample, else absent")
    tool_calls: list[ToolCall] | None = Field(None, description="as SampleResult.tool_calls: present where the "
                                              "group named a tool_parser")
    content: str | None = Field(None, description="as SampleResult.content: present with tool_calls")
    finished_unix_s: float | None = Field(None, description="as SampleResult.finished_unix_s: when the sample left "
                                          "its engine (Unix seconds, the engine node's clock); only where the batch "
                                          "asked for timings and it is known")


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
    seed: int | None = Field(None, description="the batch's seed (RolloutRequest.seed, or the one drawn for it): "
                                               "send it again to draw the same samples")


class WeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: CheckpointPath = Field(description="checkpoint directory, inside the weights root")
    version: int = Field(ge=0, le=INT64_MAX, description="policy version of these weights; must be newer than "
                                                         "the served one")


class WeightsResponse(BaseModel):
    policy_version: int
    reload_s: float = Field(description="seconds, including the wait for running batches")


_TOKEN_IDS_SCHEMA: dict[str, Any] = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": INT32_MAX}}
# A history-file record (drafter/records.py, RolloutRecord): what the store checks, stated in the schema.
HISTORY_RECORD_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "required": ["problem_id", "policy_version", "sample_index", "prompt_token_ids", "output_token_ids"],
    "properties": {
        "problem_id": {"type": "string", "minLength": 1},
        "policy_version": {"type": "integer", "minimum": 0, "maximum": INT64_MAX},
        "sample_index": {"type": "integer", "minimum": 0, "maximum": INT64_MAX},
        "prompt_token_ids": {**_TOKEN_IDS_SCHEMA, "minItems": 1},
        "output_token_ids": _TOKEN_IDS_SCHEMA,
        "finish_reason": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "reward": {"anyOf": [{"type": "number"}, {"type": "null"}]},
        "sample_key": {"anyOf": [{"type": "integer", "minimum": -INT64_MAX - 1, "maximum": INT64_MAX},
                                 {"type": "null"}]}}}


class HistoryRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    records: list[dict[str, Any]] = Field(description="history-file records (drafter/records.py)",
                                          json_schema_extra={"items": HISTORY_RECORD_SCHEMA})

    @field_validator("records")
    @classmethod
    def _storable(cls, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # The format's own checks come later (the backend); these are the ones a snapshot or a msgpack frame needs.
        for i, record in enumerate(records):
            problem = wire_problem(record, f"record {i}")
            if problem:
                raise ValueError(problem)
        return records


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


# --- vLLM's RL control routes (service/http/rl_control.py) -----------------------------------------------------------

PauseMode = Literal["abort", "wait", "keep"]
"""vLLM's `PauseMode`: abort the samples in flight (they end with finish_reason "abort"), wait for them to finish,
or keep them frozen until resume. In every mode new samples are held until resume, not refused."""


class CheckpointUpdateRequest(BaseModel):
    """POST /update_weights from a checkpoint directory (this service's body; vLLM's names `update_info`)."""

    model_config = ConfigDict(extra="forbid")

    path: CheckpointPath = Field(description="checkpoint directory, inside the weights root")
    version: int | None = Field(None, ge=0, le=INT64_MAX, description="policy version of these weights, newer "
                                                                      "than the served one; None: served + 1")


EndStatus = Literal["done", "failed", "aborted", "interrupted"]


class BatchFromPreviousRun(BaseModel):
    """The `detail` of the gateway's 409 for a batch id that an earlier run of the service accepted. The batch is not
    run again: resubmit the samples still wanted under a new batch id."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    code: Literal["batch_from_previous_run"] = "batch_from_previous_run"
    message: str
    batch_id: str
    status: EndStatus = Field(description="how the earlier run's batch ended: done, failed, aborted (DELETE or "
                                          "/abort_requests), interrupted (cut off by the service stopping)")
    samples_delivered: int | None = Field(description="samples it produced (streamed to its readers) before it "
                                                      "ended; None when the process died before recording it")
    samples_expected: int
    same_request: bool = Field(description="whether this request's groups and options match the earlier one's")
    accepted_unix_s: float
    ended_unix_s: float | None


class PauseResponse(BaseModel):
    status: Literal["paused"] = "paused"


class ResumeResponse(BaseModel):
    status: Literal["resumed"] = "resumed"


class IsPausedResponse(BaseModel):
    is_paused: bool


class AbortRequestsBody(BaseModel):
    """vLLM's body of POST /abort_requests. Here a request id names a batch (the batch_id of /v1/rollouts, the
    X-Batch-Id of an OpenAI-compatible response); none or empty: every sample in flight."""

    model_config = ConfigDict(extra="ignore")

    request_ids: list[Text] | None = None


class AbortResponse(BaseModel):
    status: Literal["aborted"] = "aborted"
    aborted: int = Field(description="batches aborted (request_ids given), else samples aborted")


class CheckpointUpdateResponse(BaseModel):
    message: Literal["Weights updated"] = "Weights updated"
    policy_version: int
    reload_s: float = Field(description="seconds, including any wait for running batches")
