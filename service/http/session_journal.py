"""`SessionJournal`: the open agent sessions (service/cluster/sessions.py) kept across a restart of the gateway, so a
trajectory's next turn after the restart continues its session (same id, turns counted on, its engine preferred)
instead of silently opening a new one. On with a state directory (`das serve --state-dir`, beside the batch journal);
without one, sessions live in the gateway's memory only and a restart forgets them.

One file, `<state_dir>/session-journal.jsonl`, one record a line in the batch journal's form (`<crc32 of the JSON,
8 hex> <JSON>`): a `turn` record when a session's turn finished (session id, problem, the turn's `TurnSummary` with
its policy version and spans, and the session's engine, moves, context and output tokens, wall-clock times after
it), a `close` record when it ended (closed, aborted, expired, evicted). What a session needs to continue is all
there: its token context is the client's (it sends the whole context every turn, token ids in), so no tokens are
kept, only their counts (what `SessionConfig.max_context_tokens` bounds). A turn running at the restart is not
counted (it never finished); the session is restored idle.

Off the hot path: records are queued on the event loop and written (and fsynced) by a worker thread at most every
`flush_s`; a crash loses at most the last `flush_s` of turns. Reading at start, any record that is cut short or
fails its checksum or shape is skipped and counted (`skipped_records`, logged as a warning): a torn last write
never stops the gateway. Bounded: when the file passes `max_bytes` (or twice its size after the last rewrite, when
the open sessions alone fill it) it is rewritten as the open sessions' records only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from pydantic import ValidationError

from das.service.cluster.sessions import Session
from das.service.config import SessionJournalConfig
from das.service.http.checksummed_lines import decode_line, encode_line, replace_file
from das.service.wire.sessions import TurnSummary

log = logging.getLogger(__name__)

SESSION_FILE = "session-journal.jsonl"


def _turn_record(session: Session, turn: TurnSummary, opened_s: float, last_s: float) -> bytes:
    """One turn of `session` as a record line, its open and last-active times (wall clock, seconds) given."""
    return encode_line({"op": "turn", "id": session.session_id, "problem": session.problem_id, "opened": opened_s,
                        "turn": turn.model_dump(mode="json"), "engine": session.engine, "moves": session.moves,
                        "context": session.context_tokens, "output": session.output_tokens, "last": last_s})


def _parse(line: bytes) -> dict[str, Any]:
    """A record line (without its newline) checked; ValueError if its checksum, JSON or shape is wrong."""
    record = decode_line(line)
    if not isinstance(record.get("id"), str):
        raise ValueError("not a session record")
    if record.get("op") == "turn":
        if not isinstance(record.get("problem"), str) or not isinstance(record.get("opened"), (int, float)):
            raise ValueError("problem or opened")
        record["turn"] = TurnSummary.model_validate(record.get("turn"))
        if not all(type(record.get(k)) is int for k in ("moves", "context", "output")):
            raise ValueError("moves, context or output")
        if not isinstance(record.get("last"), (int, float)):
            raise ValueError("last")
    elif record.get("op") != "close":
        raise ValueError(f"op {record.get('op')!r}")
    return record


class SessionJournal:
    """The session journal of one state directory; see the module docstring. `record_turn` and `closed` are called
    on the gateway's event loop; `open_sessions` (the book's open sessions, for a rewrite) too."""

    def __init__(self, config: SessionJournalConfig) -> None:
        self.config = config
        self.path = config.state_dir / SESSION_FILE
        self.skipped_records = 0
        self.write_failures = 0
        self.open_sessions: Callable[[], Iterable[Session]] = lambda: ()
        self._pending: list[bytes] = []
        self._flusher: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        config.state_dir.mkdir(parents=True, exist_ok=True)
        self._restored = self._load()
        self._size = 0
        self._rewrite_at = config.max_bytes
        self._rewrite(b"".join(self._session_lines(s) for s in self._restored))

    # ---- start ----

    def restored(self, clock: Callable[[], float]) -> list[Session]:
        """The sessions open at the end of the earlier run, idle, their times on `clock` (the book's monotonic
        seconds: a session idle since before the restart has been idle that long)."""
        offset = clock() - time.time()
        out = []
        for session in self._restored:
            session.opened_s += offset
            session.last_active_s += offset
            session.ended_s = None if session.ended_s is None else session.ended_s + offset
            out.append(session)
        self._restored = []
        return out

    def _load(self) -> list[Session]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return []
        sessions: dict[str, Session] = {}
        for number, line in enumerate(data.split(b"\n"), 1):
            if not line:
                continue
            try:
                record = _parse(line)
            except (ValueError, ValidationError) as exc:
                self.skipped_records += 1
                log.warning("session journal %s: skipped record %d (%s)", self.path, number,
                            str(exc).splitlines()[0])
                continue
            session_id = record["id"]
            if record["op"] == "close":
                sessions.pop(session_id, None)
                continue
            session = sessions.get(session_id)
            if session is None or session.problem_id != record["problem"]:
                session = sessions[session_id] = Session(session_id, record["problem"], float(record["opened"]),
                                                         float(record["last"]))
            turn: TurnSummary = record["turn"]
            session.turns.append(turn.model_copy(update={"index": len(session.turns)}))
            session.engine = record.get("engine")
            session.moves, session.context_tokens = record["moves"], record["context"]
            session.output_tokens = record["output"]
            session.last_active_s = session.ended_s = float(record["last"])
        return list(sessions.values())

    # ---- the book's changes ----

    def record_turn(self, session: Session) -> None:
        """The session's latest turn finished: queued for the writer."""
        self._queue(self._turn_line(session, session.turns[-1]))

    def closed(self, session: Session) -> None:
        """The session ended: queued for the writer."""
        self._queue(encode_line({"op": "close", "id": session.session_id}))

    def _turn_line(self, session: Session, turn: TurnSummary) -> bytes:
        wall = time.time() - time.monotonic()  # the book's clock is monotonic; the file's is the wall clock
        last = session.last_active_s if session.ended_s is None else session.ended_s
        return _turn_record(session, turn, session.opened_s + wall, last + wall)

    def _session_lines(self, session: Session) -> bytes:
        """A restored session (times already wall-clock) as turn records."""
        return b"".join(_turn_record(session, turn, session.opened_s, session.last_active_s)
                        for turn in session.turns)

    def _queue(self, line: bytes) -> None:
        self._pending.append(line)
        self._start_flush()

    def _start_flush(self) -> None:
        if self._flusher is not None or not self._pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a restored session expired as the gateway was built: written with the next flush
            return
        self._flusher = loop.create_task(self._flush(), name="session-journal")

    async def _flush(self) -> None:
        """Writes what is queued, `flush_s` after the first record (at once once woken by `aclose`)."""
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.flush_s)
            while self._pending:
                lines, self._pending = b"".join(self._pending), []
                if self._size + len(lines) > self._rewrite_at:
                    # What is queued is in the book's state already: the rewrite holds it.
                    body = b"".join(self._turn_line(s, t) for s in self.open_sessions() for t in s.turns)
                    await asyncio.to_thread(self._rewrite, body)
                else:
                    await asyncio.to_thread(self._append, lines)
        finally:
            self._flusher = None

    async def aclose(self) -> None:
        """Writes what is queued (the gateway's shutdown)."""
        self._wake.set()
        self._start_flush()
        if self._flusher is not None:
            await asyncio.shield(self._flusher)

    # ---- the file (the writer thread) ----

    def _append(self, lines: bytes) -> None:
        try:
            with open(self.path, "ab") as f:
                f.write(lines)
                f.flush()
                if self.config.fsync:
                    os.fsync(f.fileno())
        except OSError as exc:
            self.write_failures += 1
            log.error("session journal %s: could not record %d bytes of session changes: %s", self.path,
                      len(lines), exc)
            return
        self._size += len(lines)

    def _rewrite(self, body: bytes) -> None:
        """Replaces the file by `body` (temporary file, fsync, rename), so appends never follow a torn line."""
        try:
            replace_file(self.path, body, self.config.fsync)
        except OSError as exc:
            self.write_failures += 1
            log.error("session journal %s: rewrite failed: %s", self.path, exc)
            return
        self._size = len(body)
        self._rewrite_at = max(self.config.max_bytes, 2 * len(body))
