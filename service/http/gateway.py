"""The HTTP gateway: `create_app(backend, settings)` builds the FastAPI app over a `RolloutBackend`.

Endpoints (bearer-token auth on all but /healthz and /readyz when `settings.token` is set, checked from the headers
before the body is read: service/http/request_guard.py, which also bounds how long a request's head and body may take):

- `POST /v1/rollouts` (`RolloutRequest`): runs a batch and streams one `SampleRecord` per sample as it finishes,
  then one `{"summary": BatchSummary}` object, the last of the stream. Wire formats: NDJSON (one JSON object a
  line, `application/x-ndjson`) by default; with `Accept: application/msgpack` a **msgpack stream**: the same
  objects as msgpack maps, concatenated with no length prefix (msgpack is self-delimiting: feed the bytes to a
  `msgpack.Unpacker`). Response headers: `X-Batch-Id` names the batch; `X-Stream-Offset` is the position of the
  stream's first record in the batch (`resume_from` when attaching to an existing batch, else 0).
- `GET /v1/rollouts/{id}`: a batch's `BatchSummary` (status and progress). `DELETE /v1/rollouts/{id}`: aborts it.
- `POST /v1/weights` `{path, version}`: reloads the policy. It **waits** for the running batches to finish and
  holds batches that arrive meanwhile until the reload is done, so no batch mixes two policy versions; the
  response comes once the new weights serve. `path` must resolve (symlinks followed) inside
  `settings.weights_root`, 403 otherwise; relative paths are taken from that root.
- `POST /v1/history` `{records: [...]}`: imports finished rollouts (history-file records) for drafting.
- vLLM's RL control routes (`/pause`, `/resume`, `/is_paused`, `/abort_requests`, `/update_weights`, ...):
  service/http/rl_control.py. While paused, reloads do not wait for running batches and stall timeouts are off.
- `GET /v1/history/{problem_id}`: what the history store holds for a problem (404 none, 501 no store).
- `GET /v1/sessions/{id}`, `DELETE /v1/sessions/{id}`: an open agent session, or its end (service/http/session_routes.py);
  a group with a `session_id` is a turn of that session (service/cluster/sessions.py: one turn at a time, 409 otherwise).
- `GET /metrics` (Prometheus text), `GET /healthz` (liveness: 503 once the backend cannot serve again without a
  restart of the process, e.g. every engine past its restart cap, or makes no progress: `stalls_until_unlive`
  batches in a row failed by the stall timeout with no sample finishing in between), `GET /readyz` (503 until
  the backend is ready, and while no engine serves; its body names each engine that stays down and why).

Batches run as their own tasks, not tied to a connection: a client that drops its connection loses nothing, and a
request that repeats a `batch_id` attaches to that batch (replaying what it produced, then following it live)
instead of running it again. A batch requested without a `batch_id` is aborted once the last connection streaming it
leaves before it ended (nothing could name it again), counted in `das_requests_abandoned_total`. Results are held
msgpack-encoded (a few bytes a token); ended batches stay
replayable within `retained_batches` / `retained_bytes`; a repeated id older than that gets 410, never a second
run. A batch always ends: whatever goes wrong in its task ends it
`failed` with the error in its summary and a log line, and a batch in which no sample made a token for
`batch_stall_timeout_s` is failed and its running samples aborted, so a reload never waits on a batch that cannot
finish. A stall is judged by token progress (the engines report each sample's new tokens every ~50 ms): a batch
fails only when no sample made a token for the timeout, so a long sample generating steadily is never one.

With `"progress": true` in the request, the stream also carries each running sample's new tokens as they are made,
as `{"progress": {"group_index", "sample_index", "offset", "token_ids", "text", "policy_version"}}` objects (plus
"logprobs" when the batch asked for them; ~50 ms apart per engine at most), each sample's before its record;
`offset` is the position of the first of `token_ids` in the sample's output, and the record holds every token.

Across restarts (`settings.batch_journal`, on with `das serve --state-dir`): every batch a request names (batch_id
given) is journaled before it runs and when it ends (service/http/batch_journal.py: id, request digest, status, sample
counts, times; no prompts). A request repeating the id of a batch that an *earlier run* of the service accepted is
not run again: 409 with `detail` = `BatchFromPreviousRun`: `{"code": "batch_from_previous_run", "message",
"batch_id", "status": done|failed|aborted|interrupted (cut off by the restart), "samples_delivered" (samples it
produced before it ended; null if the process died before recording that), "samples_expected", "same_request"
(whether the groups and options match), "accepted_unix_s", "ended_unix_s"}`; its results are gone with the old
process, so the trainer resubmits what it still needs under a new batch_id (`das.service.client` raises
`BatchFromPreviousRunError`). Without a journal (no state directory) the registry is in memory only: after a
restart a retried id is unknown and runs again from the start.

Errors: 401 bad or missing token (before the body is read; the connection is closed when a body may follow); 403
weights path outside the root; 404 unknown batch; 408 the body did not arrive within `body_timeout_s` of the head,
or the head within `header_timeout_s` (server_config), the connection closed; 409 a batch id reused for
a different batch or accepted by an earlier run (`batch_from_previous_run`, above), or a weights version not newer
than the served one, or a group whose session is running a turn; 410 batch results no longer retained;
413 a request body over `max_body_bytes` (refused before it is read when its Content-Length says so), a batch over
`max_batch_samples` samples
or a history import over `max_history_records`; 422 invalid input, naming the field (request validation, or the
backend refusing a group before anything runs, e.g. sampling the engine would refuse: `loc` names the group);
429 too many batches in flight (`max_batches_in_flight`, never exceeded however many requests arrive at once);
503 backend not ready. Every error body is JSON: a refused value JSON cannot carry (NaN, a lone surrogate) is
echoed as text. What requests may carry (integers within int64, finite floats, valid Unicode) is in service/wire/api.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match

from das.service.cluster.group_aborts import GroupAborts
from das.service.cluster.rollout_backend import GroupInputError, RolloutBackend
from das.service.cluster.sessions import CloseReason, Session, SessionBook, SessionConflict
from das.service.engine.contract import EngineInputError
from das.service.engine.pause_gate import PauseGate
from das.service.http.batch_journal import BatchJournal
from das.service.http.batch_progress import ProgressLog
from das.service.http.metrics import GatewayMetrics
from das.service.http.batch_routes import batch_router
from das.service.http.gateway_core import input_error, json_safe
from das.service.http.health_routes import health_router
from das.service.http.openai_api import OpenAIError, OpenAIErrorRoute, openai_router
from das.service.http.reload_lock import ReloadLock
from das.service.http.request_guard import RequestGuard, open_paths
from das.service.http.rl_control import rl_control_router
from das.service.http.session_journal import SessionJournal
from das.service.config import GatewayConfig, SessionJournalConfig
from das.service.http.session_routes import session_router
from das.service.http.weight_updates import PushResult, WeightUpdates
from das.service.wire.api import (
    INT64_MAX,
    MSGPACK,
    BatchStatus,
    BatchSummary,
    EndStatus,
    GroupRequest,
    PauseMode,
    RolloutRequest,
    SampleResult,
    WeightsRequest,
    WeightsResponse,
    error_responses,
    seeded_groups,
)
from das.service.wire.engine_control import ReloadWeights
from das.service.wire.sample_keys import fresh_seed
from das.service.wire.sample_progress import SampleProgress

if TYPE_CHECKING:  # imported when tracing is on only (service/http/tracing.py): no OpenTelemetry without it
    from das.service.http.tracing import BatchTrace, RolloutTracer

log = logging.getLogger(__name__)

# Records a stream chunk carries at most: a replay of a large batch goes out in pieces, not one huge buffer.
_CHUNK_RECORDS = 1024


class _Batch:
    """One accepted batch. Its records are appended in finishing order, msgpack-encoded, and never change, so
    any number of readers can follow it by position. Encoded once: a msgpack reader streams the stored bytes as
    they are, and results held for replay cost bytes per token rather than Python objects."""

    def __init__(self, batch_id: str, groups: list[GroupRequest], logprobs: bool, prompts: bool,
                 fingerprint: str, seed: int, progress: bool = False, timings: bool = False) -> None:
        self.batch_id = batch_id
        self.timings = timings  # records carry finished_unix_s
        # Token progress and records in one order, for streams that asked for progress (service/http/batch_progress.py)
        self.progress_log = ProgressLog(_pack, logprobs) if progress else None
        self.seed = seed
        self.groups = groups
        self.logprobs = logprobs
        self.prompts = prompts
        self.fingerprint = fingerprint
        self.expected = sum(g.n for g in groups)
        self.frames: list[bytes] = []
        self.size = 0  # bytes in frames (and progress frames, where kept)
        self.status: BatchStatus = "queued"
        self.error: str | None = None
        self.task: asyncio.Task[None] | None = None
        self.stall: asyncio.Timeout | None = None  # its stall timer, once running (suspended while paused)
        self.aborts = GroupAborts()  # its groups aborted alone (a session's turn: DELETE /v1/sessions/{id})
        # Without a batch_id no retry can name it: aborted once no connection follows it (_Gateway.follow).
        self.tied = False
        self.readers = 0  # connections streaming it now
        self.trace: BatchTrace | None = None  # its spans, when the gateway traces (service/http/tracing.py)
        self.finish_times: list[float] = []  # seconds after start, per record
        self.lengths: list[int] = []
        self.tokens = self.draft_tokens = self.accepted_tokens = self.errors = 0
        self._start = 0.0
        # Replaced on every change; readers wait on the one they saw (an Event survives a waiter's cancellation).
        self._changed = asyncio.Event()

    @property
    def ended(self) -> bool:
        return self.status in ("done", "aborted", "failed")

    def start(self) -> None:
        self.status = "running"
        self._start = time.perf_counter()

    def add(self, group_index: int, sample: SampleResult) -> None:
        latency = time.perf_counter() - self._start
        record: dict[str, Any] = {
            "group_index": group_index, "problem_id": sample.problem_id, "sample_index": sample.sample_index,
            "output_token_ids": sample.token_ids, "text": sample.text, "finish_reason": sample.finish_reason,
            "policy_version": sample.policy_version, "draft_tokens": sample.draft_tokens,
            "accepted_tokens": sample.accepted_tokens, "latency_s": latency, "error": sample.error,
            "engine": sample.engine}
        if self.logprobs:
            record["logprobs"] = sample.logprobs
        if self.prompts:
            record["prompt_token_ids"] = sample.prompt_token_ids
        if sample.policy_spans is not None:
            record["policy_spans"] = sample.policy_spans
        if sample.tool_calls is not None:
            record["tool_calls"] = [call.model_dump() for call in sample.tool_calls]
            record["content"] = sample.content
        if self.timings and sample.finished_unix_s is not None:
            record["finished_unix_s"] = sample.finished_unix_s
        frame = _pack(record)
        self.frames.append(frame)
        self.size += len(frame)
        if self.progress_log is not None:
            self.progress_log.record(frame)
        self.finish_times.append(latency)
        self.lengths.append(len(sample.token_ids))
        self.tokens += len(sample.token_ids)
        self.draft_tokens += sample.draft_tokens
        self.accepted_tokens += sample.accepted_tokens
        self.errors += sample.finish_reason == "error"
        self._notify()

    def progress(self, group_index: int, report: SampleProgress) -> None:
        """A sample's new tokens: into the progress log if the batch keeps one."""
        if self.progress_log is not None:
            before = self.progress_log.size
            self.progress_log.progress(group_index, report)
            self.size += self.progress_log.size - before  # retained with the batch, so counted in retained_bytes
            self._notify()

    def end(self, status: BatchStatus, error: str | None) -> None:
        self.status, self.error = status, error
        self._notify()

    async def wait_beyond(self, count: int, frames: list[bytes] | None = None) -> None:
        """Returns once there are more than `count` records (or frames of `frames`) or the batch has ended."""
        frames = self.frames if frames is None else frames
        while len(frames) <= count and not self.ended:
            await self._changed.wait()

    def summary(self) -> BatchSummary:
        return BatchSummary(
            batch_id=self.batch_id, status=self.status, groups=len(self.groups), samples_expected=self.expected,
            samples=len(self.frames), tokens=self.tokens, draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens, errors=self.errors,
            makespan_s=self.finish_times[-1] if self.finish_times else None, error=self.error, seed=self.seed)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


