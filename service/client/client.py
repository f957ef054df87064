"""Trainer-side client of the gateway: `RolloutClient` (blocking) and `AsyncRolloutClient` (asyncio).

`generate(groups)` returns a stream that yields each `SampleRecord` as the server finishes it; once exhausted,
its `summary` holds the batch's `BatchSummary`. Wire format msgpack by default, NDJSON with `wire="ndjson"`.

Safe retries: every batch carries a batch_id (generated when not given) that is sent on every attempt, so a
retry after a dropped connection, a 429/502/503/504 or a stream cut short attaches to the batch the server is
already running instead of running it again. The retry asks the server to skip the records already received,
and records are also de-duplicated by (group_index, sample_index), so none is yielded twice.

Across a restart of the service: a server with a state directory remembers the batch ids it accepted, and a retry
of a batch that the previous run of the service accepted raises `BatchFromPreviousRunError` (how that batch ended,
how many samples it produced, how many this client received) instead of running the batch again: resubmit the
samples still needed under a new batch id. A server without a state directory runs the batch again from the start;
the de-duplication above still yields each sample once.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any, Literal
from urllib.parse import quote

import httpx
import msgpack

from das.service.client.history_chunks import history_bodies
from das.service.wire.api import (
    MSGPACK,
    NDJSON,
    BatchFromPreviousRun,
    BatchSummary,
    EndStatus,
    GroupRequest,
    PauseMode,
    ProblemSummary,
    SampleRecord,
    SamplingSpec,
)
from das.service.wire.sample_progress import ProgressRecord
from das.service.client.history_chunks import history_bodies
from das.service.client.session_client import AsyncClientSession, ClientSession

Wire = Literal["msgpack", "ndjson"]

_RETRY_STATUS = frozenset({429, 502, 503, 504})
# Generation can take many minutes between samples: no read timeout by default, bounded connect and write.
DEFAULT_TIMEOUT = httpx.Timeout(connect=10.0, read=None, write=60.0, pool=30.0)


class RolloutError(RuntimeError):
    """The server refused a request (`status_code`, `detail`), or a batch ended aborted or failed
    (`summary`)."""

    def __init__(self, message: str, *, status_code: int | None = None, detail: Any = None,
                 summary: BatchSummary | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.detail = detail
        self.summary = summary


class BatchFromPreviousRunError(RolloutError):
    """The server refused the batch id (409) because an earlier run of the service accepted it: the batch is not
    run again, and its results are gone with that run. `status`: how it ended there (done, failed, aborted, or
    interrupted: cut off by the restart); `samples_delivered`: samples it produced before it ended (None: unknown,
    the process died first); `records_received`: the distinct samples this client yielded for it (across attempts,
    so before the restart too); `same_request`: whether the server saw the same groups and options under that id.
    To go on, resubmit the samples still needed under a new batch id."""

    def __init__(self, previous: BatchFromPreviousRun, records_received: int) -> None:
        super().__init__(f"HTTP 409: {previous.message} (this client received {records_received})",
                         status_code=409, detail=previous.model_dump())
        self.batch_id: str = previous.batch_id
        self.status: EndStatus = previous.status
        self.samples_delivered: int | None = previous.samples_delivered
        self.samples_expected: int = previous.samples_expected
        self.records_received = records_received
        self.same_request: bool = previous.same_request
        self.accepted_unix_s: float = previous.accepted_unix_s
        self.ended_unix_s: float | None = previous.ended_unix_s


class _Retryable(Exception):
    """An attempt that may be repeated with the same batch_id; `status_code` None when the stream was cut."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


def _may_retry(exc: Exception, idempotent: bool) -> bool:
    """Whether a failed call may be sent again. A call that is not idempotent only when the server cannot have
    acted on it: the connection was never made, or it answered 429/503."""
    if idempotent:
        return True
    if isinstance(exc, _Retryable):
        return exc.status_code in (429, 503)
    return isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))


def _groups_json(groups: Sequence[GroupRequest | Mapping[str, Any]]) -> list[dict[str, Any]]:
    # Validated here, so a bad group fails before any network traffic, with pydantic's field-named error.
    return [(g if isinstance(g, GroupRequest) else GroupRequest.model_validate(g)).model_dump(
        mode="json", exclude_none=True) for g in groups]


