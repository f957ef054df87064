"""OpenAI's wire contract for the OpenAI-compatible routes (service/http/openai_api.py): the request and response
bodies of `GET /v1/models`, `POST /v1/completions` and `POST /v1/chat/completions` as OpenAI defines them, with
the vLLM extensions RL trainers send (`top_k`, `stop_token_ids`, `ignore_eos`, `return_token_ids`, `session_id`)
and ours (`problem_id` and chat's `prompt_token_ids` in a request, `das` in a response).

Kept apart from service/wire/api.py, our own batch API, because these follow someone else's contract: unknown request
keys are accepted and ignored (OpenAI's API does the same; the router logs them at debug), where ours are
refused. Requests check shapes only, plus the few ranges that exist only here (`logprobs`, `top_logprobs`, `seed`); the
sampling ranges (`n`, `max_tokens`, `temperature`, ...) are checked by building our `GroupRequest` and
`SamplingSpec` from them, so the two APIs cannot disagree on what is valid.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from das.service.wire.api import INT64_MAX, ToolCall

# vLLM's default --max-logprobs: the most logprobs (completions) or top_logprobs (chat) a request may ask for;
# vLLM refuses more with a 400 naming this bound, and so does this service.
MAX_LOGPROBS = 20

T = TypeVar("T")

# --- requests ---------------------------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class SamplingRequest(BaseModel):
    """What completions and chat completions share. None: the service's default for that setting."""

    model_config = ConfigDict(extra="allow")

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, description="vLLM's extension; -1 or 0: no top-k cut")
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX,  # vLLM's bounds: a torch.long
                             description="accepted, not applied per request (see service/http/openai_api.py)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop_token_ids: list[int] | None = Field(None, description="vLLM's extension")
    ignore_eos: bool = Field(False, description="vLLM's extension")
    return_token_ids: bool = Field(False, description="vLLM's extension: each choice's token_ids, and the "
                                                      "prompt's prompt_token_ids")
    problem_id: str | None = Field(None, description="DAS: the problem these samples answer (their history "
                                                     "drafts for later requests); default: a hash of the prompt "
                                                     "(of a session: of its first turn's prompt)")
    session_id: str | None = Field(None, description="vLLM's field: the agent trajectory this request is a turn of "
                                                     "(n = 1); its turns run on the engine holding its prefix "
                                                     "(service/cluster/sessions.py)")


_TokenIds = Annotated[list[int], Field(min_length=1)]
_NonEmpty = Annotated[list[T], Field(min_length=1)]


class CompletionRequest(SamplingRequest):
    prompt: str | _TokenIds | _NonEmpty[str] | _NonEmpty[_TokenIds] = Field(
        description="text or token ids; a list holding one of them is taken as that one")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="return the sampled tokens' logprobs "
                                 "(the alternatives are not served: top_logprobs holds the sampled token)")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class FunctionCallParam(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    arguments: str = Field(description="the arguments as JSON text")


class ToolCallParam(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessageParam(BaseModel):
    model_config = ConfigDict(extra="allow")

    # A str, not a Literal: the router refuses another role itself, naming the message (param messages.<i>.role).
    role: str = Field(json_schema_extra={"enum": ["system", "developer", "user", "assistant", "tool"]},
                      description="developer is taken as system; a tool turn answers the call tool_call_id names "
                                  "(the legacy function role is not supported)")
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallParam] | None = Field(None, description="an assistant turn's calls (then content may "
                                                   "be null)")
    tool_call_id: str | None = Field(None, description="a tool turn's: the call it answers")


class FunctionDefinitionParam(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="the arguments' JSON Schema")
    strict: bool | None = None


class ChatToolParam(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: FunctionDefinitionParam


class NamedFunction(BaseModel):
    name: str


class NamedToolChoiceParam(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    # the conversation comes as messages or as prompt_token_ids: exactly one of them (the route refuses the others)
    model_config = ConfigDict(extra="allow", json_schema_extra={"oneOf": [
        {"required": ["messages"], "properties": {"messages": {"minItems": 1}, "prompt_token_ids": {"type": "null"}}},
        {"required": ["prompt_token_ids"], "properties": {"prompt_token_ids": {"type": "array"},
                                                          "messages": {"maxItems": 0}}}]})

    messages: list[ChatMessageParam] = Field(default_factory=list, description="the conversation; empty when "
                                             "prompt_token_ids is given")
    prompt_token_ids: _TokenIds | None = Field(None, description="DAS: the conversation as token ids, chat "
                                               "template applied (a session's context as the previous turns' "
                                               "prompt_token_ids + token_ids + the new turn's tokens), instead of "
                                               "messages: nothing is re-tokenized")
    max_completion_tokens: int | None = Field(None, description="OpenAI's newer name for max_tokens; wins over it")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatToolParam] | None = Field(None, description="functions the model may call; the chat template "
                                              "shows them to the model")
    tool_choice: str | NamedToolChoiceParam | None = Field(
        None, json_schema_extra={"enum": ["none", "auto", "required"]},
        description="none, or auto (the default with tools; needs das serve --enable-auto-tool-choice "
                    "--tool-call-parser): the reply's tool calls parsed out of its text by vLLM's parser. required and "
                    "a named function are refused: vLLM forces them with guided decoding, which these engines do not "
                    "run")
    parallel_tool_calls: bool | None = Field(None, description="accepted; every call the parser finds is returned")


# --- responses --------------------------------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "das"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class DasInfo(BaseModel):
    """What speculation did for the choices of this response (or chunk); the official client keeps unknown
    top-level fields, so `response.das` (as a dict via `response.model_extra`) reads it."""

    problem_id: str
    policy_version: int = Field(description="the weights the choices were sampled from")
    draft_tokens: int = Field(description="draft tokens proposed for these choices")
    accepted_tokens: int = Field(description="of those, accepted by verification")


class CompletionLogProbs(BaseModel):
    """`text_offset` is None: the gateway has no tokenizer, so it knows no per-token text (tokens are named
    `token_id:<id>`, vLLM's `--return-tokens-as-token-ids` form)."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    policy_spans: list[tuple[int, int]] | None = Field(
        None, description="DAS extension, only for a choice whose tokens span a weight update (/update_weights "
                          "under /pause?mode=keep): [[policy version, first token index], ...]")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    das: DasInfo | None = None


class ChatLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    content: list[ChatLogProbsContent]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = Field(description="None where the reply was tool calls only")
    tool_calls: list[ToolCall] | None = Field(None, description="the calls vLLM's tool parser found in the reply "
                                              "(tool_choice auto); finish_reason is then tool_calls")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    policy_spans: list[tuple[int, int]] | None = Field(
        None, description="DAS extension, only for a choice whose tokens span a weight update (/update_weights "
                          "under /pause?mode=keep): [[policy version, first token index], ...]")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None
    das: DasInfo | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int = Field(description="the call's position among the choice's calls")
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    policy_spans: list[tuple[int, int]] | None = Field(
        None, description="DAS extension, only for a choice whose tokens span a weight update (/update_weights "
                          "under /pause?mode=keep): [[policy version, first token index], ...]")


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    das: DasInfo | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