class _BatchRegistry:
    """Live batches, plus ended ones for replay up to `retained_batches` and `retained_bytes` (oldest ended
    first out). Evicted ids are remembered (ids only, bounded) so a late retry is refused, not run again."""

    def __init__(self, settings: GatewayConfig) -> None:
        self._settings = settings
        self.live: dict[str, _Batch] = {}
        self._ended: OrderedDict[str, _Batch] = OrderedDict()
        self._ended_bytes = 0
        self._evicted: OrderedDict[str, None] = OrderedDict()
        self._evicted_cap = 16 * max(settings.retained_batches, 64)

    def get(self, batch_id: str) -> _Batch | None:
        return self.live.get(batch_id) or self._ended.get(batch_id)

    def evicted(self, batch_id: str) -> bool:
        return batch_id in self._evicted

    def add(self, batch: _Batch) -> None:
        self.live[batch.batch_id] = batch

    def ended(self, batch: _Batch) -> None:
        del self.live[batch.batch_id]
        self._ended[batch.batch_id] = batch
        self._ended_bytes += batch.size
        s = self._settings
        while self._ended and (len(self._ended) > s.retained_batches or self._ended_bytes > s.retained_bytes):
            old_id, old = self._ended.popitem(last=False)
            self._ended_bytes -= old.size
            self._evicted[old_id] = None
            if len(self._evicted) > self._evicted_cap:
                self._evicted.popitem(last=False)

    def all_live(self) -> list[_Batch]:
        return list(self.live.values())


