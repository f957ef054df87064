"""`das serve --stub-engine --otlp-traces-endpoint URL` as a real process (embedded Ray, the coordinator, an engine
actor) against a collector stand-in: a batch sent with a traceparent, and an OpenAI completion with another,
come back as spans of those traces, the batch's and every sample's, with the placement's predicted length and the
engine's timings; stopping the server flushes them."""

from __future__ import annotations

import httpx

from loadtests.child_gateway import ServeProcess
from loadtests.otlp_collector import OtlpCollector

BATCH_TRACE, BATCH_PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
OPENAI_TRACE, OPENAI_PARENT = "5cf92f3577b34da6a3ce929d0e0e4737", "11f067aa0ba902b8"


def test_a_traced_batch_and_openai_request_yield_spans_of_their_traces_for_the_batch_and_every_sample() -> None:
    groups = [{"problem_id": f"p{i}", "prompt_token_ids": [5, 6, 7 + i], "n": 3, "sampling": {"max_tokens": 16}}
              for i in range(2)]
    with OtlpCollector() as collector:
        with ServeProcess("--stub-engine", "--otlp-traces-endpoint", collector.url) as server:
            auth = {"Authorization": f"Bearer {server.token}"}
            batch = httpx.post(f"{server.url}/v1/rollouts", json={"groups": groups}, timeout=60,
                               headers={**auth, "traceparent": f"00-{BATCH_TRACE}-{BATCH_PARENT}-01"})
            completion = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "model": "das", "prompt": [1, 2, 3], "n": 2, "max_tokens": 8, "seed": 7},
                headers={**auth, "traceparent": f"00-{OPENAI_TRACE}-{OPENAI_PARENT}-01"})
        assert server.returncode == 0, server.output()[-3000:]
        spans = collector.spans()  # the server flushed its spans on the way out
    assert batch.status_code == 200 and len(batch.text.splitlines()) == 7, batch.text
    assert completion.status_code == 200 and len(completion.json()["choices"]) == 2, completion.text
    assert {path for path, _ in collector.requests} == {"/v1/traces"}

    for trace_id, parent, route, expected in [
            (BATCH_TRACE, BATCH_PARENT, "/v1/rollouts", {(f"p{i}", j) for i in range(2) for j in range(3)}),
            (OPENAI_TRACE, OPENAI_PARENT, "/v1/completions", {(None, 0), (None, 1)})]:
        traced = [s for s in spans if s.trace_id == trace_id]
        (root,) = [s for s in traced if s.name == "rollout.batch"]
        assert root.parent_span_id == parent and root.service_name == "das-rollout"
        assert root.attributes["das.route"] == route and root.attributes["das.status"] == "done"
        assert [name for name, _ in root.events] == ["admitted", "dispatched"]
        samples = [s for s in traced if s.name == "rollout.sample"]
        keys = {(s.attributes["das.problem_id"] if route == "/v1/rollouts" else None, s.attributes["das.sample_index"])
                for s in samples}
        assert keys == expected and len(samples) == len(expected)  # every sample, once
        for span in samples:
            assert span.parent_span_id == root.span_id
            assert isinstance(span.attributes["das.engine"], str) and span.attributes["das.engine"]
            assert span.attributes["das.predicted_tokens"] > 0  # what the coordinator placed it by
            assert span.attributes["das.redispatches"] == 0 and span.attributes["das.finish_reason"] == "length"
            assert span.attributes["das.output_tokens"] == (16 if route == "/v1/rollouts" else 8)
            events = dict(span.events)
            assert span.start_ns <= events["engine.started"] <= events["engine.first_token"] <= span.end_ns
