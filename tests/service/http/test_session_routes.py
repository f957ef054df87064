"""Sessions over HTTP against the gateway on a stub engine: the official `openai` client running a 3-turn session
(session_id in extra_body, prompt as token ids, return_token_ids appended as the next turn's context), chat with
prompt_token_ids, refusals, GET/DELETE /v1/sessions, the das_session_* series. The trainer clients' sessions:
tests/service/client/test_session_client.py."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from das.service.engine.stub_engine import StubEngine, StubEngineConfig
from das.service.cluster.rollout_backend import EngineBackend
from das.service.config import SessionConfig
from tests.service.live_gateway import LiveServer, read_ndjson
from tests.service.stub_backend import sample_tokens, stub_backend


def scrape(server: LiveServer, headers: dict[str, str]) -> dict[str, float]:
    """Every sample of /metrics as {name{labels}: value}."""
    text = httpx.get(f"{server.url}/metrics", headers=headers).text
    return {f"{s.name}{dict(sorted(s.labels.items())) if s.labels else ''}": s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_three_turn_session_with_the_official_client_token_ids_in_and_out(session_serve):
    backend = stub_backend(tokens=5)
    server, client, headers = session_serve(backend)
    context = [1, 2, 3]
    for turn in range(3):
        out = client.completions.create(model="das", prompt=context, max_tokens=5,
                                        extra_body={"session_id": "traj-1", "problem_id": "task-7",
                                                    "return_token_ids": True})
        (choice,) = out.choices
        assert choice.prompt_token_ids == context
        assert choice.token_ids == sample_tokens(backend.received[-1][0], 0, 5)
        assert out.das["problem_id"] == "task-7"
        context = [*choice.prompt_token_ids, *choice.token_ids, 100 + turn]  # + a tool's output token
    # every turn reached the engine as exactly the context built from the previous turn's ids
    sent = [batch[0] for batch in backend.received]
    assert [len(g.prompt_token_ids) for g in sent] == [3, 9, 15]
    assert {g.session_id for g in sent} == {"traj-1"} and {g.problem_id for g in sent} == {"task-7"}

    session = httpx.get(f"{server.url}/v1/sessions/traj-1", headers=headers).json()
    assert session["state"] == "idle" and session["engine"] == "local" and session["problem_id"] == "task-7"
    assert [t["prompt_tokens"] for t in session["turns"]] == [3, 9, 15]
    assert [t["policy_version"] for t in session["turns"]] == [0, 0, 0]
    assert session["output_tokens"] == 15 and session["context_tokens"] == 20 and session["moves"] == 0

    metrics = scrape(server, headers)
    assert metrics["das_session_open"] == 1 and metrics["das_session_turns_total"] == 3
    assert metrics["das_session_moves_total{'reason': 'overload'}"] == 0
    assert metrics["das_session_context_tokens"] == 20
    assert metrics["das_engine_prompt_tokens_cached_total{'engine': 'local'}"] == 0  # the series exists

    ended = httpx.delete(f"{server.url}/v1/sessions/traj-1", headers=headers).json()
    assert ended["state"] == "closed" and len(ended["turns"]) == 3
    assert httpx.get(f"{server.url}/v1/sessions/traj-1", headers=headers).status_code == 404
    metrics = scrape(server, headers)
    assert metrics["das_session_open"] == 0 and metrics["das_session_ended_total{'reason': 'closed'}"] == 1
    assert metrics["das_session_makespan_seconds_count"] == 1 and metrics["das_session_trajectory_turns_sum"] == 3


def test_a_session_without_problem_id_keeps_its_first_turns_problem(session_serve):
    _, client, _ = session_serve(stub_backend(tokens=2))
    first = client.completions.create(model="das", prompt=[5, 6], max_tokens=2, extra_body={"session_id": "s"})
    second = client.completions.create(model="das", prompt=[5, 6, 3, 10, 9], max_tokens=2,
                                       extra_body={"session_id": "s"})
    assert first.das["problem_id"].startswith("sha256:") and second.das["problem_id"] == first.das["problem_id"]


def test_chat_takes_the_context_as_prompt_token_ids(session_serve):
    backend = stub_backend(tokens=3)
    _, client, _ = session_serve(backend)
    out = client.chat.completions.create(model="das", messages=[], max_completion_tokens=3,
                                         extra_body={"prompt_token_ids": [7, 8, 9], "session_id": "c",
                                                     "return_token_ids": True})
    assert out.prompt_token_ids == [7, 8, 9] and out.choices[0].token_ids == sample_tokens(backend.received[0][0], 0, 3)
    assert backend.received[0][0].prompt_token_ids == (7, 8, 9) and backend.received[0][0].messages is None
    with pytest.raises(openai.BadRequestError) as both:
        client.chat.completions.create(model="das", messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"prompt_token_ids": [1]})
    assert both.value.body["param"] == "prompt_token_ids"


def test_refused_turns_change_nothing(session_serve):
    backend = stub_backend(tokens=2, first_sample_s=0.5)
    server, client, headers = session_serve(backend)
    with pytest.raises(openai.BadRequestError) as many:
        client.completions.create(model="das", prompt=[1], n=2, extra_body={"session_id": "s"})
    assert "n must be 1" in many.value.body["message"]
    client.completions.create(model="das", prompt=[1], max_tokens=2,
                              extra_body={"session_id": "s", "problem_id": "p"})
    with pytest.raises(openai.BadRequestError) as other:
        client.completions.create(model="das", prompt=[1], extra_body={"session_id": "s", "problem_id": "q"})
    assert other.value.body["param"] == "session_id" and "belongs to problem 'p'" in other.value.body["message"]

    # a second turn while the first runs: 409, and the running one is unharmed
    results: list[Any] = []
    running = threading.Thread(target=lambda: results.append(client.completions.create(
        model="das", prompt=[1, 2], max_tokens=2, extra_body={"session_id": "s"})))
    running.start()
    deadline = time.monotonic() + 5
    while httpx.get(f"{server.url}/v1/sessions/s", headers=headers).json()["state"] != "running":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(openai.ConflictError):
        client.completions.create(model="das", prompt=[1, 2], extra_body={"session_id": "s"})
    running.join(10)
    assert len(results) == 1 and len(results[0].choices) == 1
    assert len(httpx.get(f"{server.url}/v1/sessions/s", headers=headers).json()["turns"]) == 2


def test_deleting_a_session_aborts_its_running_turn(session_serve):
    backend = stub_backend(tokens=2, first_sample_s=30)
    server, client, headers = session_serve(backend)
    errors: list[Exception] = []

    def turn() -> None:
        try:
            client.completions.create(model="das", prompt=[1, 2], extra_body={"session_id": "s"})
        except Exception as exc:
            errors.append(exc)

    running = threading.Thread(target=turn)
    running.start()
    deadline = time.monotonic() + 5
    while httpx.get(f"{server.url}/v1/sessions/s", headers=headers).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    ended = httpx.delete(f"{server.url}/v1/sessions/s", headers=headers).json()
    assert ended["state"] == "aborted" and ended["turns"] == []
    running.join(10)
    assert not running.is_alive()  # answered at once, not after the stub's 30 s
    assert isinstance(errors[0], openai.APIStatusError) and errors[0].status_code == 503
    metrics = scrape(server, headers)
    assert metrics["das_batches_total{'status': 'aborted'}"] == 1
    assert metrics["das_session_ended_total{'reason': 'aborted'}"] == 1 and metrics["das_session_open"] == 0


def test_idle_sessions_expire(session_serve):
    server, client, headers = session_serve(stub_backend(tokens=2), sessions=SessionConfig(idle_expiry_s=0.2))
    client.completions.create(model="das", prompt=[1], max_tokens=2, extra_body={"session_id": "s"})
    assert httpx.get(f"{server.url}/v1/sessions/s", headers=headers).status_code == 200
    time.sleep(0.3)
    assert httpx.get(f"{server.url}/v1/sessions/s", headers=headers).status_code == 404
    assert scrape(server, headers)["das_session_ended_total{'reason': 'expired'}"] == 1


def test_deleting_a_session_aborts_only_its_group_of_a_batch_of_many(session_serve):
    """A batch of two groups, one a session's turn: DELETE /v1/sessions/{id} stops that group on the engine (no more
    tokens for it) and ends its sample "abort"; the other group completes with all its samples."""
    engine = StubEngine(StubEngineConfig(tokens=40, token_s=0.02))
    server, _, headers = session_serve(EngineBackend(engine))  # type: ignore[arg-type]
    body = {"groups": [{"problem_id": "other", "prompt_token_ids": [1, 2], "n": 2, "sampling": {"max_tokens": 40}},
                       {"problem_id": "turn", "session_id": "s", "prompt_token_ids": [3],
                        "sampling": {"max_tokens": 40}}]}
    records: list[dict[str, Any]] = []
    reader = threading.Thread(target=lambda: records.extend(read_ndjson(
        httpx.post(f"{server.url}/v1/rollouts", json=body, headers=headers, timeout=10))))
    reader.start()
    deadline = time.monotonic() + 5
    while engine.tokens_made["turn"] < 3:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    ended = httpx.delete(f"{server.url}/v1/sessions/s", headers=headers).json()
    assert ended["state"] == "aborted"
    time.sleep(0.1)
    at_abort = engine.tokens_made["turn"]
    reader.join(10)
    assert not reader.is_alive()
    *samples, summary = records
    assert summary["summary"]["status"] == "done"
    other = sorted((r["sample_index"], r["finish_reason"], len(r["output_token_ids"]))
                   for r in samples if r["group_index"] == 0)
    assert other == [(0, "length", 40), (1, "length", 40)]
    assert [(r["finish_reason"], r["output_token_ids"]) for r in samples if r["group_index"] == 1] == [("abort", [])]
    assert engine.tokens_made["turn"] == at_abort < 40 and engine.tokens_made["other"] == 80
    assert httpx.get(f"{server.url}/v1/sessions/s", headers=headers).status_code == 404
    assert scrape(server, headers)["das_session_ended_total{'reason': 'aborted'}"] == 1