def _raise_for(response: httpx.Response, body: bytes, received: int = 0) -> None:
    """Nothing for a 2xx; _Retryable for a status worth retrying; BatchFromPreviousRunError for a batch id an
    earlier run of the server accepted (`received`: records of it this client has); RolloutError otherwise."""
    if response.is_success:
        return
    try:
        parsed = json.loads(body)
        detail = parsed.get("detail", parsed.get("error"))  # our routes' shape, or vLLM's (OpenAI's) on the RL routes
    except (ValueError, AttributeError):
        detail = body.decode(errors="replace")
    if response.status_code == 409 and isinstance(detail, dict) and detail.get("code") == "batch_from_previous_run":
        raise BatchFromPreviousRunError(BatchFromPreviousRun.model_validate(detail), received)
    if response.status_code in _RETRY_STATUS:
        raise _Retryable(f"HTTP {response.status_code}: {detail}", response.status_code)
    raise RolloutError(f"HTTP {response.status_code}: {detail}", status_code=response.status_code, detail=detail)


class _BatchProgress:
    """What one batch has received over all its attempts: decodes the wire, drops duplicates, keeps the
    summary."""

    def __init__(self, groups: list[dict[str, Any]], batch_id: str, logprobs: bool, prompts: bool,
                 wire: Wire, seed: int | None, progress: bool = False, timings: bool = False) -> None:
        self.batch_id = batch_id
        self.timings = timings
        self.progress = progress
        self._delivered: dict[tuple[int, int], int] = {}  # per sample in flight, tokens its progress carried
        self.seed = seed
        self.wire = wire
        self.summary: BatchSummary | None = None
        self._groups = groups
        self._logprobs = logprobs
        self._prompts = prompts
        self._seen: set[tuple[int, int]] = set()
        self._received = 0  # records of this batch in server order: what a retry asks the server to skip
        self._reset(0)

    @property
    def yielded(self) -> int:
        """Distinct records handed to the caller so far, over every attempt."""
        return len(self._seen)

    @property
    def accept(self) -> str:
        return MSGPACK if self.wire == "msgpack" else NDJSON

    def body(self) -> dict[str, Any]:
        body = {"batch_id": self.batch_id, "groups": self._groups, "logprobs": self._logprobs,
                "return_prompt_token_ids": self._prompts, "resume_from": self._received}
        if self.progress:
            body["progress"] = True
        if self.timings:
            body["timings"] = True
        return body if self.seed is None else {**body, "seed": self.seed}

    def begin(self, response: httpx.Response) -> None:
        """A new attempt's stream starts; the server says at which of the batch's records (it starts from 0
        when it did not know the batch, e.g. after a restart)."""
        self._reset(int(response.headers.get("X-Stream-Offset", 0)))

    def _reset(self, offset: int) -> None:
        self._unpacker = msgpack.Unpacker(raw=False)
        self._pending = b""  # an NDJSON line not complete yet
        self._attempt_records = 0
        self._attempt_offset = offset

    def feed(self, chunk: bytes) -> list[SampleRecord | ProgressRecord]:
        """New records in `chunk` (a piece of the stream, cut anywhere), and progress objects if asked for (a
        repeat of tokens already yielded, after a retry, is dropped)."""
        if self.wire == "msgpack":
            self._unpacker.feed(chunk)
            objects: Iterator[Any] = iter(self._unpacker)
        else:
            lines = (self._pending + chunk).split(b"\n")
            self._pending = lines.pop()
            objects = (json.loads(line) for line in lines if line)
        out: list[SampleRecord | ProgressRecord] = []
        for obj in objects:
            if "progress" in obj:
                report = ProgressRecord.model_validate(obj["progress"])
                key = (report.group_index, report.sample_index)
                if key not in self._seen and report.offset >= self._delivered.get(key, 0):
                    self._delivered[key] = report.offset + len(report.token_ids)
                    out.append(report)
                continue
            if "summary" in obj:
                self.summary = BatchSummary.model_validate(obj["summary"])
                continue
            self._attempt_records += 1
            self._received = max(self._received, self._attempt_offset + self._attempt_records)
            record = SampleRecord.model_validate(obj)
            key = (record.group_index, record.sample_index)
            if key not in self._seen:
                self._seen.add(key)
                self._delivered.pop(key, None)
                out.append(record)
        return out

    def finish(self) -> None:
        """The end of one attempt's stream: _Retryable if it ended before the summary; RolloutError if the batch
        ended aborted or failed."""
        if self.summary is None:
            raise _Retryable("the stream ended before the batch summary")
        if self.summary.status != "done":
            raise RolloutError(f"batch {self.batch_id} {self.summary.status}"
                               + (f": {self.summary.error}" if self.summary.error else ""), summary=self.summary)