_pack = msgpack.Packer().pack  # one per process is safe: the event loop calls it from one thread
_json = json.JSONEncoder(separators=(",", ":")).encode


def _encoder(wire: str) -> Callable[[list[bytes]], bytes]:
    """Stored msgpack frames to the wire: as they are, or re-encoded as NDJSON lines."""
    if wire == MSGPACK:
        return b"".join
    return lambda frames: "".join(_json(msgpack.unpackb(f)) + "\n" for f in frames).encode()


_INTEGER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _exact_integers(node: Any) -> None:
    """Integer schemas' bounds in `node` (an OpenAPI document, in place) as JSON integers. FastAPI's schema model types
    bounds as floats, so int64's 2**63 - 1 came out as 9.223372036854776e+18 (= 2**63), a value the validators
    refuse. A float bound below 2**53 is the integer exactly; 2**63 can only stand for INT64_MAX (its nearest double),
    the one bound beyond 2**53 the models declare."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            for key in _INTEGER_BOUNDS:
                bound = node.get(key)
                if isinstance(bound, float) and bound.is_integer():
                    node[key] = INT64_MAX if bound >= 2**63 else max(int(bound), -INT64_MAX - 1)
        for value in node.values():
            _exact_integers(value)
    elif isinstance(node, list):
        for value in node:
            _exact_integers(value)


def _exact_integer_bounds(app: FastAPI) -> dict[str, Any]:
    """FastAPI's OpenAPI schema of `app`, with exact integer bounds (`_exact_integers`); built once."""
    if not app.openapi_schema:
        _exact_integers(FastAPI.openapi(app))
    return app.openapi_schema


