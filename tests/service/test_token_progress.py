"""Token progress through the gateway: the batch API's opt-in progress stream (NDJSON, msgpack, the Python client),
OpenAI streaming as tokens are made, stalls judged by token progress, max_tokens bounded by the context at
admission, and a history import cut into requests within the body limit. In-process engines: the stub engine
behind `EngineBackend`, which reports every token."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgpack
import openai
import pytest

from das.service.engine.stub_engine import StubEngine, StubEngineConfig
from das.service.client import RolloutClient, RolloutError
from das.service.client.history_chunks import history_bodies
from das.service.cluster.rollout_backend import EngineBackend
from das.service.http.gateway import create_app
from das.service.wire.sample_progress import ProgressRecord
from tests.service.live_gateway import LiveServer, gateway_settings
from tests.service.stub_backend import stub_backend


def stub(**config: Any) -> EngineBackend:
    return EngineBackend(StubEngine(StubEngineConfig(**config)))  # type: ignore[arg-type]


@pytest.fixture
def serve() -> Iterator[Any]:
    servers: list[LiveServer] = []

    def start(backend: Any, **settings: Any) -> LiveServer:
        server = LiveServer(create_app(backend, gateway_settings(**settings))).__enter__()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.__exit__()


GROUPS = [{"problem_id": "p", "prompt_token_ids": [1, 2, 3], "n": 2, "sampling": {"max_tokens": 64}}]


@pytest.mark.parametrize("wire", ["ndjson", "msgpack"])
def test_a_batch_that_asks_for_progress_gets_each_samples_tokens_before_its_record(serve, wire):
    server = serve(stub(tokens=12, token_s=0.02))
    headers = {"Accept": "application/msgpack"} if wire == "msgpack" else {}
    response = httpx.post(f"{server.url}/v1/rollouts", json={"groups": GROUPS, "progress": True, "logprobs": True},
                          headers=headers, timeout=30)
    if wire == "msgpack":
        unpacker = msgpack.Unpacker(raw=False)
        unpacker.feed(response.content)
        objects = list(unpacker)
    else:
        objects = [json.loads(line) for line in response.text.splitlines()]
    assert objects[-1]["summary"]["status"] == "done"
    tokens: dict[int, list[int]] = {0: [], 1: []}
    reports = 0
    for obj in objects[:-1]:
        if "progress" in obj:
            p = obj["progress"]
            assert p["offset"] == len(tokens[p["sample_index"]])  # contiguous, from 0
            assert len(p["logprobs"]) == len(p["token_ids"])
            tokens[p["sample_index"]].extend(p["token_ids"])
            reports += 1
        else:
            full = obj["output_token_ids"]
            assert len(full) == 12 and full[:len(tokens[obj["sample_index"]])] == tokens[obj["sample_index"]]
            assert len(tokens[obj["sample_index"]]) == 11  # every token but the last came as progress first
    assert reports >= 2

    default = httpx.post(f"{server.url}/v1/rollouts", json={"groups": GROUPS}, timeout=30)
    assert not any("progress" in json.loads(line) for line in default.text.splitlines())  # opt-in only


@pytest.mark.parametrize("wire", ["ndjson", "msgpack"])
def test_the_client_yields_progress_records_when_asked(serve, wire):
    server = serve(stub(tokens=6, token_s=0.01))
    with RolloutClient(server.url, wire=wire) as client:
        items = list(client.generate(GROUPS, progress=True))
        plain = list(client.generate(GROUPS))
    reports = [i for i in items if isinstance(i, ProgressRecord)]
    records = [i for i in items if not isinstance(i, ProgressRecord)]
    assert len(records) == 2 and len(reports) == 10  # 5 of each sample's 6 tokens, one report each
    for record in records:
        mine = [r for r in reports if r.sample_index == record.sample_index]
        assert [t for r in mine for t in r.token_ids] == record.output_token_ids[:5]
    assert len(plain) == 2 and not any(isinstance(i, ProgressRecord) for i in plain)


def test_a_sample_generating_longer_than_the_stall_timeout_completes(serve):
    server = serve(stub(tokens=40, token_s=0.05), batch_stall_timeout_s=0.5)  # 2 s a sample, a token every 50 ms
    groups = [{**GROUPS[0], "n": 1}]
    response = httpx.post(f"{server.url}/v1/rollouts", json={"groups": groups}, timeout=30)
    *records, last = [json.loads(line) for line in response.text.splitlines()]
    assert last["summary"]["status"] == "done", last
    assert len(records) == 1 and len(records[0]["output_token_ids"]) == 40 and last["summary"]["makespan_s"] > 1.5


def test_a_backend_that_makes_no_token_still_fails_the_batch_as_stalled(serve):
    server = serve(stub(tokens=4, token_s=30.0), batch_stall_timeout_s=0.5)  # no token for 30 s
    started = time.monotonic()
    response = httpx.post(f"{server.url}/v1/rollouts", json={"groups": GROUPS}, timeout=30)
    summary = json.loads(response.text.splitlines()[-1])["summary"]
    assert summary["status"] == "failed" and "no sample made a token" in summary["error"]
    assert time.monotonic() - started < 10


def test_max_tokens_over_the_context_is_refused_at_admission_naming_the_limit(serve):
    server = serve(stub(tokens=4, max_model_len=64))
    over = [{**GROUPS[0], "sampling": {"max_tokens": 62}}]  # 3 prompt tokens + 62 > 64
    response = httpx.post(f"{server.url}/v1/rollouts", json={"groups": over}, timeout=10)
    assert response.status_code == 422
    assert "maximum context length is 64" in response.text and response.json()["detail"][0]["loc"][:3] == [
        "body", "groups", 0]
    fits = [{**GROUPS[0], "sampling": {"max_tokens": 61}}]
    assert httpx.post(f"{server.url}/v1/rollouts", json={"groups": fits}, timeout=10).status_code == 200

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=10)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 64"):
        client.completions.create(model="das", prompt=[1, 2, 3], max_tokens=62)


def test_the_openai_client_streams_a_chunk_per_50_ms_of_generation(serve):
    server = serve(stub(tokens=256, token_s=0.004))  # 256 tokens over ~1 s
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=30)
    times: list[float] = []
    tokens: list[int] = []
    finish = None
    for chunk in client.completions.create(model="das", prompt=[1, 2, 3], max_tokens=256, stream=True,
                                           stream_options={"include_usage": True},
                                           extra_body={"return_token_ids": True}):
        if chunk.choices:
            times.append(time.perf_counter())
            tokens.extend(chunk.choices[0].token_ids)
            finish = chunk.choices[0].finish_reason or finish
        else:
            assert chunk.usage.completion_tokens == 256
    span = times[-1] - times[0]
    assert len(tokens) == 256 and finish == "length"
    assert span > 0.5 and len(times) >= span / 0.05, (len(times), span)


def test_history_bodies_stay_within_the_limits_and_keep_every_record_in_order():
    records = [{"problem_id": f"p{i}", "n": "x" * (i % 50)} for i in range(300)]
    bodies = list(history_bodies(records, 2000, 40))
    assert len(bodies) > 1 and all(len(b) <= 2000 for b in bodies)
    decoded = [r for b in bodies for r in json.loads(b)["records"]]
    assert decoded == records and all(len(json.loads(b)["records"]) <= 40 for b in bodies)
    with pytest.raises(ValueError, match="record 1 is"):
        list(history_bodies([{"a": 1}, {"a": "y" * 5000}], 2000, 40))


def test_add_history_over_the_body_limit_goes_in_several_requests(serve):
    backend = stub_backend()
    server = serve(backend, max_body_bytes=4096)
    records = [{"problem_id": f"p{i % 7}", "policy_version": 0, "sample_index": i, "prompt_token_ids": [1, 2, 3],
                "output_token_ids": list(range(50)), "finish_reason": "stop"} for i in range(200)]
    with RolloutClient(server.url) as client:
        with pytest.raises(RolloutError, match="413"):
            client.max_body_bytes = 1 << 20  # as if the server's limit were larger: one request, refused
            client.add_history(records)
        assert backend.engine.history_records == 0
        client.max_body_bytes = 4096
        assert client.add_history(records) == 200
    assert backend.engine.history_records == 200