_JSON_HEADERS = {"Content-Type": "application/json"}


class _ClientBase:
    # A history import is cut into requests within the server's limits (GatewayConfig.max_body_bytes and
    # max_history_records, at their defaults here): set these to a server's own if it was started with others.
    max_body_bytes: int = 64 << 20
    max_history_records: int = 1_000_000

    def __init__(self, url: str, token: str | None, wire: Wire, retries: int, backoff_s: float) -> None:
        if wire not in ("msgpack", "ndjson"):
            raise ValueError(f"wire must be 'msgpack' or 'ndjson', got {wire!r}")
        self.wire = wire
        self.retries = retries
        self.backoff_s = backoff_s
        self._base_url = url.rstrip("/")
        # Kept only in the header dict given to httpx; never part of a message or repr.
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}

    def _progress(self, groups: Sequence[GroupRequest | Mapping[str, Any]], batch_id: str | None,
                  logprobs: bool, prompts: bool, seed: int | None, progress: bool = False,
                  timings: bool = False) -> _BatchProgress:
        return _BatchProgress(_groups_json(groups), batch_id or uuid.uuid4().hex, logprobs, prompts, self.wire, seed,
                              progress, timings)

    def _delay(self, attempt: int) -> float:
        """Seconds before retry `attempt` (1-based): exponential, capped at 10 s."""
        return min(self.backoff_s * 2 ** (attempt - 1), 10.0)


class RolloutStream:
    """Iterate for the batch's samples as they finish; afterwards `summary` is the batch's final summary."""

    def __init__(self, client: RolloutClient, progress: _BatchProgress) -> None:
        self._client = client
        self._progress = progress
        self.batch_id = progress.batch_id

    @property
    def summary(self) -> BatchSummary | None:
        return self._progress.summary

    def __iter__(self) -> Iterator[SampleRecord | ProgressRecord]:
        client, progress = self._client, self._progress
        for attempt in range(client.retries + 1):
            try:
                with client.http.stream("POST", "/v1/rollouts", json=progress.body(),
                                        headers={"Accept": progress.accept}) as response:
                    _raise_for(response, b"" if response.is_success else response.read(), progress.yielded)
                    progress.begin(response)
                    for chunk in response.iter_bytes():
                        yield from progress.feed(chunk)
                progress.finish()
                return
            except (httpx.TransportError, _Retryable) as exc:
                if attempt == client.retries:
                    raise RolloutError(f"batch {self.batch_id}: gave up after {attempt + 1} attempts: {exc}") \
                        from exc
            time.sleep(client._delay(attempt + 1))


