"""The trainer client against a real gateway on loopback: samples as they stream in both wire formats, the async
twin, and safe retries (a dropped connection mid-stream, a not-ready server) that never run a batch twice nor
yield a sample twice."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from das.service.engine.stub_engine import STUB_LOGPROB, StubEngine, StubEngineConfig
from das.service.client import AsyncRolloutClient, RolloutClient, RolloutError
from das.service.cluster.rollout_backend import EngineBackend, RolloutBackend
from das.service.http.gateway import create_app
from tests.service.live_gateway import TOKEN, LiveServer, gateway_settings, groups
from tests.service.client.batch_keys import ALL_12, keys
from tests.service.stub_backend import stub_backend


@pytest.fixture
def live() -> Iterator[Any]:
    """live(backend, **settings) -> LiveServer; stopped at the end of the test."""
    servers: list[LiveServer] = []

    def start(backend: RolloutBackend, **settings: Any) -> LiveServer:
        servers.append(LiveServer(create_app(backend, gateway_settings(**settings))).__enter__())
        return servers[-1]

    yield start
    for server in servers:
        server.__exit__()


class _CutStream(httpx.SyncByteStream):
    """Passes `limit` bytes of a real response through, then fails like a connection reset."""

    def __init__(self, inner: httpx.SyncByteStream, limit: int) -> None:
        self._inner, self._limit = inner, limit

    def __iter__(self) -> Iterator[bytes]:
        passed = 0
        for chunk in self._inner:
            if passed + len(chunk) >= self._limit:
                yield chunk[: self._limit - passed]
                raise httpx.ReadError("connection reset (test)")
            passed += len(chunk)
            yield chunk

    def close(self) -> None:
        self._inner.close()


class DropFirstStream(httpx.HTTPTransport):
    """A real loopback transport whose first rollout stream is cut after `limit` bytes. Records the bodies of
    every rollout request."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.bodies: list[dict[str, Any]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if request.url.path != "/v1/rollouts":
            return response
        self.bodies.append(json.loads(request.content))
        if len(self.bodies) > 1:
            return response
        assert isinstance(response.stream, httpx.SyncByteStream)
        return httpx.Response(response.status_code, headers=response.headers,
                              stream=_CutStream(response.stream, self.limit), extensions=response.extensions)


class _AsyncCutStream(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, limit: int) -> None:
        self._inner, self._limit = inner, limit

    async def __aiter__(self) -> AsyncIterator[bytes]:
        passed = 0
        async for chunk in self._inner:
            if passed + len(chunk) >= self._limit:
                yield chunk[: self._limit - passed]
                raise httpx.ReadError("connection reset (test)")
            passed += len(chunk)
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


