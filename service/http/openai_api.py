"""OpenAI-compatible routes on the gateway, for trainers that speak OpenAI (verl, SkyRL, TRL, prime-rl): the same
auth, engines and batch machinery as `POST /v1/rollouts`. `openai_router(gateway)` builds them; `create_app`
mounts them under the gateway's bearer-token auth. Request and response bodies: service/wire/openai_protocol.py.

- `GET /v1/models`: the one served model, `settings.served_model_name` (default: the backend's
  `served_model_name` if it has one, else "das"). A request naming another model gets 404.
- `POST /v1/completions`: `prompt` as text, as token ids, or as a list holding one of those.
- `POST /v1/chat/completions`: `messages` (system, developer (taken as system), user and assistant turns, text
  content); the engine applies the model's chat template. Or, instead, `prompt_token_ids` (DAS; `messages` empty):
  the conversation as token ids with the template applied, so an agent loop never re-tokenizes.

Sessions (agent trajectories, service/cluster/sessions.py): a request naming a `session_id` (vLLM's field, in the official
client's `extra_body`) is one turn of that trajectory, n = 1: its turns run on the engine holding its prefix. Send
the whole context every turn: the previous turn's prompt token ids and `token_ids` (`return_token_ids`), then the
new tokens (a tool's output, the next user turn), as `prompt` (completions) or `prompt_token_ids` (chat). A session's
problem_id defaults to its first turn's. A turn while another of the session runs gets 409; GET/DELETE
/v1/sessions/{session_id} (service/http/session_routes.py) show and end one. Session requests are not coalesced.

How a request maps to the batch API: it becomes one `GroupRequest` of `n` samples of its prompt, with
`problem_id` from the body (the official client sends it through `extra_body`) or, absent, "sha256:" + the hash
of the prompt (token ids, text or messages as JSON), so a repeated prompt names the same problem and drafts from
its history; and a `SamplingSpec` from `temperature`, `top_p`, `top_k`, `max_tokens` (chat: `max_completion_tokens`
wins), `stop`, `stop_token_ids` and `ignore_eos`, each absent one at the SamplingSpec default (except completions'
`max_tokens`: OpenAI's 16). The group runs as a batch admitted by the gateway itself (`GatewayCore.admit`), so the
sample limit, the in-flight limit, the reload lock and the metrics apply as to `/v1/rollouts`; the response's
`X-Batch-Id` header names the batch.

Siblings: requests naming one problem with equal prompt and sampling that arrive within
`settings.openai_coalesce_s` of the first (20 ms by default; 0 turns it off) run as one group of their summed n,
so they are siblings on one engine and draft from each other's live tokens; each request gets its own samples
back, indexed from 0. The merged group stays within GroupRequest's n bound and `max_batch_samples`.

What the responses carry:
- choices in sample order; a stream (server-sent events in OpenAI's chunk format, then `data: [DONE]`) sends
  each choice's tokens as the engine makes them (a chunk per progress report: every engine step, batched to one
  report per ~50 ms per engine), its last chunk with the rest and its finish_reason, then a usage chunk when
  `stream_options.include_usage`. An error after the stream began goes out as an error event, which the official
  client raises.
- `seed` is the group's `sampling.seed`: choice i draws with keys of (seed, i, position)
  (service/wire/sample_keys.py), so the same request with the same seed gets the same choices, with or without
  speculation. A seeded request is never coalesced with others (its choices would be renumbered, and so drawn
  differently); without a seed the batch draws a fresh one.
- logprobs: the sampled token's logprob under the distribution it was drawn from (the engines run vLLM's
  processed logprobs: after temperature, top-p and top-k). The engines return no alternatives, so `top_logprobs`
  holds the sampled token only (completions: always, as vLLM always includes it; chat: when top_logprobs >= 1).
  Tokens are named `token_id:<id>` (vLLM's --return-tokens-as-token-ids form): the gateway has no tokenizer.
- `return_token_ids` (vLLM's): each choice's `token_ids`, and the prompt's `prompt_token_ids` (completions: on
  each choice; chat: on the response, or on the first chunk), where vLLM puts them.
- usage: the prompt counted once, as the engine tokenized it (0 where the backend does not report it: the stub
  with a text prompt), completion tokens summed over the choices.
- `das` at the top level (the official client keeps unknown fields: `response.das` is a dict): problem_id,
  policy_version, and the draft tokens proposed and accepted for the choices of this response (stream: of this
  chunk).
- text: "" where the backend has no tokenizer (the stub).

Errors, all in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: 400 invalid input (the body, n < 1,
more than one prompt, a prompt the engine refuses, e.g. one over the context, `logprobs` over vLLM's 20, a
session of another problem); 401 bad or missing token (before the body is read); 404 unknown model; 408 a body
too slow; 409 the session runs a turn already; 413 a body over `max_body_bytes`; 429 too many batches in flight;
503 not ready, or the batch was aborted; 500 a failed batch or sample. Unknown body fields are ignored, as
OpenAI's API does (logged at debug).

A client that disconnects before all its samples came (a stream it stops reading, or a non-streaming request it
gives up on: the route watches for the disconnect while it waits) aborts the batch once no request of its group
still reads it: unlike a named `/v1/rollouts` batch, nothing could attach to it again. Each such request counts in
`das_requests_abandoned_total{route}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from typing import Any

import msgpack
from annotated_types import Le
from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from das.service.http.gateway_core import GatewayCore
from das.service.http.request_guard import OffloopJsonRoute
from das.service.wire.api import MSGPACK, GroupRequest, RolloutRequest, SamplingSpec, error_responses
from das.service.wire.openai_protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProb,
    ChatLogProbs,
    ChatLogProbsContent,
    ChatMessageParam,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    DasInfo,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    SamplingRequest,
    UsageInfo,
)


log = logging.getLogger(__name__)

# GroupRequest's bound on n: a coalesced group never asks for more.
_GROUP_MAX_N = next(m.le for m in GroupRequest.model_fields["n"].metadata if isinstance(m, Le))

# OpenAI's default for completions; chat has none (the SamplingSpec default applies).
_COMPLETIONS_MAX_TOKENS = 16

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}

Record = dict[str, Any]  # one SampleRecord as the gateway's batch stream carries it (logprobs and prompt ids on)


class OpenAIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        # Messages may echo input (a model name, a role): a lone UTF-16 surrogate there would fail the JSON body.
        message = message.encode("utf-8", "backslashreplace").decode()
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> ErrorResponse:
        kind = ("server_error" if self.status >= 500 else "rate_limit_exceeded" if self.status == 429
                else "invalid_request_error")
        return ErrorResponse(error=ErrorInfo(message=self.message, type=kind, param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=self.headers)


def _from_http(exc: StarletteHTTPException, status: int | None = None, param: str | None = None) -> OpenAIError:
    """The gateway's own refusals (auth, body size, limits, readiness, the backend refusing a group) and FastAPI's
    (a body it cannot read) in OpenAI's shape, with `status` in place of the gateway's where given."""
    if isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI's words for it: "There was an error parsing the body"
        return OpenAIError(400, "the body is not valid JSON: it is not UTF-8")
    detail = exc.detail
    # A backend refusal comes in FastAPI's validation shape (gateway_core.input_error): a list of {loc, msg, type}.
    message = "; ".join(str(d["msg"]) for d in detail) if isinstance(detail, list) else str(detail)
    status = status or exc.status_code
    code = {401: "invalid_api_key", 429: "rate_limit_exceeded"}.get(status)
    return OpenAIError(status, message, param=param, code=code, headers=exc.headers)


def invalid_request(errors: Sequence[Any], rename: dict[str, str] | None = None,
                    default: str | None = None) -> OpenAIError:
    """Pydantic's (or FastAPI's) validation errors as one 400 naming each field's path in the request's terms
    (`rename` maps our field names to OpenAI's; `default` names the field of an error of a whole model). `param`
    is the first error's top-level field: deeper parts of a path may be pydantic's union tags."""
    def path(loc: Sequence[Any]) -> list[str]:
        parts = [str(p) for p in loc if p not in ("body", "sampling")]
        if parts and rename:
            parts[0] = rename.get(parts[0], parts[0])
        return parts

    message = "; ".join(f"{'.'.join(path(e['loc'])) or default or 'body'}: {e['msg']}" for e in errors)
    first = path(errors[0]["loc"]) if errors else []
    return OpenAIError(400, message, param=first[0] if first else default)


class OpenAIErrorRoute(OffloopJsonRoute):
    """Answers every error of its routes in OpenAI's shape: ours, the gateway's HTTPExceptions (the bearer-token
    dependency included) and FastAPI's body validation, which app-wide handlers would answer in FastAPI's."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def openai_errors(request: Request) -> Response:
            try:
                return await handler(request)
            except OpenAIError as exc:
                return exc.response()
            except StarletteHTTPException as exc:  # FastAPI raises Starlette's own for a body it cannot read
                return _from_http(exc).response()
            except RequestValidationError as exc:
                return invalid_request(exc.errors()).response()

        return openai_errors


# --- requests to groups -----------------------------------------------------------------------------------------


def _completion_prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> dict[str, Any]:
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise OpenAIError(400, f"{len(prompt)} prompts in one request; this server takes one prompt a request "
                                   f"(ask for n samples of it, or send a request per prompt)", param="prompt")
        return _completion_prompt(prompt[0])
    return {"prompt_token_ids": prompt}


def _chat_prompt(messages: list[ChatMessageParam]) -> dict[str, Any]:
    turns = []
    for i, message in enumerate(messages):
        role = _ROLES.get(message.role)
        if role is None:
            raise OpenAIError(400, f"messages.{i}.role: {message.role!r} is not supported (system, developer, user, "
                                   f"assistant, tool)", param=f"messages.{i}.role")
        if message.content is None and not (role == "assistant" and message.tool_calls):
            raise OpenAIError(400, f"messages.{i}.content: required (null only in an assistant turn with "
                                   f"tool_calls)", param=f"messages.{i}.content")
        if message.tool_calls is not None and role != "assistant":
            raise OpenAIError(400, f"messages.{i}.tool_calls: only an assistant turn carries tool calls",
                              param=f"messages.{i}.tool_calls")
        if role == "tool" and not message.tool_call_id:
            raise OpenAIError(400, f"messages.{i}.tool_call_id: required in a tool turn (the call it answers)",
                              param=f"messages.{i}.tool_call_id")
        if message.content is None or isinstance(message.content, str):
            text = message.content
        else:
            other = [p.type for p in message.content if p.type != "text" or p.text is None]
            if other:
                raise OpenAIError(400, f"messages.{i}.content: only text parts are supported, got {other[0]!r}",
                                  param=f"messages.{i}.content")
            text = "\n".join(p.text or "" for p in message.content)
        turn: dict[str, Any] = {"role": role, "content": text}
        if message.tool_calls:
            turn["tool_calls"] = [{"id": c.id, "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                  for c in message.tool_calls]
        if role == "tool":
            turn["tool_call_id"] = message.tool_call_id
        turns.append(turn)
    return {"messages": turns}


def _tool_fields(body: ChatCompletionRequest, parser: str | None) -> dict[str, Any]:
    """The request's tools as GroupRequest fields (`tools`, and `tool_parser` where the reply's tool calls are to be
    parsed: tool_choice auto), after vLLM's checks of them: tools non-empty, tool_choice none, auto (the default
    with tools; it needs `parser`, das serve's --enable-auto-tool-choice --tool-call-parser), or refused."""
    if body.tools is not None and not body.tools:
        raise OpenAIError(400, "tools: must not be an empty array; give at least one tool or leave the field out",
                          param="tools")
    choice = body.tool_choice if body.tool_choice is not None else "auto" if body.tools else "none"
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise OpenAIError(400, f"tool_choice: {choice!r} is not one of none, auto, required or a named function",
                          param="tool_choice")
    if choice != "none" and not body.tools:
        raise OpenAIError(400, "tool_choice: needs tools", param="tool_choice")
    if choice == "required" or not isinstance(choice, str):
        named = choice if isinstance(choice, str) else f"function {choice.function.name!r}"
        raise OpenAIError(400, f"tool_choice: {named} is not supported: vLLM forces it with guided decoding, which "
                               f"this server's engines do not run; use auto (the model decides, vLLM's parser reads "
                               f"its calls)", param="tool_choice")
    if choice == "auto" and parser is None:
        raise OpenAIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                               'set (das serve)', param="tool_choice")
    fields: dict[str, Any] = {}
    if body.tools:
        # OpenAI's fields only (unknown ones are ignored, as everywhere in these routes)
        fields["tools"] = [{"type": "function", "function": t.function.model_dump(
            include={"name", "description", "parameters", "strict"}, exclude_none=True)} for t in body.tools]
    if choice == "auto":
        fields["tool_parser"] = parser
    return fields


def _prompt_problem_id(prompt: dict[str, Any]) -> str:
    """A stable name for a prompt without a problem_id: the same prompt names the same problem in any process."""
    canonical = json.dumps(prompt, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    # surrogatepass: a lone surrogate must not fail the hash; GroupRequest then refuses the prompt with a 400.
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()


def _group(body: SamplingRequest, prompt: dict[str, Any], prompt_param: str, max_tokens: int | None,
           session_problem: str | None = None) -> GroupRequest:
    """The request as our group; out-of-range values are refused by SamplingSpec and GroupRequest themselves.
    `session_problem`: the problem of the open session the request names, its default problem_id (a turn's prompt
    grows every turn, so its hash would name a new problem)."""
    given = {"max_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p,
             "top_k": body.top_k,
             "stop": [body.stop] if isinstance(body.stop, str) else body.stop,
             "stop_token_ids": body.stop_token_ids, "ignore_eos": body.ignore_eos, "seed": body.seed}
    try:
        sampling = SamplingSpec(**{k: v for k, v in given.items() if v is not None})
        problem_id = (body.problem_id if body.problem_id is not None else session_problem
                      if session_problem is not None else _prompt_problem_id(prompt))
        return GroupRequest(problem_id=problem_id, session_id=body.session_id, n=body.n, sampling=sampling, **prompt)
    except ValidationError as exc:
        raise invalid_request(exc.errors(), rename={"prompt": prompt_param, "prompt_token_ids": prompt_param},
                              default=prompt_param) from None


# --- coalescing and delivery ------------------------------------------------------------------------------------


class _Share:
    """One request's part of a group: the group's samples [offset, offset + n), handed over renumbered from 0."""

    def __init__(self, group: _Group, offset: int, n: int, stream: bool = False,
                 headers: Mapping[str, str] | None = None) -> None:
        self.group, self.offset, self.n, self.stream = group, offset, n, stream
        self.headers = headers  # the request's, for its traceparent (service/http/tracing.py)
        self.batch_id: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.queue: asyncio.Queue[Record] = asyncio.Queue()
        self.done = False

    async def samples(self) -> AsyncIterator[Record]:
        """This request's samples as they finish; OpenAIError if one failed or the batch ended without them. A
        streaming request's share also gets its samples' progress (`{"progress": ...}`) as they run."""
        received = 0
        try:
            while received < self.n:
                record = await self.queue.get()
                if "progress" in record:
                    yield record
                    continue
                if "summary" in record:
                    summary = record["summary"]
                    if summary["status"] == "aborted":
                        raise OpenAIError(503, f"batch {summary['batch_id']} was aborted (a shutdown, or DELETE "
                                               f"/v1/rollouts/{summary['batch_id']})")
                    raise OpenAIError(500, f"batch {summary['batch_id']} failed: {summary['error']}")
                if record["finish_reason"] == "error":
                    raise OpenAIError(500, f"sample {record['sample_index']} failed: {record['error']}")
                received += 1
                yield record
        finally:
            self.done = True
            if received < self.n:
                self.group.abandoned()


class _Group:
    """Requests merged into one GroupRequest of their summed n."""

    def __init__(self, template: GroupRequest) -> None:
        self.template = template
        self.shares: list[_Share] = []
        self.n = 0
        self.abort: Callable[[], None] | None = None  # set once its batch runs

    def join(self, n: int, stream: bool = False, headers: Mapping[str, str] | None = None) -> _Share:
        share = _Share(self, self.n, n, stream, headers)
        self.shares.append(share)
        self.n += n
        return share

    def deliver(self, record: Record) -> None:
        if "summary" in record:
            for share in self.shares:
                share.queue.put_nowait(record)
            return
        progress = record.get("progress")
        index = (progress or record)["sample_index"]
        share = next(s for s in self.shares if s.offset <= index < s.offset + s.n)
        if progress is None:
            share.queue.put_nowait({**record, "sample_index": index - share.offset})
        elif share.stream:
            share.queue.put_nowait({"progress": {**progress, "sample_index": index - share.offset}})

    def abandoned(self) -> None:
        """A request stopped reading before all its samples came: once none reads any more, the rest is waste."""
        if self.abort is not None and all(s.done for s in self.shares):
            self.abort()


class _Coalescer:
    """Opens a group per (problem, prompt, sampling) for `window_s`; requests arriving meanwhile join it."""

    def __init__(self, gateway: GatewayCore[Any]) -> None:
        self._gateway = gateway
        self._window_s = gateway.settings.openai_coalesce_s
        self._max_n = min(_GROUP_MAX_N, gateway.settings.max_batch_samples)
        self._open: dict[str, _Group] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # strong references: the loop holds tasks weakly

    async def submit(self, group: GroupRequest, route: str, stream: bool = False,
                     headers: Mapping[str, str] | None = None) -> tuple[_Share, str]:
        """This request's share of a group and the id of the batch running it, once the gateway admitted it;
        HTTPException as the gateway refused it. `stream`: the share also gets its samples' token progress.
        `route` and `headers` (the request's): what the batch's trace records and follows (the group's first
        request's route)."""
        key = group.model_dump_json(exclude={"n"})
        target = self._open.get(key)
        # A session's turn runs alone and at once: it is one trajectory (n = 1), and waits for nobody.
        alone = group.sampling.seed is not None or group.session_id is not None
        if target is None or target.n + group.n > self._max_n or alone:
            target = _Group(group)
            if self._window_s > 0 and not alone:
                self._open[key] = target
            self._spawn(self._launch(key, target, 0.0 if group.session_id is not None else self._window_s, route))
        share = target.join(group.n, stream, headers)
        # Shielded: a request cancelled while it waits must leave its future for _launch to resolve (resolving a
        # cancelled one raises there, and its siblings would never hear back).
        return share, await asyncio.shield(share.batch_id)

    def _spawn(self, job: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(job)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _launch(self, key: str, group: _Group, window_s: float, route: str) -> None:
        if window_s > 0:
            await asyncio.sleep(window_s)
            if self._open.get(key) is group:
                del self._open[key]
        merged = group.template.model_copy(update={"n": group.n})
        progress = any(share.stream for share in group.shares)  # token deltas only where a request streams
        try:
            batch, _ = await self._gateway.admit(
                RolloutRequest(groups=[merged], logprobs=True, return_prompt_token_ids=True, progress=progress),
                route, [share.headers for share in group.shares if share.headers is not None])
        except Exception as exc:  # the gateway's refusal is every joined request's answer
            for share in group.shares:
                share.batch_id.set_exception(exc)
            return
        group.abort = lambda: self._spawn(self._gateway.abort(batch))
        for share in group.shares:
            share.batch_id.set_result(batch.batch_id)
        unpacker = msgpack.Unpacker()
        async with contextlib.aclosing(self._gateway.stream(batch, 0, MSGPACK, progress)) as stream:
            async for chunk in stream:
                unpacker.feed(chunk)
                for record in unpacker:
                    group.deliver(record)


# --- responses --------------------------------------------------------------------------------------------------


def _token(token_id: int) -> str:
    return f"token_id:{token_id}"


def _usage(records: list[Record]) -> UsageInfo:
    prompt = len(records[0]["prompt_token_ids"] or ()) if records else 0
    completion = sum(len(r["output_token_ids"]) for r in records)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _completion_choice(record: Record, body: CompletionRequest) -> CompletionChoice:
    logprobs = None
    if body.logprobs is not None:
        tokens = [_token(t) for t in record["output_token_ids"]]
        logprobs = CompletionLogProbs(tokens=tokens, token_logprobs=record["logprobs"],
                                      top_logprobs=[{t: lp} for t, lp in zip(tokens, record["logprobs"])])
    ids = body.return_token_ids
    return CompletionChoice(index=record["sample_index"], text=record["text"] or "", logprobs=logprobs,
                            finish_reason=record["finish_reason"],
                            token_ids=record["output_token_ids"] if ids else None,
                            prompt_token_ids=record["prompt_token_ids"] if ids else None,
                            policy_spans=record.get("policy_spans"))


def _chat_finish(record: Record) -> str | None:
    """vLLM's finish_reason for chat: tool_calls where the parser found calls, else the sample's."""
    return "tool_calls" if record.get("tool_calls") else record["finish_reason"]


def _chat_logprobs(record: Record, body: ChatCompletionRequest) -> ChatLogProbs | None:
    if not body.logprobs:
        return None
    top = (body.top_logprobs or 0) >= 1
    return ChatLogProbs(content=[
        ChatLogProbsContent(token=_token(t), logprob=lp, top_logprobs=[ChatLogProb(token=_token(t), logprob=lp)]
                            if top else [])
        for t, lp in zip(record["output_token_ids"], record["logprobs"])])


class _Reply:
    """Builds one request's answer from its share: a JSON body, or server-sent events."""

    def __init__(self, model: str, prefix: str, problem_id: str, share: _Share, batch_id: str,
                 include_usage: bool) -> None:
        self.model, self.problem_id, self.share, self.include_usage = model, problem_id, share, include_usage
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.headers = {"X-Batch-Id": batch_id}

    def header(self) -> dict[str, Any]:
        return {"id": self.id, "created": self.created, "model": self.model}

    def das(self, records: list[Record]) -> DasInfo:
        return DasInfo(problem_id=self.problem_id, policy_version=records[0]["policy_version"],
                       draft_tokens=sum(r["draft_tokens"] for r in records),
                       accepted_tokens=sum(r["accepted_tokens"] for r in records))

    async def complete(self, build: Callable[[list[Record]], BaseModel], request: Request,
                       abandoned: Callable[[], None]) -> Response:
        """The whole answer once every sample came; if the client disconnects first, its share is given up (the
        batch aborted once no request of its group reads it: nothing can attach to it again) and `abandoned`
        called."""
        async def collect() -> list[Record]:
            async with contextlib.aclosing(self.share.samples()) as samples:
                return sorted([r async for r in samples], key=lambda r: r["sample_index"])

        collecting = asyncio.ensure_future(collect())
        leaving = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait([collecting, leaving], return_when=asyncio.FIRST_COMPLETED)
        finally:
            leaving.cancel()
            if not collecting.done():
                collecting.cancel()  # closes the share's stream: its finally gives the share up
                await asyncio.gather(collecting, return_exceptions=True)
                abandoned()
        if collecting.cancelled():  # the client left: nobody reads this answer
            return Response(status_code=499)
        return Response(build(collecting.result()).model_dump_json(), media_type="application/json",
                        headers=self.headers)

    def stream(self, chunk: Callable[[Record, bool], BaseModel], usage: Callable[[UsageInfo], BaseModel],
               abandoned: Callable[[], None]) -> StreamingResponse:
        """A chunk per progress report (the sample's new tokens as the engine made them) and a last one per sample
        with the rest of its tokens and its finish_reason (`chunk(record, first)`, a record holding only the
        delta), the usage chunk if asked, [DONE]. A client that disconnects before its last sample gives its share
        up (as `complete`) and `abandoned` is called."""
        async def events() -> AsyncIterator[str]:
            records: list[Record] = []
            deltas = _Deltas()
            try:
                async with contextlib.aclosing(self.share.samples()) as samples:
                    async for item in samples:
                        if "progress" not in item:
                            records.append(item)
                        delta = deltas.next(item)
                        if delta is not None:
                            yield f"data: {chunk(delta, deltas.chunks == 1).model_dump_json()}\n\n"
                if self.include_usage:
                    yield f"data: {usage(_usage(records)).model_dump_json()}\n\n"
            except (asyncio.CancelledError, GeneratorExit):  # the server stopped reading it: the client left
                if len(records) < self.share.n:
                    abandoned()
                raise
            except OpenAIError as exc:
                yield f"data: {exc.body().model_dump_json()}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers=self.headers)


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone. The body has been read by now, so what the server has left to say is the
    disconnect (uvicorn answers receive() with it as soon as the connection drops)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Deltas:
    """Turns a stream's progress reports and records into delta records: what each sample made since the last
    chunk. A record's delta is the rest of its tokens (its text past what progress sent, when that is a prefix of
    it: a stop string cut the text, or text vLLM held back while it could still become one)."""

    def __init__(self) -> None:
        self.sent: dict[int, tuple[int, str]] = {}  # sample index -> (tokens sent, text sent)
        self.chunks = 0

    def next(self, item: Record) -> Record | None:
        progress = item.get("progress")
        if progress is not None:
            index = progress["sample_index"]
            tokens, text = self.sent.get(index, (0, ""))
            if progress["offset"] != tokens or not progress["token_ids"]:
                return None  # a repeat (after a re-dispatch) or nothing new
            self.sent[index] = (tokens + len(progress["token_ids"]), text + progress["text"])
            self.chunks += 1
            return {"sample_index": index, "output_token_ids": progress["token_ids"],
                    "logprobs": progress.get("logprobs") or [], "text": progress["text"], "finish_reason": None,
                    "prompt_token_ids": None, "policy_version": progress["policy_version"], "draft_tokens": 0,
                    "accepted_tokens": 0}
        tokens, text = self.sent.pop(item["sample_index"], (0, ""))
        full = item["text"] or ""
        self.chunks += 1
        return {**item, "output_token_ids": item["output_token_ids"][tokens:],
                "logprobs": (item.get("logprobs") or [])[tokens:],
                "text": full[len(text):] if full.startswith(text) else full}


# --- the router -------------------------------------------------------------------------------------------------


def openai_router(gateway: GatewayCore[Any]) -> APIRouter:
    """The OpenAI-compatible routes over `gateway`'s batch machinery (include it where auth applies)."""
    router = APIRouter(route_class=OpenAIErrorRoute, tags=["openai"])
    served = gateway.settings.served_model_name or getattr(gateway.backend, "served_model_name", None) or "das"
    created = int(time.time())
    coalescer = _Coalescer(gateway)

    def abandoned(route: str) -> None:
        gateway.metrics.requests_abandoned[route] += 1

    def check(body: SamplingRequest, path: str) -> None:
        if body.model != served:
            raise OpenAIError(404, f"The model `{body.model}` does not exist.", param="model",
                              code="model_not_found")
        if body.model_extra:
            log.debug("%s: ignored unknown fields %s", path, sorted(body.model_extra))

    async def start(body: SamplingRequest, prompt: dict[str, Any], prompt_param: str, max_tokens: int | None,
                    prefix: str, request: Request) -> _Reply:
        session = gateway.sessions.get(body.session_id) if body.session_id is not None else None
        group = _group(body, prompt, prompt_param, max_tokens, session.problem_id if session is not None else None)
        try:
            share, batch_id = await coalescer.submit(group, request.url.path, bool(body.stream), request.headers)
        except HTTPException as exc:
            # Refused input (too many samples, a group the backend refuses) is a 400 in OpenAI's terms.
            param = {413: "n", 422: prompt_param}.get(exc.status_code)
            if exc.status_code == 422 and "session" in str(exc.detail):
                param = "session_id"
            raise _from_http(exc, 400 if param else None, param) from None
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return _Reply(served, prefix, group.problem_id, share, batch_id, include_usage)

    @router.get("/v1/models")
    async def models() -> ModelList:
        """The served model (OpenAI's model list)."""
        return ModelList(data=[ModelCard(id=served, created=created)])

    # What a completion may answer besides 200 (and 401, 413: create_app documents those for every route).
    errors = error_responses({400: "invalid input", 404: "unknown model",
                              409: "the session named is running a turn (a session runs one at a time)",
                              429: "max_batches_in_flight batches are queued or running (Retry-After)",
                              500: "the batch or a sample failed in the engine",
                              503: "the backend is not ready (Retry-After), or the batch was aborted"}, ErrorResponse)

    @router.post("/v1/completions", response_model=None, responses={200: {
        "model": CompletionResponse, "content": {"text/event-stream": {}},
        "description": "a CompletionResponse, or with stream server-sent CompletionResponse chunks"}, **errors})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """OpenAI's text completions: n samples of one prompt, run as one group of a batch."""
        check(body, "/v1/completions")
        prompt = _completion_prompt(body.prompt)
        max_tokens = _COMPLETIONS_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        reply = await start(body, prompt, "prompt", max_tokens, "cmpl", request)
        if body.stream:
            return reply.stream(
                lambda r, first: CompletionResponse(**reply.header(), choices=[_completion_choice(r, body)],
                                                    das=reply.das([r])),
                lambda usage: CompletionResponse(**reply.header(), choices=[], usage=usage),
                lambda: abandoned("/v1/completions"))
        return await reply.complete(lambda records: CompletionResponse(
            **reply.header(), choices=[_completion_choice(r, body) for r in records], usage=_usage(records),
            das=reply.das(records)), request, lambda: abandoned("/v1/completions"))

    @router.post("/v1/chat/completions", response_model=None, responses={200: {
        "model": ChatCompletionResponse, "content": {"text/event-stream": {}},
        "description": "a ChatCompletionResponse, or with stream server-sent ChatCompletionChunk events"}, **errors})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI's chat completions: n samples of one conversation, run as one group of a batch."""
        check(body, "/v1/chat/completions")
        if body.top_logprobs is not None and not body.logprobs:
            raise OpenAIError(400, "top_logprobs: needs logprobs set to true", param="top_logprobs")
        if body.prompt_token_ids is not None and body.messages:
            raise OpenAIError(400, "give messages or prompt_token_ids, not both", param="prompt_token_ids")
        if body.prompt_token_ids is None and not body.messages:
            raise OpenAIError(400, "messages: at least one message (or prompt_token_ids instead)", param="messages")
        parser = gateway.settings.tool_call_parser if gateway.settings.enable_auto_tool_choice else None
        prompt = ({"prompt_token_ids": body.prompt_token_ids} if body.prompt_token_ids is not None
                  else _chat_prompt(body.messages)) | _tool_fields(body, parser)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        param = "prompt_token_ids" if body.prompt_token_ids is not None else "messages"
        reply = await start(body, prompt, param, max_tokens, "chatcmpl", request)
        ids = body.return_token_ids

        parsing = "tool_parser" in prompt

        def choice(r: Record) -> ChatChoice:
            calls = r.get("tool_calls")
            message = (AssistantMessage(content=r["text"] or "") if calls is None
                       else AssistantMessage(content=r["content"], tool_calls=calls or None))
            return ChatChoice(index=r["sample_index"], message=message,
                              logprobs=_chat_logprobs(r, body), finish_reason=_chat_finish(r),
                              token_ids=r["output_token_ids"] if ids else None, policy_spans=r.get("policy_spans"))

        def chunk(r: Record, first: bool) -> ChatCompletionChunk:
            # With tool parsing a choice's text goes out in its last chunk, parsed (content and calls): the parse
            # runs on the engine once the sample ended; its earlier chunks carry its tokens only.
            calls = r.get("tool_calls")
            if calls is not None:
                delta = DeltaMessage(role="assistant", content=r["content"], tool_calls=[
                    DeltaToolCall(index=i, id=c["id"], type="function", function=DeltaFunctionCall(**c["function"]))
                    for i, c in enumerate(calls)] or None)
            else:
                delta = DeltaMessage(role="assistant",
                                     content=None if parsing and r["finish_reason"] is None else r["text"] or "")
            return ChatCompletionChunk(
                **reply.header(), das=reply.das([r]),
                prompt_token_ids=r["prompt_token_ids"] if ids and first else None,
                choices=[ChatStreamChoice(index=r["sample_index"], delta=delta, logprobs=_chat_logprobs(r, body),
                                          finish_reason=_chat_finish(r),
                                          token_ids=r["output_token_ids"] if ids else None,
                                          policy_spans=r.get("policy_spans"))])

        if body.stream:
            return reply.stream(chunk, lambda usage: ChatCompletionChunk(**reply.header(), choices=[], usage=usage),
                                lambda: abandoned("/v1/chat/completions"))
        return await reply.complete(lambda records: ChatCompletionResponse(
            **reply.header(), choices=[choice(r) for r in records], usage=_usage(records),
            prompt_token_ids=records[0]["prompt_token_ids"] if ids else None, das=reply.das(records)), request,
            lambda: abandoned("/v1/chat/completions"))

    return router