class RolloutClient(_ClientBase):
    """Blocking client. `token`: the server's bearer token. `retries`: extra attempts for a batch or call that
    failed in transit (`backoff_s` doubling). Use as a context manager or call `close()`."""

    def __init__(self, url: str, token: str | None = None, *, wire: Wire = "msgpack", retries: int = 5,
                 backoff_s: float = 0.5, timeout: httpx.Timeout | float | None = DEFAULT_TIMEOUT,
                 transport: httpx.BaseTransport | None = None) -> None:
        super().__init__(url, token, wire, retries, backoff_s)
        self.http = httpx.Client(base_url=self._base_url, headers=self._headers, timeout=timeout,
                                 transport=transport)

    def generate(self, groups: Sequence[GroupRequest | Mapping[str, Any]], batch_id: str | None = None,
                 logprobs: bool = False, return_prompt_token_ids: bool = False,
                 seed: int | None = None, progress: bool = False, timings: bool = False) -> RolloutStream:
        """The batch's samples as they finish (iterate the result). `seed`: the batch's seed (the same seed draws
        the same samples; None: the server draws one, in `summary.seed`). `progress`: also yield each running
        sample's new tokens as `ProgressRecord`s as they are made (each sample's before its record). `timings`:
        records carry `finished_unix_s`. Raises RolloutError when the server refuses the batch, gives up
        retrying, or the batch ends aborted or failed."""
        return RolloutStream(self, self._progress(groups, batch_id, logprobs, return_prompt_token_ids, seed,
                                                  progress, timings))

    def _call(self, method: str, path: str, json_body: Any = None, params: Mapping[str, Any] | None = None,
              content: bytes | None = None) -> Any:
        idempotent = method in ("GET", "DELETE")
        headers = _JSON_HEADERS if content is not None else None
        for attempt in range(self.retries + 1):
            try:
                response = self.http.request(method, path, json=json_body, params=params, content=content,
                                             headers=headers)
                _raise_for(response, response.content)
                return response.json()
            except (httpx.TransportError, _Retryable) as exc:
                if attempt == self.retries or not _may_retry(exc, idempotent):
                    raise RolloutError(f"{method} {path}: failed after {attempt + 1} attempt(s): {exc}") \
                        from exc
            time.sleep(self._delay(attempt + 1))

    def status(self, batch_id: str) -> BatchSummary:
        return BatchSummary.model_validate(self._call("GET", f"/v1/rollouts/{batch_id}"))

    def abort(self, batch_id: str) -> BatchSummary:
        return BatchSummary.model_validate(self._call("DELETE", f"/v1/rollouts/{batch_id}"))

    def reload_weights(self, path: str, version: int) -> int:
        """Reloads the policy (waits for running batches); returns the version now served."""
        return int(self._call("POST", "/v1/weights", {"path": path, "version": version})["policy_version"])

    def add_history(self, records: list[dict[str, Any]]) -> int:
        """Imports finished rollouts for drafting; returns how many were stored. Sent in as many requests as the
        server's body and record limits need (`max_body_bytes`, `max_history_records`): a failure partway leaves
        the earlier requests' records imported (RolloutError says how many)."""
        added = 0
        for body in history_bodies(records, self.max_body_bytes, self.max_history_records):
            try:
                added += int(self._call("POST", "/v1/history", content=body)["added"])
            except RolloutError as exc:
                raise RolloutError(f"{exc} ({added} records imported before it)", status_code=exc.status_code,
                                   detail=exc.detail) from exc
        return added

    def pause(self, mode: PauseMode = "abort") -> None:
        """vLLM's /pause on every engine: "abort" ends the samples in flight (delivered with finish_reason
        "abort"), "wait" returns once they finished, "keep" freezes them until `resume`; new batches are held."""
        self._call("POST", "/pause", params={"mode": mode})

    def resume(self) -> None:
        self._call("POST", "/resume")

    def is_paused(self) -> bool:
        return bool(self._call("GET", "/is_paused")["is_paused"])

    def update_weights(self, path: str, version: int | None = None) -> int:
        """/update_weights: `reload_weights` without waiting for running batches while paused (samples frozen by
        "keep" go on under the new weights and list both versions in `policy_spans`); version default: served
        + 1. Returns the version now served."""
        body = {"path": path} if version is None else {"path": path, "version": version}
        return int(self._call("POST", "/update_weights", body)["policy_version"])

    def history(self, problem_id: str) -> ProblemSummary:
        """What the server's history store holds for a problem; RolloutError (404) when nothing."""
        return ProblemSummary.model_validate(self._call("GET", f"/v1/history/{quote(problem_id, safe='')}"))

    def session(self, problem_id: str, session_id: str | None = None,
                sampling: SamplingSpec | None = None) -> ClientSession:
        """A new agent trajectory: `turn(new_tokens)` per step (service/client/session_client.py)."""
        return ClientSession(self, problem_id, session_id, sampling)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncRolloutStream:
    """`async for` the batch's samples as they finish; afterwards `summary` is the batch's final summary."""

    def __init__(self, client: AsyncRolloutClient, progress: _BatchProgress) -> None:
        self._client = client
        self._progress = progress
        self.batch_id = progress.batch_id

    @property
    def summary(self) -> BatchSummary | None:
        return self._progress.summary

    async def __aiter__(self) -> AsyncIterator[SampleRecord | ProgressRecord]:
        client, progress = self._client, self._progress
        for attempt in range(client.retries + 1):
            try:
                async with client.http.stream("POST", "/v1/rollouts", json=progress.body(),
                                              headers={"Accept": progress.accept}) as response:
                    _raise_for(response, b"" if response.is_success else await response.aread(),
                               progress.yielded)
                    progress.begin(response)
                    async for chunk in response.aiter_bytes():
                        for record in progress.feed(chunk):
                            yield record
                progress.finish()
                return
            except (httpx.TransportError, _Retryable) as exc:
                if attempt == client.retries:
                    raise RolloutError(f"batch {self.batch_id}: gave up after {attempt + 1} attempts: {exc}") \
                        from exc
            await asyncio.sleep(client._delay(attempt + 1))