class AsyncDropFirstStream(httpx.AsyncHTTPTransport):
    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.bodies: list[dict[str, Any]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        if request.url.path != "/v1/rollouts":
            return response
        self.bodies.append(json.loads(request.content))
        if len(self.bodies) > 1:
            return response
        assert isinstance(response.stream, httpx.AsyncByteStream)
        return httpx.Response(response.status_code, headers=response.headers,
                              stream=_AsyncCutStream(response.stream, self.limit), extensions=response.extensions)


@pytest.mark.parametrize("wire", ["msgpack", "ndjson"])
def test_generate_yields_every_sample_once_with_the_summary(live, wire):
    server = live(stub_backend(tokens=6), token=TOKEN)
    with RolloutClient(server.url, token=TOKEN, wire=wire) as client:
        stream = client.generate(groups(3, 4), logprobs=True)
        records = list(stream)
        assert client.status(stream.batch_id).status == "done"
    assert keys(records) == ALL_12
    assert all(r.logprobs == [STUB_LOGPROB] * 6 and len(r.output_token_ids) == 6 for r in records)
    assert stream.summary is not None and stream.summary.samples == 12 and stream.summary.status == "done"


def test_samples_arrive_while_the_batch_runs(live):
    server = live(stub_backend(sample_s=0.1))
    with RolloutClient(server.url) as client:
        stream = client.generate(groups(1, 4))
        first = next(iter(stream))
        assert first.sample_index == 0
        progress = client.status(stream.batch_id)
    assert progress.status == "running" and progress.samples < 4


def test_a_dropped_connection_is_resumed_without_rerunning_or_repeating(live):
    backend = stub_backend(tokens=8, sample_s=0.01)
    server = live(backend)
    transport = DropFirstStream(limit=250)  # a few records, the last one cut mid-frame
    with RolloutClient(server.url, backoff_s=0.01, transport=transport) as client:
        stream = client.generate(groups(3, 4), batch_id="flaky", seed=9)
        records = list(stream)
    assert keys(records) == ALL_12  # every sample, none twice
    assert backend.runs == 1 and stream.summary is not None and stream.summary.seed == 9
    first, second = transport.bodies
    assert first["batch_id"] == second["batch_id"] == "flaky" and first["seed"] == second["seed"] == 9
    assert first["resume_from"] == 0 and second["resume_from"] > 0


def test_the_async_client_resumes_a_dropped_connection_too(live):
    backend = stub_backend(tokens=8, sample_s=0.01)
    server = live(backend)
    transport = AsyncDropFirstStream(limit=400)

    async def run() -> list[Any]:
        async with AsyncRolloutClient(server.url, wire="ndjson", backoff_s=0.01, transport=transport) as client:
            return [r async for r in client.generate(groups(3, 4))]

    records = asyncio.run(run())
    assert keys(records) == ALL_12 and backend.runs == 1
    assert len(transport.bodies) == 2 and transport.bodies[1]["resume_from"] > 0
    assert "seed" not in transport.bodies[0]  # no seed given: the server draws one


def test_a_server_not_ready_yet_is_retried(live):
    backend = stub_backend(ready=False)
    server = live(backend)
    threading.Timer(0.2, backend.mark_ready).start()
    with RolloutClient(server.url, backoff_s=0.05, retries=8) as client:
        records = list(client.generate(groups(1, 2)))
    assert len(records) == 2 and backend.runs == 1


def test_refusals_raise_at_once_with_the_server_detail(live):
    backend = stub_backend(max_model_len=4)
    server = live(backend)
    with RolloutClient(server.url, backoff_s=0.01) as client:
        with pytest.raises(RolloutError) as err:
            list(client.generate([{"problem_id": "p", "prompt_token_ids": list(range(9))}]))
        assert err.value.status_code == 422 and err.value.detail[0]["loc"] == ["body", "groups", 0]
        with pytest.raises(ValidationError, match="max_tokens"):  # checked locally, before any request
            client.generate([{"problem_id": "p", "prompt": "x", "sampling": {"max_tokens": 0}}])
    guarded = live(stub_backend(), token="right")
    with RolloutClient(guarded.url, token="wrong") as client, pytest.raises(RolloutError) as err:
        client.status("any")
    assert err.value.status_code == 401


def test_an_aborted_batch_raises_after_its_samples(live):
    server = live(stub_backend(sample_s=0.1))
    seen = []
    with RolloutClient(server.url) as client:
        stream = client.generate(groups(1, 5), batch_id="cut-short")
        with pytest.raises(RolloutError, match="aborted") as err:
            for record in stream:
                seen.append(record)
                client.abort("cut-short")
    assert err.value.summary is not None and err.value.summary.samples == len(seen) >= 1


def test_weights_and_history_calls(live, tmp_path):
    backend = stub_backend()
    server = live(backend, token=TOKEN, weights_root=tmp_path)

    async def run() -> tuple[int, int]:
        async with AsyncRolloutClient(server.url, token=TOKEN) as client:
            version = await client.reload_weights(str(tmp_path), 3)
            added = await client.add_history([{"problem_id": "p", "policy_version": 0, "sample_index": 0,
                                               "prompt_token_ids": [1], "output_token_ids": [2]}])
            return version, added

    assert asyncio.run(run()) == (3, 1)
    with RolloutClient(server.url, token=TOKEN) as client:
        records = list(client.generate(groups(1, 2)))
        with pytest.raises(RolloutError) as err:
            client.reload_weights("/", 4)
    assert {r.policy_version for r in records} == {3}
    assert err.value.status_code == 403


def test_pause_keep_update_weights_and_resume_through_the_client(live, tmp_path):
    (tmp_path / "step1").mkdir()
    engine = StubEngine(StubEngineConfig(tokens=20, token_s=0.05))  # a sample of 20 tokens: 1 s
    server = live(EngineBackend(engine), token=TOKEN, weights_root=tmp_path)

    async def run() -> tuple[list[Any], int, bool, RolloutError]:
        async with AsyncRolloutClient(server.url, token=TOKEN) as client:
            async def collect() -> list[Any]:
                return [record async for record in client.generate(groups(1, 1))]

            batch = asyncio.create_task(collect())
            async with asyncio.timeout(10):
                while engine._unfinished < 1:
                    await asyncio.sleep(0.005)
            await asyncio.sleep(0.2)
            await client.pause("keep")
            paused = await client.is_paused()
            version = await client.update_weights(str(tmp_path / "step1"))  # no wait for the frozen samples
            try:
                await client.update_weights(str(tmp_path / "step1"), version)
            except RolloutError as exc:
                stale = exc
            await client.resume()
            assert not await client.is_paused()
            return await batch, version, paused, stale

    records, version, paused, stale = asyncio.run(run())
    assert paused and version == 1
    assert stale.status_code == 409 and "not newer" in stale.detail["message"]  # vLLM's error shape, unwrapped
    (record,) = records
    assert record.policy_version == 0 and [v for v, _ in record.policy_spans] == [0, 1]  # frozen across the update
    with RolloutClient(server.url, token=TOKEN) as client, pytest.raises(RolloutError) as bad:
        client.pause("nap")  # type: ignore[arg-type]
    assert bad.value.status_code == 400 and "query.mode" in bad.value.detail["message"]
