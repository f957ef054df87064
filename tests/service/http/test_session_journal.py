"""Sessions across a gateway restart with a state directory (service/http/session_journal.py): a session opened and
run 2 turns continues after the restart (same session, turn 3 counted on, its context continued); torn or corrupt
journal records are skipped and counted, not fatal; without a state directory sessions are forgotten."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx
import openai

from das.service.config import BatchJournalConfig
from das.service.http.gateway import create_app
from das.service.http.session_journal import SESSION_FILE, SessionJournal
from das.service.config import SessionJournalConfig
from tests.service.live_gateway import LiveServer, gateway_settings
from tests.service.stub_backend import sample_tokens, stub_backend

TOKEN = "journal-token"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}


def run_turns(state_dir: Path | None, context: list[int], turns: int) -> tuple[list[int], dict[str, Any]]:
    """A fresh gateway (stub engine) on `state_dir`: `turns` turns of session "traj" from `context`; returns the
    context for the next turn and GET /v1/sessions/traj. The server is stopped (its lifespan ends) on return."""
    journal = BatchJournalConfig(state_dir=state_dir, fsync=False) if state_dir is not None else None
    backend = stub_backend(tokens=5)
    with LiveServer(create_app(backend, gateway_settings(token=TOKEN, batch_journal=journal))) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=TOKEN, max_retries=0, timeout=10)
        for turn in range(turns):
            out = client.completions.create(model="das", prompt=context, max_tokens=5,
                                            extra_body={"session_id": "traj", "problem_id": "task",
                                                        "return_token_ids": True})
            (choice,) = out.choices
            assert choice.prompt_token_ids == context
            assert choice.token_ids == sample_tokens(backend.received[-1][0], 0, 5)
            context = [*context, *choice.token_ids, 100 + turn]
        return context, httpx.get(f"{server.url}/v1/sessions/traj", headers=HEADERS).json()


def test_a_session_continues_after_a_restart_on_the_same_state_dir(tmp_path: Path) -> None:
    context, before = run_turns(tmp_path, [1, 2, 3], 2)
    assert len(before["turns"]) == 2
    context, after = run_turns(tmp_path, context, 1)  # a new gateway process on the same directory
    assert after["session_id"] == "traj" and after["problem_id"] == "task" and after["state"] == "idle"
    assert [t["index"] for t in after["turns"]] == [0, 1, 2]
    assert [t["prompt_tokens"] for t in after["turns"]] == [3, 9, 15]  # turn 3 carries the whole context on
    assert after["turns"][:2] == before["turns"]  # policy versions, engines, spans as they were
    assert after["output_tokens"] == 15 and after["context_tokens"] == 20 and after["engine"] == "local"


def test_without_a_state_dir_a_restart_forgets_the_session() -> None:
    context, _ = run_turns(None, [1, 2, 3], 2)
    _, after = run_turns(None, context, 1)
    assert [t["index"] for t in after["turns"]] == [0]  # a new session of the same id


def test_a_closed_session_stays_closed_after_a_restart(tmp_path: Path) -> None:
    journal = BatchJournalConfig(state_dir=tmp_path, fsync=False)
    run_turns(tmp_path, [1], 1)
    with LiveServer(create_app(stub_backend(), gateway_settings(token=TOKEN, batch_journal=journal))) as server:
        assert httpx.delete(f"{server.url}/v1/sessions/traj", headers=HEADERS).json()["state"] == "closed"
    with LiveServer(create_app(stub_backend(), gateway_settings(token=TOKEN, batch_journal=journal))) as server:
        assert httpx.get(f"{server.url}/v1/sessions/traj", headers=HEADERS).status_code == 404


def test_torn_and_corrupt_records_are_skipped_and_counted(tmp_path: Path, caplog: Any) -> None:
    context, _ = run_turns(tmp_path, [1, 2, 3], 2)
    path = tmp_path / SESSION_FILE
    good = path.read_bytes().splitlines(keepends=True)
    assert len(good) == 2
    flipped = good[0].replace(b'"problem":"task"', b'"problem":"tusk"')  # its checksum no longer holds
    path.write_bytes(flipped + good[1] + b"not a record\n" + good[1][:25])  # + a line of junk and a torn tail
    with caplog.at_level(logging.WARNING):
        journal = SessionJournal(SessionJournalConfig(state_dir=tmp_path, fsync=False))
    assert journal.skipped_records == 3
    assert sum("skipped record" in r.getMessage() for r in caplog.records) == 3
    (session,) = journal.restored(lambda: 0.0)
    assert session.session_id == "traj" and len(session.turns) == 1 and session.turns[0].prompt_tokens == 9
    # the start rewrote the file as what checked out: a gateway on it runs the session's next turn
    assert path.read_bytes().count(b"\n") == 1
    _, after = run_turns(tmp_path, context, 1)
    assert [t["prompt_tokens"] for t in after["turns"]] == [9, 15]


def test_skipped_records_are_exported(tmp_path: Path) -> None:
    (tmp_path / SESSION_FILE).write_bytes(b"00000000 {}\n")
    journal = BatchJournalConfig(state_dir=tmp_path, fsync=False)
    with LiveServer(create_app(stub_backend(), gateway_settings(token=TOKEN, batch_journal=journal))) as server:
        text = httpx.get(f"{server.url}/metrics", headers=HEADERS).text
    assert "das_session_journal_skipped_records_total 1.0" in text
    assert "das_session_journal_write_failures_total 0.0" in text
