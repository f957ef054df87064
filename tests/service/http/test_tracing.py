"""A trace per rollout (service/http/tracing.py): the spans of a batch and its samples under the trainer's
traceparent, their attributes and engine timings, the gateway exporting them over OTLP/HTTP to a collector stand-in
on the batch and OpenAI routes, an unreachable collector costing one warning and no rollout, and a gateway without
an endpoint that loads no OpenTelemetry, starts no exporter and posts nothing."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from das.service.cluster.rollout_backend import EngineBackend
from das.service.engine.stub_engine import StubEngine, StubEngineConfig
from das.service.http import tracing
from das.service.http.gateway import create_app
from das.service.config import GatewayConfig
from das.service.http.tracing import RolloutTracer
from das.service.config import traces_url
from das.service.wire.api import EngineDeath, GroupRequest, SampleResult
from loadtests.otlp_collector import OtlpCollector
from tests.service.stub_backend import stub_backend

ROOT = Path(__file__).resolve().parents[3]
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.mark.parametrize(("given", "url"), [
    ("http://127.0.0.1:4318", "http://127.0.0.1:4318/v1/traces"),
    ("http://collector:4318/", "http://collector:4318/v1/traces"),
    ("https://otel.example/custom/traces", "https://otel.example/custom/traces"),
])
def test_a_base_url_gets_the_traces_path_and_a_url_with_a_path_is_kept(given: str, url: str) -> None:
    assert traces_url(given) == url


@pytest.mark.parametrize(("given", "says"), [
    ("127.0.0.1:4318", "not an http(s) URL with a host"),
    ("grpc://collector:4317", "not an http(s) URL with a host"),
    ("http://:4318", "not an http(s) URL with a host"),
    ("http://user:hunter2@collector:4318", "without credentials"),
    ("http://collector:4318/v1/traces?token=hunter2", "without credentials, query"),
    ("http://collector:99999", "out of range"),
    ("http://collector:0", "port 0"),
])
def test_a_bad_endpoint_is_refused_naming_why_and_never_echoing_credentials(given: str, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)) as refused:
        traces_url(given)
    assert "hunter2" not in str(refused.value)


def test_das_serve_refuses_a_bad_endpoint_with_exit_status_2_before_starting_anything() -> None:
    from typer.testing import CliRunner

    from das.service.cli import program
    app = program()

    result = CliRunner().invoke(app, ["serve", "--stub-engine", "--port", "1", "--otlp-traces-endpoint",
                                      "http://user:hunter2@collector:4318"])
    assert result.exit_code == 2
    said = " ".join(result.output.split())
    assert "--otlp-traces-endpoint: give http(s)://host[:port][/path] only" in said and "hunter2" not in said


# ---- the spans, through an in-memory exporter ----


@pytest.fixture
def memory() -> Iterator[tuple[RolloutTracer, InMemorySpanExporter]]:
    exported = InMemorySpanExporter()
    tracer = RolloutTracer(SimpleSpanProcessor(exported))
    yield tracer, exported
    tracer.shutdown()


def group(n: int = 2) -> GroupRequest:
    return GroupRequest(problem_id="p", n=n, prompt_token_ids=(1, 2, 3))


def sample(index: int, **fields: Any) -> SampleResult:
    values: dict[str, Any] = dict(problem_id="p", sample_index=index, token_ids=[5] * 12, logprobs=[-0.1] * 12,
                                  finish_reason="length", policy_version=3, draft_tokens=8, accepted_tokens=5,
                                  first_token_s=0.25, total_s=1.0, engine="node-a/0", predicted_tokens=40.5,
                                  redispatches=1)
    return SampleResult(**(values | fields))


def test_the_batch_span_is_a_child_of_the_traceparent_and_every_sample_a_child_of_the_batch(memory) -> None:
    tracer, exported = memory
    start = time.time_ns()
    trace = tracer.batch("b1", "/v1/rollouts", [group(2)], start, [{"traceparent": TRACEPARENT}])
    trace.admitted()
    trace.dispatched()
    time.sleep(0.01)  # longer than the sample's engine time: its events fall after the dispatch, as they do
    trace.sample(0, sample(0, first_token_s=0.001, total_s=0.004))
    trace.sample(0, sample(1, finish_reason="error", error="engine died", engine=None, predicted_tokens=None))
    trace.end("done", None, 2, 24, 16, 10)

    spans = {(s.name, s.attributes.get("das.sample_index")): s for s in exported.get_finished_spans()}
    batch = spans[("rollout.batch", None)]
    assert f"{batch.context.trace_id:032x}" == TRACE_ID and f"{batch.parent.span_id:016x}" == PARENT_ID
    assert batch.parent.is_remote and batch.start_time == start
    assert [e.name for e in batch.events] == ["admitted", "dispatched"]
    assert dict(batch.attributes) == {"das.batch_id": "b1", "das.route": "/v1/rollouts", "das.groups": 1,
                                      "das.samples_expected": 2, "das.status": "done", "das.samples": 2,
                                      "das.output_tokens": 24, "das.draft_tokens": 16, "das.accepted_tokens": 10}
    first, failed = spans[("rollout.sample", 0)], spans[("rollout.sample", 1)]
    for span in (first, failed):
        assert span.context.trace_id == batch.context.trace_id and span.parent.span_id == batch.context.span_id
    assert dict(first.attributes) == {
        "das.problem_id": "p", "das.group_index": 0, "das.sample_index": 0, "das.output_tokens": 12,
        "das.draft_tokens": 8, "das.accepted_tokens": 5, "das.finish_reason": "length", "das.redispatches": 1,
        "das.policy_version": 3, "das.predicted_tokens": 40.5, "das.engine": "node-a/0"}
    # the engine's durations placed back from the delivery: started total_s before it, the first token 1 ms on
    assert first.start_time == batch.events[1].timestamp  # the dispatch
    events = {e.name: e.timestamp for e in first.events}
    assert first.end_time - events["engine.started"] == 4_000_000
    assert events["engine.first_token"] - events["engine.started"] == 1_000_000
    assert first.start_time < events["engine.started"]
    assert "das.engine" not in failed.attributes and "das.predicted_tokens" not in failed.attributes
    assert failed.status.status_code.name == "ERROR" and failed.status.description == "engine died"
    assert first.status.status_code.name == "UNSET"


def test_without_a_traceparent_the_batch_roots_its_own_trace_and_a_failed_batch_says_why(memory) -> None:
    tracer, exported = memory
    trace = tracer.batch("b2", "/v1/rollouts", [group()], time.time_ns(), [{"traceparent": "00-garbage"}])
    trace.end("failed", "RuntimeError: no engine serves", 0, 0, 0, 0)
    (batch,) = exported.get_finished_spans()
    assert batch.parent is None and f"{batch.context.trace_id:032x}" != TRACE_ID
    assert batch.status.status_code.name == "ERROR" and batch.status.description == "RuntimeError: no engine serves"


def test_coalesced_requests_link_their_traces_and_an_unsampled_parent_records_no_sample(memory) -> None:
    tracer, exported = memory
    other = "00-11111111111111111111111111111111-2222222222222222-01"
    trace = tracer.batch("b3", "/v1/completions", [group()], time.time_ns(),
                         [{}, {"traceparent": TRACEPARENT}, {"traceparent": other}])
    trace.end("done", None, 0, 0, 0, 0)
    (batch,) = exported.get_finished_spans()
    assert f"{batch.context.trace_id:032x}" == TRACE_ID  # the first request carrying a traceparent is the parent
    assert [f"{link.context.trace_id:032x}" for link in batch.links] == ["1" * 32]

    exported.clear()
    unsampled = tracer.batch("b4", "/v1/rollouts", [group()], time.time_ns(),
                             [{"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-00"}])
    unsampled.dispatched()
    unsampled.sample(0, sample(0))
    unsampled.end("done", None, 1, 12, 8, 5)
    assert exported.get_finished_spans() == ()  # the trainer did not sample its trace: neither do we


def test_each_samples_engine_is_told_the_span_its_sample_gets_and_a_redispatch_is_an_event(memory) -> None:
    tracer, exported = memory
    trace = tracer.batch("b5", "/v1/rollouts", [group(2), group(3)], time.time_ns(), [{"traceparent": TRACEPARENT}])
    trace.dispatched()
    sent = trace.parents([group(2), group(3)])
    assert [len(g.trace_parents) for g in sent] == [2, 3]
    parents = [p for g in sent for p in g.trace_parents]
    assert len(set(parents)) == 5 and all(p.startswith(f"00-{TRACE_ID}-") for p in parents)
    died = time.time()
    trace.sample(1, sample(2, redispatches=2, engine_deaths=[EngineDeath(engine="node-a/0", unix_s=died - 0.5),
                                                               EngineDeath(engine="node-b/1", unix_s=died)]))
    trace.sample(0, sample(0, redispatches=0))
    trace.end("done", None, 2, 24, 16, 10)

    spans = {(s.attributes.get("das.group_index"), s.attributes.get("das.sample_index")): s
             for s in exported.get_finished_spans()}
    for (g, i), span in spans.items():
        if g is not None:  # the span id its engine was given as the parent of its own spans
            assert sent[g].trace_parents[i] == f"00-{TRACE_ID}-{span.context.span_id:016x}-01"
    moved = spans[(1, 2)]
    assert [(e.name, dict(e.attributes), e.timestamp) for e in moved.events if e.name == "redispatched"] == [
        ("redispatched", {"das.dead_engine": "node-a/0", "das.deaths": 1}, int((died - 0.5) * 1e9)),
        ("redispatched", {"das.dead_engine": "node-b/1", "das.deaths": 2}, int(died * 1e9))]
    assert moved.attributes["das.redispatches"] == 2
    assert not [e for e in spans[(0, 0)].events if e.name == "redispatched"]

    unsampled = tracer.batch("b6", "/v1/rollouts", [group()], time.time_ns(),
                             [{"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-00"}])
    assert unsampled.parents([group()])[0].trace_parents is None  # nothing recorded: engines join nothing


# ---- the gateway, exporting over OTLP/HTTP ----


def run(app: Any, *requests: tuple[str, dict[str, Any], dict[str, str]]) -> list[httpx.Response]:
    """The requests, concurrently, against `app` in process; the app's lifespan ends (flushing its spans) before
    this returns."""
    async def go() -> list[httpx.Response]:
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
                return await asyncio.gather(*(http.post(path, json=body, headers=headers)
                                              for path, body, headers in requests))
    return asyncio.run(go())


BATCH = {"groups": [{"problem_id": f"p{i}", "n": 3, "prompt_token_ids": [1, 2, 3]} for i in range(2)]}


def test_the_gateway_exports_a_batch_and_every_sample_under_the_trainers_trace() -> None:
    with OtlpCollector() as collector:
        app = create_app(stub_backend(tokens=8), GatewayConfig(otlp_traces_endpoint=collector.url))
        (response,) = run(app, ("/v1/rollouts", BATCH, {"traceparent": TRACEPARENT}))
    assert response.status_code == 200
    assert {path for path, _ in collector.requests} == {"/v1/traces"}
    spans = collector.spans()
    (batch,) = [s for s in spans if s.name == "rollout.batch"]
    assert (batch.trace_id, batch.parent_span_id) == (TRACE_ID, PARENT_ID)
    assert batch.service_name == "das-rollout" and batch.attributes["das.status"] == "done"
    assert batch.attributes["das.batch_id"] == response.headers["X-Batch-Id"]
    samples = [s for s in spans if s.name == "rollout.sample"]
    assert sorted((s.attributes["das.problem_id"], s.attributes["das.sample_index"]) for s in samples) == [
        (f"p{i}", j) for i in range(2) for j in range(3)]
    assert all(s.trace_id == TRACE_ID and s.parent_span_id == batch.span_id for s in samples)
    assert all(batch.start_ns <= s.start_ns <= s.end_ns <= batch.end_ns for s in samples)


def test_coalesced_openai_requests_share_one_batch_span_linked_to_each_trace() -> None:
    other = "00-11111111111111111111111111111111-2222222222222222-01"
    completion = {"model": "das", "prompt": "17 + 25 =", "n": 2, "max_tokens": 8}
    with OtlpCollector() as collector:
        app = create_app(stub_backend(tokens=8), GatewayConfig(otlp_traces_endpoint=collector.url,
                                                               openai_coalesce_s=0.2))
        responses = run(app, ("/v1/completions", completion, {"traceparent": TRACEPARENT}),
                        ("/v1/completions", completion, {"traceparent": other}))
    assert [r.status_code for r in responses] == [200, 200]
    assert responses[0].headers["X-Batch-Id"] == responses[1].headers["X-Batch-Id"]  # coalesced: one batch
    spans = collector.spans()
    (batch,) = [s for s in spans if s.name == "rollout.batch"]
    assert batch.attributes["das.route"] == "/v1/completions" and batch.attributes["das.samples_expected"] == 4
    assert {batch.trace_id, *batch.links} == {TRACE_ID, "1" * 32}  # one request's trace parents it, one links
    samples = [s for s in spans if s.name == "rollout.sample"]
    assert len(samples) == 4 and all(s.parent_span_id == batch.span_id for s in samples)


def test_a_stub_engine_is_given_its_samples_spans_as_trace_parents_and_none_without_an_endpoint() -> None:
    engine = StubEngine(StubEngineConfig(tokens=4))
    with OtlpCollector() as collector:
        app = create_app(EngineBackend(engine), GatewayConfig(otlp_traces_endpoint=collector.url))
        (response,) = run(app, ("/v1/rollouts", BATCH, {"traceparent": TRACEPARENT}))
    assert response.status_code == 200
    spans = {(s.attributes["das.problem_id"], s.attributes["das.sample_index"]): s
             for s in collector.spans() if s.name == "rollout.sample"}
    given = {(problem, index): headers["traceparent"] for problem, index, headers in engine.trace_headers}
    assert len(given) == len(spans) == 6  # every sample's request, under its own sample's span
    for key, traceparent in given.items():
        assert traceparent == f"00-{TRACE_ID}-{spans[key].span_id}-01"

    untraced = StubEngine(StubEngineConfig(tokens=4))
    (response,) = run(create_app(EngineBackend(untraced), GatewayConfig()),
                      ("/v1/rollouts", BATCH, {"traceparent": TRACEPARENT}))
    assert response.status_code == 200 and not untraced.trace_headers


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_collector_costs_one_warning_and_no_rollout(monkeypatch, caplog) -> None:
    monkeypatch.setattr(tracing, "EXPORT_TIMEOUT_S", 1.5)  # one retry (after ~1 s) before the deadline
    app = create_app(stub_backend(tokens=8),
                     GatewayConfig(otlp_traces_endpoint=f"http://127.0.0.1:{closed_port()}"))
    started = time.monotonic()
    with caplog.at_level(logging.INFO):
        responses = run(app, *[("/v1/rollouts", BATCH, {"traceparent": TRACEPARENT})] * 3)
    assert [r.status_code for r in responses] == [200] * 3
    assert all(len(r.text.splitlines()) == 7 for r in responses)  # six samples and the summary each
    assert time.monotonic() - started < 5
    said = [r for r in caplog.records if r.name.startswith("opentelemetry") or r.name == tracing.__name__]
    assert [r.levelname for r in said] == ["WARNING"], [r.getMessage() for r in said]
    assert "could not export" in said[0].getMessage() and "Connection refused" in said[0].getMessage()


def test_without_an_endpoint_no_opentelemetry_is_loaded_no_exporter_runs_and_nothing_is_posted() -> None:
    # A fresh interpreter: this one has loaded OpenTelemetry for the tests above. OTel's own variable names the
    # collector there, and is not followed: only the setting turns tracing on.
    script = textwrap.dedent(f"""
        import asyncio, sys, threading
        import httpx
        from tests.service.stub_backend import stub_backend
        from das.service.http.gateway import create_app
        from das.service.config import GatewayConfig

        app = create_app(stub_backend(tokens=8), GatewayConfig())
        async def go():
            async with app.router.lifespan_context(app):
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://g") as http:
                    r = await http.post("/v1/rollouts", json={BATCH!r}, headers={{"traceparent": "{TRACEPARENT}"}})
                    assert r.status_code == 200 and len(r.text.splitlines()) == 7, r.text
                    r = await http.post("/v1/completions", json={{"model": "das", "prompt": "x", "max_tokens": 4}},
                                        headers={{"traceparent": "{TRACEPARENT}"}})
                    assert r.status_code == 200, r.text
                    print(sorted(t.name for t in threading.enumerate()))
        asyncio.run(go())
        print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
    """)
    with OtlpCollector() as collector:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT,
                              env={**os.environ, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{collector.url}/v1/traces",
                                   "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url})
        time.sleep(0.2)  # anything in flight would have landed
    assert done.returncode == 0, done.stderr
    threads, modules = done.stdout.strip().splitlines()[-2:]
    assert "Otel" not in threads and threads.startswith("[")
    assert modules == "[]"
    assert collector.requests == []



@pytest.mark.parametrize("ratio, traced", [(0.0, False), (1.0, True)])
def test_the_sample_ratio_decides_for_batches_without_a_traceparent_and_a_trainers_flag_for_its_own(
        ratio: float, traced: bool) -> None:
    """At ratio 0 a batch of its own trace records nothing and tells its engines no parents; a trainer's sampled
    traceparent is traced whatever the ratio."""
    exported = InMemorySpanExporter()
    tracer = RolloutTracer(SimpleSpanProcessor(exported), sample_ratio=ratio)
    try:
        own = tracer.batch("b5", "/v1/rollouts", [group()], time.time_ns())
        own.dispatched()
        (sent,) = own.parents([group()])
        own.sample(0, sample(0))
        own.end("done", None, 1, 12, 8, 5)
        assert len(exported.get_finished_spans()) == (2 if traced else 0)
        assert (sent.trace_parents is not None) == traced
        exported.clear()
        trainers = tracer.batch("b6", "/v1/rollouts", [group()], time.time_ns(), [{"traceparent": TRACEPARENT}])
        trainers.dispatched()
        trainers.sample(0, sample(0))
        trainers.end("done", None, 1, 12, 8, 5)
        assert sorted(span.name for span in exported.get_finished_spans()) == ["rollout.batch", "rollout.sample"]
    finally:
        tracer.shutdown()