class _Gateway:
    """The app's state and the logic behind its routes."""

    def __init__(self, backend: RolloutBackend, settings: GatewayConfig) -> None:
        self.backend = backend
        self.settings = settings
        self.metrics = GatewayMetrics(backend.stats)
        self.metrics.policy_version = backend.policy_version
        self.batches = _BatchRegistry(settings)
        self.reload_lock = ReloadLock()
        # vLLM's weight transfer: a push holds the reload lock from its start to its end, as a reload does
        self.weight_updates = WeightUpdates(backend, lambda: self.reload_lock.reload(drain=not self.paused),
                                            self._pushed, settings.weight_update_idle_s)
        self._current: _Batch | None = None  # the most recently started batch
        # paused by POST /pause until POST /resume (service/http/rl_control.py): new batches wait here meanwhile
        # (service/engine/pause_gate.py says why the service holds them)
        self.hold = PauseGate()
        self._admitting = 0  # requests between the in-flight check and their batch's registration
        self.stalls_in_a_row = 0  # batches failed by the stall timeout since a sample last finished
        self.journal = BatchJournal(settings.batch_journal) if settings.batch_journal is not None else None
        self.metrics.batch_journal = self.journal
        # Sessions outlive a restart with a state directory (beside the batch journal); else in memory only.
        self.session_journal = (SessionJournal(SessionJournalConfig(
            state_dir=settings.batch_journal.state_dir, fsync=settings.batch_journal.fsync))
            if settings.batch_journal is not None else None)
        self.sessions = SessionBook(settings.sessions, on_close=self._session_closed,
                                    on_turn=self.session_journal.record_turn if self.session_journal else None)
        if self.session_journal is not None:
            self.session_journal.open_sessions = self.sessions.open
            self.metrics.session_journal = self.session_journal
            self.sessions.restore(self.session_journal.restored(time.monotonic))
        self.metrics.sessions = self.sessions
        attach = getattr(backend, "attach_sessions", None)  # a backend that places turns by engine reads the book
        if attach is not None:
            attach(self.sessions)
        self._stopping = False  # batches aborted from now on were cut off by the shutdown
        self._aborts: set[asyncio.Task[None]] = set()  # aborts of abandoned batches (the loop holds tasks weakly)
        self.tracer: RolloutTracer | None = None
        if settings.otlp_traces_endpoint is not None:
            from das.service.http.tracing import RolloutTracer

            self.tracer = RolloutTracer.otlp(settings.otlp_traces_endpoint, settings.otlp_traces_sample_ratio)

    def _session_closed(self, session: Session, reason: CloseReason) -> None:
        self.metrics.observe_session(session, reason)
        if self.session_journal is not None:
            self.session_journal.closed(session)

    # ---- rollouts ----

    def _existing(self, body: RolloutRequest, fingerprint: str) -> _Batch | None:
        if body.batch_id is None:
            return None
        if self.batches.evicted(body.batch_id):
            raise HTTPException(410, f"batch {body.batch_id} ended and its results are no longer retained")
        batch = self.batches.get(body.batch_id)
        if batch is not None and batch.fingerprint != fingerprint:
            raise HTTPException(409, f"batch_id {body.batch_id} is already used by a different batch")
        if batch is None and self.journal is not None and (old := self.journal.previous(body.batch_id)):
            self.metrics.previous_run_refusals += 1
            raise HTTPException(409, old.refusal(fingerprint).model_dump())
        return batch

    async def admit(self, body: RolloutRequest, route: str = "/v1/rollouts",
                    headers: Sequence[Mapping[str, str]] = ()) -> tuple[_Batch, int]:
        """The batch this request streams (a new one, or the running/ended one with its id) and the record to
        start from. A new batch is traced (when the gateway traces) as run for `route`, following the W3C
        traceparent of the requests' `headers` (service/http/tracing.py)."""
        arrived_ns = time.time_ns() if self.tracer is not None else 0
        identity = body.model_dump_json(include={"groups", "logprobs", "return_prompt_token_ids", "seed"})
        fingerprint = hashlib.sha256(identity.encode()).hexdigest()
        batch = self._existing(body, fingerprint)
        if batch is not None:
            return batch, body.resume_from
        samples = sum(g.n for g in body.groups)
        if samples > self.settings.max_batch_samples:
            raise HTTPException(413, f"the batch asks for {samples} samples; the limit is "
                                     f"{self.settings.max_batch_samples} (max_batch_samples)")
        if not await self.backend.ready():
            raise HTTPException(503, "the backend is not ready", headers={"Retry-After": "5"})
        # Requests still being checked hold a slot too: counting registered batches only, every request checked at
        # the same time would pass.
        in_flight = len(self.batches.live) + self._admitting
        if in_flight >= self.settings.max_batches_in_flight:
            raise HTTPException(429, f"{in_flight} batches in flight; the limit is "
                                     f"{self.settings.max_batches_in_flight}", headers={"Retry-After": "1"})
        self._admitting += 1
        try:
            try:
                await self.backend.check(body.groups)
            except GroupInputError as exc:
                raise input_error(exc, ["body", "groups", exc.group_index]) from None
            except EngineInputError as exc:
                raise input_error(exc, ["body", "groups"]) from None
            # A concurrent request with the same id may have started the batch while the checks awaited.
            batch = self._existing(body, fingerprint)
            if batch is not None:
                return batch, body.resume_from
            # Seeds are fixed here, once: a sample re-run after its engine died draws the same tokens.
            seed = body.seed if body.seed is not None else fresh_seed()
            batch = _Batch(body.batch_id or uuid.uuid4().hex, seeded_groups(body.groups, seed), body.logprobs,
                           body.return_prompt_token_ids, fingerprint, seed, body.progress, body.timings)
            turns = [(g.session_id, g.problem_id) for g in body.groups if g.session_id is not None]
            if turns:
                try:
                    self.sessions.begin(batch.batch_id, turns)
                except SessionConflict as exc:
                    if exc.status != 422:
                        raise HTTPException(exc.status, str(exc)) from None
                    index = next(i for i, g in enumerate(body.groups) if g.session_id == exc.session_id)
                    raise input_error(EngineInputError(str(exc)), ["body", "groups", index, "session_id"]) from None
            self.batches.add(batch)
            if self.journal is not None and body.batch_id is not None:  # unnamed batches cannot be retried by id
                self.journal.accepted(batch.batch_id, fingerprint, batch.expected)
            if self.tracer is not None:
                batch.trace = self.tracer.batch(batch.batch_id, route, batch.groups, arrived_ns, headers)
                batch.trace.admitted()
        finally:
            self._admitting -= 1
        self.metrics.batches_in_flight += 1
        batch.task = asyncio.create_task(self._run(batch), name=f"batch-{batch.batch_id}")
        return batch, 0

    async def _run(self, batch: _Batch) -> None:
        status: BatchStatus = "failed"
        error: str | None = None
        stall_s = self.settings.batch_stall_timeout_s
        stalled: asyncio.Timeout | None = None
        try:
            await self.hold.resumed()  # a batch sent while paused reaches the engines once they have resumed
            async with self.reload_lock.batch():
                batch.start()
                if batch.trace is not None:
                    batch.trace.dispatched()
                self._current = batch
                self.metrics.current_batch_longest = 0
                loop = asyncio.get_running_loop()
                # Started here, not before the lock: a batch held behind a reload is waiting, not stalled.
                stalled = batch.stall = asyncio.timeout(None if self.paused else stall_s)
                def alive() -> None:
                    # A token or a sample made: the batch is not stalled. The deadline moves when it would move by
                    # 1% of stall_s (1 s at most) or more, so a stall is declared at most that much early (re-armed
                    # for every progress report, the timer cost the gateway ~30 us each, several a sample).
                    assert stalled is not None
                    self.stalls_in_a_row = 0
                    if self.paused:
                        stalled.reschedule(None)
                        return
                    deadline, when = loop.time() + stall_s, stalled.when()
                    if when is None or deadline - when >= min(1.0, stall_s / 100):
                        stalled.reschedule(deadline)

                def heard(group_index: int, report: SampleProgress) -> None:
                    # a token made anywhere in the batch: it is not stalled (a long sample is not a stall)
                    alive()
                    batch.progress(group_index, report)

                # Traced, each sample's engine is told its span as the parent of the engine's own spans.
                groups = batch.trace.parents(batch.groups) if batch.trace is not None else batch.groups
                samples = self.backend.generate(groups, heard, batch.aborts)
                async with stalled, contextlib.aclosing(samples) as stream:
                    async for group_index, sample in stream:
                        alive()
                        self.metrics.observe_sample(sample, batch.groups[group_index].sampling.max_tokens)
                        if batch is self._current:
                            self.metrics.current_batch_longest = max(self.metrics.current_batch_longest,
                                                                     len(sample.token_ids))
                        batch.add(group_index, sample)
                        if batch.trace is not None:
                            batch.trace.sample(group_index, sample)
                        if (group := batch.groups[group_index]).session_id is not None:
                            self.sessions.finished(
                                batch.batch_id, group.session_id, engine=sample.engine,
                                prompt_tokens=len(sample.prompt_token_ids or group.prompt_token_ids or ()),
                                output_tokens=len(sample.token_ids), finish_reason=sample.finish_reason,
                                policy_version=sample.policy_version, policy_spans=sample.policy_spans)
            status = "done"
        except asyncio.CancelledError:
            # DELETE or shutdown. Not re-raised: this task is the batch's own and ends here.
            status = "aborted"
        except Exception as exc:
            if stalled is not None and stalled.expired():
                error = (f"no sample made a token for {stall_s:g} s (batch_stall_timeout_s); the samples still "
                         f"running were aborted")
                self.stalls_in_a_row += 1
                log.error("batch %s failed: %s", batch.batch_id, error)
            else:
                log.exception("batch %s failed", batch.batch_id)
                error = f"{type(exc).__name__}: {exc}"
        finally:
            self._finish(batch, status, error)

    def _finish(self, batch: _Batch, status: BatchStatus, error: str | None) -> None:
        """Ends the batch once (its task, or `abort` when the task was cancelled before its first step)."""
        if batch.ended:
            return
        batch.end(status, error)
        self.batches.ended(batch)
        self.sessions.batch_ended(batch.batch_id)
        if self.journal is not None:
            ended: EndStatus = "interrupted" if self._stopping and status == "aborted" else status
            self.journal.ended(batch.batch_id, ended, len(batch.frames))
        self.metrics.batches_in_flight -= 1
        if batch.trace is not None:
            batch.trace.end(status, error, len(batch.frames), batch.tokens, batch.draft_tokens, batch.accepted_tokens)
        makespan = batch.finish_times[-1] if batch.finish_times else 0.0
        self.metrics.observe_batch(status, makespan, batch.finish_times, batch.lengths)

    @staticmethod
    async def stream(batch: _Batch, start: int, wire: str, progress: bool = False) -> AsyncIterator[bytes]:
        """The batch's records from position `start`, as they come, then its summary. Whatever is ready goes out
        in one chunk: one write per burst, not per sample. With `progress` (and a batch that keeps progress), the
        samples' progress frames too, each before its sample's record."""
        encode = _encoder(wire)
        log = batch.progress_log if progress else None
        frames = log.frames if log is not None else batch.frames
        sent = log.start(start) if log is not None else start
        while True:
            available = len(frames)
            if sent < available:
                end = min(available, sent + _CHUNK_RECORDS)
                yield encode(frames[sent:end])
                sent = end
            elif batch.ended:
                yield encode([_pack({"summary": batch.summary().model_dump()})])
                return
            else:
                await batch.wait_beyond(sent, frames)

    async def follow(self, batch: _Batch, start: int, wire: str, progress: bool) -> AsyncIterator[bytes]:
        """`stream` for one client connection of POST /v1/rollouts. A tied batch (no batch_id) that its last reader
        leaves before it ended is aborted, and counted abandoned: nothing could attach to it again. A named batch
        runs on, replayable under its retention."""
        batch.readers += 1
        try:
            async with contextlib.aclosing(self.stream(batch, start, wire, progress)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            batch.readers -= 1
            if batch.tied and batch.readers == 0 and not batch.ended:
                self.metrics.requests_abandoned["/v1/rollouts"] += 1
                # A task: this generator is being closed (cancelled), and must not await the abort itself.
                task = asyncio.create_task(self.abort(batch), name=f"abandoned-{batch.batch_id}")
                self._aborts.add(task)
                task.add_done_callback(self._aborts.discard)

    def tie(self, batch: _Batch) -> None:
        batch.tied = True

    async def abort(self, batch: _Batch) -> None:
        if batch.task is not None and not batch.ended:
            batch.task.cancel()
            await asyncio.wait([batch.task])
            self._finish(batch, "aborted", None)

    async def shutdown(self) -> None:
        self._stopping = True
        for batch in self.batches.all_live():
            await self.abort(batch)
        if self.journal is not None:
            self.journal.close()
        if self.session_journal is not None:
            await self.session_journal.aclose()
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)  # flushes: the batches just aborted have ended spans

    # ---- weights ----

    def weights_path(self, given: str) -> Path:
        root = self.settings.weights_root
        if root is None:
            raise HTTPException(403, "weight reloads are disabled: no weights root is configured")
        root = root.resolve()
        path = Path(given)
        try:
            path = (path if path.is_absolute() else root / path).resolve()
        except (OSError, RuntimeError) as exc:  # a symlink loop, a directory it may not enter: nothing to load
            # The reason only: the message would show where the weights root lies on the server.
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "a symlink loop"
            raise HTTPException(422, [{"loc": ["body", "path"], "msg": f"cannot be resolved: {reason}",
                                       "type": "value_error"}]) from None
        if not path.is_relative_to(root):
            raise HTTPException(403, "path: the weights must lie under the configured weights root")
        return path

    async def reload(self, body: WeightsRequest) -> WeightsResponse:
        version, seconds = await self.load_weights(body.path, body.version)
        return WeightsResponse(policy_version=version, reload_s=seconds)

    async def load_weights(self, given: str, version: int | None) -> tuple[int, float]:
        """Loads the checkpoint `given` (confined to the weights root) as policy `version` (None: the served one
        + 1) on every engine; returns the version served and the seconds it took. Waits for the running batches
        first unless the service is paused (their samples then span the update: SampleResult.policy_spans)."""
        path = self.weights_path(given)
        start = time.perf_counter()
        async with self.reload_lock.reload(drain=not self.paused):
            # Checked inside the lock: a concurrent reload may have moved the version while this one waited.
            served = self.backend.policy_version
            version = served + 1 if version is None else version
            if version <= served:
                raise HTTPException(409, f"version: {version} is not newer than the served {served}")
            try:
                version = await self.backend.control(ReloadWeights(checkpoint=str(path), version=version))
            except EngineInputError as exc:
                raise input_error(exc, ["body"]) from None
        seconds = time.perf_counter() - start
        self.metrics.reload_duration.observe(seconds)
        self.metrics.policy_version = version
        return version, seconds

    def _pushed(self, push: PushResult) -> None:
        self.metrics.weight_transfers += 1
        self.metrics.weight_transfer_bytes += push.bytes
        self.metrics.transfer_duration.observe(push.seconds)
        self.metrics.policy_version = push.policy_version

    @property
    def paused(self) -> bool:
        return self.hold.paused

    def set_paused(self, mode: PauseMode | None) -> None:
        """Marks the service paused in `mode`, or serving (None); a paused batch's stall timer is off (no sample may
        finish while the engines are paused), and starts afresh on resume."""
        if mode is None:
            self.hold.resume()
        else:
            self.hold.pause(mode)
        deadline = None if self.paused else asyncio.get_running_loop().time() + self.settings.batch_stall_timeout_s
        for batch in self.batches.all_live():
            if batch.stall is not None and not batch.ended:
                with contextlib.suppress(RuntimeError):  # its timer has already been left (the batch is ending)
                    batch.stall.reschedule(deadline)