class AsyncRolloutClient(_ClientBase):
    """The asyncio twin of `RolloutClient`. Use with `async with` or call `await aclose()`."""

    def __init__(self, url: str, token: str | None = None, *, wire: Wire = "msgpack", retries: int = 5,
                 backoff_s: float = 0.5, timeout: httpx.Timeout | float | None = DEFAULT_TIMEOUT,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        super().__init__(url, token, wire, retries, backoff_s)
        self.http = httpx.AsyncClient(base_url=self._base_url, headers=self._headers, timeout=timeout,
                                      transport=transport)

    def generate(self, groups: Sequence[GroupRequest | Mapping[str, Any]], batch_id: str | None = None,
                 logprobs: bool = False, return_prompt_token_ids: bool = False,
                 seed: int | None = None, progress: bool = False, timings: bool = False) -> AsyncRolloutStream:
        """The batch's samples as they finish (`async for` the result); `seed`, `progress`, `timings` and errors
        as `RolloutClient.generate`."""
        return AsyncRolloutStream(self, self._progress(groups, batch_id, logprobs, return_prompt_token_ids, seed,
                                                       progress, timings))

    async def _call(self, method: str, path: str, json_body: Any = None,
                    params: Mapping[str, Any] | None = None, content: bytes | None = None) -> Any:
        idempotent = method in ("GET", "DELETE")
        headers = _JSON_HEADERS if content is not None else None
        for attempt in range(self.retries + 1):
            try:
                response = await self.http.request(method, path, json=json_body, params=params, content=content,
                                                   headers=headers)
                _raise_for(response, response.content)
                return response.json()
            except (httpx.TransportError, _Retryable) as exc:
                if attempt == self.retries or not _may_retry(exc, idempotent):
                    raise RolloutError(f"{method} {path}: failed after {attempt + 1} attempt(s): {exc}") \
                        from exc
            await asyncio.sleep(self._delay(attempt + 1))

    async def status(self, batch_id: str) -> BatchSummary:
        return BatchSummary.model_validate(await self._call("GET", f"/v1/rollouts/{batch_id}"))

    async def abort(self, batch_id: str) -> BatchSummary:
        return BatchSummary.model_validate(await self._call("DELETE", f"/v1/rollouts/{batch_id}"))

    async def reload_weights(self, path: str, version: int) -> int:
        """Reloads the policy (waits for running batches); returns the version now served."""
        body = await self._call("POST", "/v1/weights", {"path": path, "version": version})
        return int(body["policy_version"])

    async def add_history(self, records: list[dict[str, Any]]) -> int:
        """See RolloutClient.add_history."""
        added = 0
        for body in history_bodies(records, self.max_body_bytes, self.max_history_records):
            try:
                added += int((await self._call("POST", "/v1/history", content=body))["added"])
            except RolloutError as exc:
                raise RolloutError(f"{exc} ({added} records imported before it)", status_code=exc.status_code,
                                   detail=exc.detail) from exc
        return added

    async def pause(self, mode: PauseMode = "abort") -> None:
        """See RolloutClient.pause."""
        await self._call("POST", "/pause", params={"mode": mode})

    async def resume(self) -> None:
        await self._call("POST", "/resume")

    async def is_paused(self) -> bool:
        return bool((await self._call("GET", "/is_paused"))["is_paused"])

    async def update_weights(self, path: str, version: int | None = None) -> int:
        """See RolloutClient.update_weights."""
        body = {"path": path} if version is None else {"path": path, "version": version}
        return int((await self._call("POST", "/update_weights", body))["policy_version"])

    async def history(self, problem_id: str) -> ProblemSummary:
        """What the server's history store holds for a problem; RolloutError (404) when nothing."""
        return ProblemSummary.model_validate(await self._call("GET", f"/v1/history/{quote(problem_id, safe='')}"))

    def session(self, problem_id: str, session_id: str | None = None,
                sampling: SamplingSpec | None = None) -> AsyncClientSession:
        """A new agent trajectory: `await turn(new_tokens)` per step (service/client/session_client.py)."""
        return AsyncClientSession(self, problem_id, session_id, sampling)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
