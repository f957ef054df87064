"""Sessions through engine failures and aborts on the Ray service (two stub engine actors on one node, the real
gateway and coordinator in a child process, the official `openai` client): the engine holding a session's prefix
is killed mid-turn, the turn re-runs on the other engine (counted as a move), the trajectory completes and nothing
is duplicated; then a session's abort frees its engine's work."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from das.service.wire.sample_keys import derive
from tests.service.cluster.stub_service import STUB_VOCAB, StubService, wait_until

TOKENS = 40  # a turn takes TOKENS * token_s = 2 s on the stub


def restarts(service: StubService) -> dict[str, float]:
    text = service.get("/metrics").text
    return {m[0]: float(m[1]) for m in re.findall(r'^das_engine_restarts_total\{engine="([^"]+)"\} (\S+)$', text,
                                                   re.MULTILINE)}


def session(service: StubService, session_id: str) -> dict[str, Any]:
    return service.get(f"/v1/sessions/{session_id}").json()


def test_a_session_survives_its_engines_death_and_an_abort_frees_its_engines_work(tmp_path: Path) -> None:
    service = StubService(tmp_path, {"engine": {"kind": "stub", "tokens": TOKENS, "token_s": 0.05}, "engines_per_node": 2,
                                     "failure": {"max_restarts": 10}})
    try:
        service.wait_ready(engines=2)
        # Which process holds which engine: kill one while idle and see whose restart is counted.
        before = set(service.node_engines())
        first = sorted(before)[0]
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: sum(restarts(service).values()) == 1 and service.metric("das_engines_ready") == 2, 60,
                   "no recovery after the mapping kill")
        (restarted,) = [name for name, count in restarts(service).items() if count == 1]
        (new_pid,) = set(service.node_engines()) - before
        (other_pid,) = before - {first}
        pid_of = {restarted: new_pid}

        client = openai.OpenAI(base_url=f"{service.url}/v1", api_key="-", max_retries=0, timeout=120)
        request = {"model": "das", "max_tokens": TOKENS, "seed": 5,
                   "extra_body": {"session_id": "agent", "problem_id": "task", "return_token_ids": True}}
        context = [5, 6, 7]
        reply = client.completions.create(prompt=context, **request)
        holder = session(service, "agent")["engine"]
        pid_of.setdefault(holder, other_pid)
        context = [*context, *reply.choices[0].token_ids, 9]

        replies: list[Any] = []
        turn = threading.Thread(target=lambda: replies.append(client.completions.create(prompt=context, **request)))
        turn.start()
        wait_until(lambda: session(service, "agent")["state"] == "running", 10, "turn 2 did not start")
        time.sleep(0.5)  # a quarter of the turn's tokens drawn
        os.kill(pid_of[holder], signal.SIGKILL)
        turn.join(60)
        assert not turn.is_alive() and len(replies) == 1
        (choice,) = replies[0].choices
        # the same draw as before the death (keyed sampling), delivered once
        key = derive(5, 0)
        assert choice.token_ids == [(7 * p + key) % STUB_VOCAB for p in range(TOKENS)]
        assert choice.prompt_token_ids == context
        state = session(service, "agent")
        assert len(state["turns"]) == 2 and state["moves"] == 1
        assert state["turns"][0]["engine"] == holder and state["turns"][1]["engine"] != holder
        assert service.metric("das_session_moves") == 1 and service.metric("das_samples_served") == 2

        # a third turn stays on the engine that now holds the prefix
        context = [*context, *choice.token_ids, 9]
        client.completions.create(prompt=context, **request)
        state = session(service, "agent")
        assert state["turns"][2]["engine"] == state["turns"][1]["engine"] and state["moves"] == 1

        # an abort mid-turn frees the engine's work
        wait_until(lambda: service.metric("das_engines_ready") == 2, 60, "the killed engine did not come back")
        errors: list[Exception] = []

        def fourth() -> None:
            try:
                client.completions.create(prompt=[*context, 9], **request)
            except Exception as exc:  # noqa: BLE001 -- checked below
                errors.append(exc)

        turn = threading.Thread(target=fourth)
        turn.start()
        wait_until(lambda: service.metric("das_engine_placed_tokens") > 0, 10, "turn 4 was not placed")
        ended = httpx.delete(f"{service.url}/v1/sessions/agent", timeout=10).json()
        assert ended["state"] == "aborted" and len(ended["turns"]) == 3
        turn.join(10)
        assert not turn.is_alive() and isinstance(errors[0], openai.APIStatusError)
        assert service.metric("das_engine_placed_tokens") == 0
        wait_until(lambda: service.metric("das_engine_requests_running") == 0, 10, "the engine still runs it")
        assert service.metric("das_session_open") == 0
    finally:
        service.stop()
