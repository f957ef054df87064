"""Sessions: the turns of one agent trajectory, and where they run (vLLM-free, Ray-free).

A request (a group of the batch API, or an OpenAI-compatible request with `session_id` in its body) that names a
session is one turn of that trajectory. `SessionBook` keeps, per open session, what placement and the trainer need:

- Stickiness. The engine that ran the session's latest turn holds its prefix in vLLM's prefix cache, so the next
  turn goes there (`engine_for`) while that engine serves and is not overloaded. A turn is moved only when that
  engine is not serving (it died, or is draining or recovering) or is overloaded, and every move is counted by its
  reason (`MoveReason`). A moved turn's prompt is prefilled in full on its new engine: the client always sends the
  whole context (token ids in), so nothing else has to move.
- Length-aware placement. Between turns (a tool running, the trainer thinking) an idle session still owes work to
  its engine: `reserved(engine)` is the predicted remaining output tokens of the idle sessions placed there, which
  the coordinator adds to the engine's placed work, so new sessions go elsewhere and long trajectories are spread.
  A session's remaining tokens are its problem's mean trajectory output (over the sessions of that problem that
  closed) minus what it produced so far, at least one more turn of its own mean turn length; nothing before its
  first turn finished (that turn's own forecast is in the placed work).
- Trajectory-level forecasts. The straggler of an agentic batch is its longest trajectory, so the draft budget of
  a turn plans with the trajectory's remaining tokens, not the turn's (`trajectory_curve`).
- Lifecycle. A turn runs one at a time per session (a second one while the first runs is refused); each turn keeps
  its policy version and spans (a turn that crossed a weight update under /pause?mode=keep); `close` ends a session
  (an abort: the gateway then aborts the turn still running, freeing its engine's work); a session idle for
  `idle_expiry_s` expires; and the open sessions are bounded by `max_open_sessions` and by their summed context
  tokens (`max_context_tokens`, the prefix-cache demand the ledger stands for): beyond either, the least recently
  active idle sessions are evicted. Every close is counted by why (`CloseReason`) and observed by the `on_close`
  hook (the gateway's metrics: the trajectory's makespan, first turn's start to last turn's end, tool time included).

The book holds no tokens: a turn's prompt is the client's (token ids in, `return_token_ids` out), so a session
costs a few hundred bytes whatever its context length. The book is in memory; with a state directory the gateway
journals its turns and closes (service/http/session_journal.py) and `restore`s the open sessions at a restart.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal


from das.service.config import SessionConfig
from das.service.wire.api import LengthCurveSpec
from das.service.wire.sessions import SessionState, SessionSummary, TurnSummary

MoveReason = Literal["not_serving", "overload"]
MOVE_REASONS: tuple[MoveReason, ...] = ("not_serving", "overload")
CloseReason = Literal["closed", "aborted", "expired", "evicted"]
CLOSE_REASONS: tuple[CloseReason, ...] = ("closed", "aborted", "expired", "evicted")


class SessionConflict(Exception):
    """A turn the book refuses: another turn of the session runs, or it names another problem (`status` the HTTP
    status that says so)."""

    def __init__(self, status: int, session_id: str, message: str) -> None:
        super().__init__(message)
        self.status, self.session_id = status, session_id


@dataclass
class Session:
    session_id: str
    problem_id: str
    opened_s: float
    last_active_s: float
    engine: str | None = None
    running: str | None = None  # the batch id of the turn in flight
    turn_started_s: float = 0.0
    turns: list[TurnSummary] = field(default_factory=list)
    context_tokens: int = 0
    output_tokens: int = 0
    moves: int = 0
    ended_s: float | None = None  # the latest turn's end

    def summary(self, state: SessionState | None = None) -> SessionSummary:
        """The session as the API shows it; `state` overrides idle/running (a session just closed)."""
        return SessionSummary(
            session_id=self.session_id, problem_id=self.problem_id,
            state=state or ("running" if self.running else "idle"), engine=self.engine, turns=list(self.turns),
            context_tokens=self.context_tokens, output_tokens=self.output_tokens, moves=self.moves,
            makespan_s=None if self.ended_s is None else self.ended_s - self.opened_s)


@dataclass
class _Trajectories:
    """Closed sessions of one problem: their count and summed output tokens and turns."""

    count: int = 0
    tokens: int = 0
    turns: int = 0


class SessionBook:
    """Open sessions, the placement ledger's view of them, and their counters. One per gateway; every method runs
    on the gateway's event loop (no locks). `clock`: monotonic seconds."""

    def __init__(self, config: SessionConfig | None = None,
                 on_close: Callable[[Session, CloseReason], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_turn: Callable[[Session], None] | None = None) -> None:
        self.config = config or SessionConfig()
        self._on_close = on_close
        self._on_turn = on_turn  # hears every finished turn (the session journal, service/http/session_journal.py)
        self._clock = clock
        self._open: OrderedDict[str, Session] = OrderedDict()  # least recently active first
        self._by_batch: dict[str, list[str]] = {}  # batch id -> sessions with a turn in it
        self._context_tokens = 0
        self._trajectories: dict[str, _Trajectories] = {}
        self._by_problem: dict[str, set[str]] = {}  # problem -> its open sessions
        # The reservation ledger, kept incrementally (placement reads it per batch): per engine the sum of its idle
        # sessions' predicted remaining tokens, and what each session adds to it now.
        self._reserved: Counter[str] = Counter()
        self._reserves: dict[str, tuple[str, float]] = {}
        self.turns = 0
        self.moves: Counter[str] = Counter({reason: 0 for reason in MOVE_REASONS})
        self.closed: Counter[str] = Counter({reason: 0 for reason in CLOSE_REASONS})

    # ---- figures ----

    @property
    def open_sessions(self) -> int:
        return len(self._open)

    @property
    def context_tokens(self) -> int:
        """Summed context tokens of the open sessions (what `max_context_tokens` bounds)."""
        return self._context_tokens

    def get(self, session_id: str) -> Session | None:
        return self._open.get(session_id)

    def sessions_of(self, batch_id: str) -> list[str]:
        return list(self._by_batch.get(batch_id, ()))

    # ---- turns ----

    def begin(self, batch_id: str, turns: Sequence[tuple[str, str]]) -> None:
        """Opens or resumes each (session_id, problem_id) for a turn in batch `batch_id`. All or nothing:
        SessionConflict (and nothing changed) if a session appears twice, runs a turn already, or named another
        problem before."""
        self.expire()
        seen: set[str] = set()
        for session_id, problem_id in turns:
            if session_id in seen:
                raise SessionConflict(422, session_id, f"session {session_id!r}: two turns in one batch (a "
                                                       f"session runs one turn at a time)")
            seen.add(session_id)
            session = self._open.get(session_id)
            if session is None:
                continue
            if session.problem_id != problem_id:
                raise SessionConflict(422, session_id, f"session {session_id!r} belongs to problem "
                                                       f"{session.problem_id!r}, not {problem_id!r}")
            if session.running is not None:
                raise SessionConflict(409, session_id, f"session {session_id!r} is running a turn (batch "
                                                       f"{session.running}); a session runs one turn at a time")
        now = self._clock()
        for session_id, problem_id in turns:
            session = self._open.get(session_id)
            if session is None:
                session = self._open[session_id] = Session(session_id, problem_id, now, now)
                self._by_problem.setdefault(problem_id, set()).add(session_id)
            session.running, session.turn_started_s, session.last_active_s = batch_id, now, now
            self._open.move_to_end(session_id)
            self._reserve(session)
        self._by_batch[batch_id] = [session_id for session_id, _ in turns]
        self._bound()

    def finished(self, batch_id: str, session_id: str, *, engine: str | None, prompt_tokens: int,
                 output_tokens: int, finish_reason: str, policy_version: int,
                 policy_spans: Sequence[tuple[int, int]] | None) -> None:
        """The turn of `session_id` in `batch_id` delivered its sample (its only one: a session's turn has n = 1)."""
        session = self._open.get(session_id)
        if session is None or session.running != batch_id:
            return  # closed meanwhile: an abort raced the sample
        now = self._clock()
        session.turns.append(TurnSummary(
            index=len(session.turns), batch_id=batch_id, engine=engine, prompt_tokens=prompt_tokens,
            output_tokens=output_tokens, finish_reason=finish_reason, policy_version=policy_version,
            policy_spans=list(policy_spans) if policy_spans else None, seconds=now - session.turn_started_s))
        self._context_tokens += prompt_tokens + output_tokens - session.context_tokens
        session.context_tokens = prompt_tokens + output_tokens
        session.output_tokens += output_tokens
        session.engine = engine or session.engine
        session.running, session.last_active_s, session.ended_s = None, now, now
        self._open.move_to_end(session_id)
        self._reserve(session)
        self.turns += 1
        if self._on_turn is not None:
            self._on_turn(session)
        self._bound()

    def restore(self, sessions: Iterable[Session]) -> None:
        """Re-opens, idle, the sessions an earlier run of the gateway had open (service/http/session_journal.py),
        their times on this book's clock; expiry and the bounds apply at once (closing what they must, counted)."""
        for session in sorted(sessions, key=lambda s: s.last_active_s):
            if session.session_id in self._open:
                continue
            session.running = None
            self._open[session.session_id] = session
            self._by_problem.setdefault(session.problem_id, set()).add(session.session_id)
            self._context_tokens += session.context_tokens
            self._reserve(session)
        self.expire()
        self._bound()

    def open(self) -> list[Session]:
        """The open sessions, least recently active first."""
        return list(self._open.values())

    def batch_ended(self, batch_id: str) -> None:
        """Batch `batch_id` ended: a turn in it that delivered nothing (failed, aborted) leaves its session idle."""
        for session_id in self._by_batch.pop(batch_id, ()):
            session = self._open.get(session_id)
            if session is not None and session.running == batch_id:
                session.running = None
                session.last_active_s = self._clock()
                self._open.move_to_end(session_id)
                self._reserve(session)

    def close(self, session_id: str, reason: CloseReason = "closed") -> Session | None:
        """Ends an open session (None if none is open by that id); its turn still running is the caller's to
        abort (`Session.running`)."""
        session = self._open.pop(session_id, None)
        if session is None:
            return None
        self._context_tokens -= session.context_tokens
        self._reserve(session)
        siblings = self._by_problem[session.problem_id]
        siblings.discard(session_id)
        if not siblings:
            del self._by_problem[session.problem_id]
        if session.turns:
            past = self._trajectories.setdefault(session.problem_id, _Trajectories())
            past.count += 1
            past.tokens += session.output_tokens
            past.turns += len(session.turns)
            for sibling in siblings:  # the problem's forecast changed: so did its idle sessions' reservations
                self._reserve(self._open[sibling])
        self.closed[reason] += 1
        if self._on_close is not None:
            self._on_close(session, reason)
        return session

    def expire(self) -> list[Session]:
        """Closes the idle sessions without a turn for `idle_expiry_s`. The open sessions are kept in order of
        their last activity, so this reads only the expired ones and the running ones older than the cutoff."""
        cutoff = self._clock() - self.config.idle_expiry_s
        stale = []
        for session in self._open.values():
            if session.last_active_s > cutoff:
                break
            if session.running is None:
                stale.append(session.session_id)
        return [s for sid in stale if (s := self.close(sid, "expired")) is not None]

    def _bound(self) -> None:
        """Evicts the least recently active idle sessions while over either bound (running ones stay)."""
        over = (lambda: len(self._open) > self.config.max_open_sessions
                or self._context_tokens > self.config.max_context_tokens)
        if not over():
            return
        for session_id in [s.session_id for s in self._open.values() if s.running is None]:
            self.close(session_id, "evicted")
            if not over():
                return

    # ---- placement (the coordinator's ledger reads these) ----

    def engine_for(self, session_id: str, names: Sequence[str], loads: Sequence[float]) -> int | None:
        """The index in `names` (the serving engines) of the engine the session's next turn should run on, or None
        to place it freely: a new session, or one whose engine is not serving or is overloaded (`loads`: each
        serving engine's placed work, tokens). A move is counted here, once per turn placed."""
        session = self._open.get(session_id)
        if session is None or session.engine is None:
            return None
        if session.engine not in names:
            self._moved(session, "not_serving")
            return None
        index = names.index(session.engine)
        mean = sum(loads) / len(loads)
        if loads[index] > self.config.overload_ratio * mean + self.config.overload_slack_tokens:
            self._moved(session, "overload")
            return None
        return index

    def placed(self, session_id: str, engine: str) -> None:
        """The session's turn was placed on `engine`, which now holds (or will hold) its prefix."""
        session = self._open.get(session_id)
        if session is not None:
            session.engine = engine
            self._reserve(session)

    def _moved(self, session: Session, reason: MoveReason) -> None:
        session.moves += 1
        session.engine = None
        self.moves[reason] += 1
        self._reserve(session)

    def _reserve(self, session: Session) -> None:
        """Brings the session's part of the reservation ledger up to date (none once closed or while running)."""
        old = self._reserves.pop(session.session_id, None)
        if old is not None:
            self._reserved[old[0]] -= old[1]
            if self._reserved[old[0]] <= 1e-9:
                del self._reserved[old[0]]
        if self._open.get(session.session_id) is session and session.running is None and session.engine:
            tokens = self.predicted_remaining(session)
            if tokens > 0:
                self._reserves[session.session_id] = (session.engine, tokens)
                self._reserved[session.engine] += tokens

    def predicted_remaining(self, session: Session) -> float:
        """Predicted output tokens of the session's turns still to come (see the module docstring)."""
        if not session.turns:
            return 0.0
        per_turn = session.output_tokens / len(session.turns)
        past = self._trajectories.get(session.problem_id)
        if past is None or past.count == 0:
            return per_turn
        return max(past.tokens / past.count - session.output_tokens, per_turn)

    def reserved(self) -> Counter[str]:
        """Per engine, the predicted remaining output tokens of the idle sessions whose prefix it holds (running
        sessions' current turns are in the placed work already). Kept as sessions change: O(engines) to read."""
        return Counter(self._reserved)

    def trajectory_curve(self, session_id: str, curve: LengthCurveSpec | None,
                         turn_tokens: float) -> LengthCurveSpec | None:
        """The trajectory-level forecast for the draft budget of a turn predicted at `turn_tokens` output tokens:
        its per-turn `curve` with every final length raised by the tokens the trajectory is predicted to produce in
        its later turns (its problem's mean trajectory output over closed sessions, less what it produced so far
        and this turn), so the budget drafts for the longest trajectories in every turn, not only in their longest
        turn. The curve as given before any trajectory of the problem closed, or when none is left to come. The
        tail beyond the curve's held lengths is the per-turn one."""
        session = self._open.get(session_id)
        past = self._trajectories.get(session.problem_id) if session is not None else None
        if curve is None or session is None or past is None or past.count == 0:
            return curve
        later = past.tokens / past.count - session.output_tokens - turn_tokens
        if later <= 0:
            return curve
        return curve.model_copy(update={"ends": tuple(end + later for end in curve.ends)})

    def predicted_turns(self, problem_id: str) -> float | None:
        """Mean turns of the problem's closed trajectories; None before one closed."""
        past = self._trajectories.get(problem_id)
        return past.turns / past.count if past and past.count else None