def create_app(backend: RolloutBackend, settings: GatewayConfig | None = None) -> FastAPI:
    """The gateway over `backend`. Batches still running at shutdown are aborted."""
    gateway = _Gateway(backend, settings or GatewayConfig())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if gateway.settings.freeze_gc:
            # Imports and setup leave ~70k long-lived objects; a full collection scans them all (45 ms on this
            # machine), and the first one comes during the first batches, stalling every stream. Frozen, they
            # are never scanned again.
            gc.collect()
            gc.freeze()
        yield
        await gateway.shutdown()

    # Every route: RequestGuard answers before any route runs.
    guarded = error_responses({408: "the request body did not arrive within body_timeout_s (connection closed)",
                               413: "the request body is over max_body_bytes (refused before it is parsed)"})
    app = FastAPI(title="DAS rollout service", version="1", lifespan=lifespan, description=__doc__,
                  responses=guarded)
    app.openapi = lambda: _exact_integer_bounds(app)  # type: ignore[method-assign]

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        """FastAPI's own 422, with the echoed input made JSON-safe."""
        return JSONResponse({"detail": json_safe(jsonable_encoder(exc.errors()))}, 422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """FastAPI's own answers, except a body that is not UTF-8: FastAPI gives it a bare 400, where a body that is
        not JSON is 422; both are invalid input, 422 here. A 405's Allow lists the methods of every route of the
        path (Starlette's names the first route's only: GET /v1/rollouts/{id} hid DELETE)."""
        if isinstance(exc.__cause__, UnicodeDecodeError):
            return JSONResponse({"detail": [{"loc": ["body"], "msg": "JSON decode error: the body is not UTF-8",
                                             "type": "json_invalid"}]}, 422)
        if exc.status_code == 405:
            allowed = sorted({method for route in app.routes if isinstance(route, BaseRoute)
                              and route.matches(request.scope)[0] is not Match.NONE
                              for method in getattr(route, "methods", None) or ()})
            exc = StarletteHTTPException(405, exc.detail, headers={**(exc.headers or {}), "Allow": ", ".join(allowed)})
        return await http_exception_handler(request, exc)

    token = gateway.settings.token
    # HTTPBearer documents the scheme in the OpenAPI schema; RequestGuard enforces it, before any body is read.
    api = APIRouter(dependencies=[Depends(HTTPBearer(auto_error=False))] if token is not None else [],
                    responses=error_responses({401: "missing or wrong bearer token"}) if token is not None else None)

    api.include_router(batch_router(gateway))
    api.include_router(openai_router(gateway))
    api.include_router(rl_control_router(gateway))
    api.include_router(session_router(gateway))
    app.include_router(api)
    app.include_router(health_router(gateway))  # open routes: no token

    # Routes answering in OpenAI's (and vLLM's) error shape get their refusals before any route in that shape too.
    openai_paths = frozenset(route.path for route in app.routes if isinstance(route, OpenAIErrorRoute))

    def error_body(path: str, status: int, message: str) -> dict[str, Any]:
        if path in openai_paths:
            return OpenAIError(status, message, code="invalid_api_key" if status == 401 else None).body().model_dump()
        return {"detail": message}

    app.add_middleware(RequestGuard, token=token, max_body_bytes=gateway.settings.max_body_bytes,
                       body_timeout_s=gateway.settings.body_timeout_s, error_body=error_body,
                       open_paths=open_paths(app),
                       on_body_timeout=gateway.metrics.body_timed_out)
    return app
