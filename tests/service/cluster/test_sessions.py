"""The session book (service/cluster/sessions.py) on a fake clock, and the coordinator's placement of sessions' turns
(`Dispatcher.place` without Ray: engines are names, the ledger is the real one)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from das.service.wire.api import GroupRequest, LengthCurveSpec
from das.service.cluster.coordinator import RayBackend
from das.service.cluster.dispatch import Dispatcher, with_length_predictions
from das.service.config import ServiceConfig
from das.service.cluster.sessions import Session, SessionBook, SessionConflict
from das.service.config import SessionConfig
from das.service.engine.stub_engine import StubEngineConfig


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def finish(book: SessionBook, batch: str, session: str, *, engine: str = "e0", prompt: int = 10, output: int = 5,
           version: int = 0, spans: list[tuple[int, int]] | None = None) -> None:
    book.finished(batch, session, engine=engine, prompt_tokens=prompt, output_tokens=output, finish_reason="stop",
                  policy_version=version, policy_spans=spans)
    book.batch_ended(batch)


def test_turns_record_engines_policy_versions_tokens_and_the_makespan() -> None:
    clock = Clock()
    closed: list[tuple[Session, str]] = []
    book = SessionBook(on_close=lambda s, r: closed.append((s, r)), clock=clock)
    book.begin("b1", [("s", "p")])
    assert book.get("s").running == "b1" and book.open_sessions == 1
    clock.now += 2
    finish(book, "b1", "s", engine="e1", prompt=10, output=5, version=3)
    clock.now += 30  # a tool runs between turns
    book.begin("b2", [("s", "p")])
    clock.now += 1
    finish(book, "b2", "s", engine="e1", prompt=25, output=7, version=4, spans=[(4, 0), (5, 3)])
    summary = book.get("s").summary()
    assert summary.state == "idle" and summary.engine == "e1"
    assert [(t.index, t.batch_id, t.policy_version, t.policy_spans) for t in summary.turns] == \
        [(0, "b1", 3, None), (1, "b2", 4, [(4, 0), (5, 3)])]
    assert (summary.context_tokens, summary.output_tokens) == (32, 12)
    assert summary.makespan_s == pytest.approx(33.0)  # first turn's start to last turn's end, tool time included
    assert book.context_tokens == 32 and book.turns == 2
    book.close("s")
    assert closed[0][1] == "closed" and book.open_sessions == 0 and book.context_tokens == 0
    assert book.closed["closed"] == 1


def test_a_turn_while_one_runs_another_problem_or_a_repeat_in_a_batch_is_refused_and_nothing_changes() -> None:
    book = SessionBook(clock=Clock())
    book.begin("b1", [("s", "p")])
    with pytest.raises(SessionConflict) as busy:
        book.begin("b2", [("t", "p"), ("s", "p")])
    assert busy.value.status == 409 and busy.value.session_id == "s"
    assert book.get("t") is None  # all or nothing
    finish(book, "b1", "s")
    with pytest.raises(SessionConflict) as other:
        book.begin("b3", [("s", "q")])
    assert other.value.status == 422 and "belongs to problem 'p'" in str(other.value)
    with pytest.raises(SessionConflict) as twice:
        book.begin("b4", [("u", "p"), ("u", "p")])
    assert twice.value.status == 422 and book.get("u") is None
    book.begin("b5", [("s", "p")])  # the session itself is unharmed
    assert book.get("s").running == "b5"


def test_a_failed_turn_leaves_the_session_idle_and_a_late_sample_after_close_is_ignored() -> None:
    book = SessionBook(clock=Clock())
    book.begin("b1", [("s", "p")])
    book.batch_ended("b1")  # failed or aborted before its sample
    assert book.get("s").running is None and book.get("s").turns == []
    book.begin("b2", [("s", "p")])
    book.close("s", "aborted")
    finish(book, "b2", "s")  # the sample raced the abort
    assert book.get("s") is None and book.turns == 0 and book.closed["aborted"] == 1


def test_idle_sessions_expire_and_running_ones_do_not() -> None:
    clock = Clock()
    book = SessionBook(SessionConfig(idle_expiry_s=60), clock=clock)
    book.begin("b1", [("idle", "p"), ("busy", "p")])
    finish(book, "b1", "idle")
    book.finished("b1", "busy", engine="e0", prompt_tokens=1, output_tokens=1, finish_reason="stop",
                  policy_version=0, policy_spans=None)
    book.begin("b2", [("busy", "p")])
    clock.now += 61
    expired = book.expire()
    assert [s.session_id for s in expired] == ["idle"] and book.get("busy") is not None
    assert book.closed["expired"] == 1


def test_memory_is_bounded_by_context_tokens_and_count_evicting_the_least_recently_active_idle() -> None:
    clock = Clock()
    book = SessionBook(SessionConfig(max_context_tokens=100, max_open_sessions=3), clock=clock)
    for name in ("a", "b", "c"):
        clock.now += 1
        book.begin(f"b-{name}", [(name, "p")])
        finish(book, f"b-{name}", name, prompt=20, output=10)  # 30 context tokens each: 90
    clock.now += 1
    book.begin("b-a2", [("a", "p")])  # "a" is now the most recently active, and running
    book.finished("b-a2", "a", engine="e0", prompt_tokens=40, output_tokens=10, finish_reason="stop",
                  policy_version=0, policy_spans=None)  # 50 + 30 + 30 = 110 > 100: "b" goes
    assert book.get("b") is None and book.get("a") is not None and book.get("c") is not None
    assert book.context_tokens == 80 and book.closed["evicted"] == 1
    book.begin("b-d", [("d", "p")])
    assert book.open_sessions == 3 and book.closed["evicted"] == 1
    book.begin("b-e", [("e", "p")])  # a fourth: over the count, "c" (the least recently active idle one) goes
    assert book.get("c") is None and book.open_sessions == 3 and book.closed["evicted"] == 2


def test_stickiness_moves_only_off_an_engine_not_serving_or_overloaded() -> None:
    book = SessionBook(SessionConfig(overload_ratio=2.0, overload_slack_tokens=10), clock=Clock())
    assert book.engine_for("new", ["e0", "e1"], [0.0, 0.0]) is None  # unknown: placed freely, not a move
    book.begin("b1", [("s", "p")])
    book.placed("s", "e1")
    finish(book, "b1", "s", engine="e1")
    assert book.engine_for("s", ["e0", "e1"], [100.0, 100.0]) == 1
    assert book.engine_for("s", ["e0", "e1"], [0.0, 10.0]) == 1  # within the slack
    assert sum(book.moves.values()) == 0
    assert book.engine_for("s", ["e0", "e2"], [0.0, 0.0]) is None  # e1 died or drains
    assert book.moves["not_serving"] == 1 and book.get("s").moves == 1
    book.placed("s", "e0")
    assert book.engine_for("s", ["e0", "e1"], [500.0, 10.0]) == 0  # 500 <= 2 * 255 + 10: not overloaded
    assert book.moves["overload"] == 0


def test_overload_threshold() -> None:
    book = SessionBook(SessionConfig(overload_ratio=1.5, overload_slack_tokens=10), clock=Clock())
    book.begin("b1", [("s", "p")])
    finish(book, "b1", "s", engine="e0")
    assert book.engine_for("s", ["e0", "e1"], [100.0, 60.0]) == 0  # 100 <= 1.5 * 80 + 10
    assert book.moves["overload"] == 0
    assert book.engine_for("s", ["e0", "e1"], [200.0, 0.0]) is None  # 200 > 1.5 * 100 + 10
    assert book.moves["overload"] == 1 and book.get("s").engine is None


def test_idle_sessions_reserve_their_predicted_remaining_work_on_their_engine() -> None:
    book = SessionBook(clock=Clock())
    book.begin("b1", [("s1", "p"), ("s2", "p")])
    book.finished("b1", "s2", engine="e1", prompt_tokens=5, output_tokens=10, finish_reason="stop",
                  policy_version=0, policy_spans=None)
    finish(book, "b1", "s1", engine="e0", output=40)  # and the batch ends
    # no trajectory of p has closed: one more turn of each session's own mean
    assert book.reserved() == {"e0": 40.0, "e1": 10.0}
    book.begin("b2", [("s1", "p")])
    assert book.reserved() == {"e1": 10.0}  # a running turn is in the placed work, not reserved
    finish(book, "b2", "s1", engine="e0", output=60)
    book.close("s1")  # p's trajectories: 100 tokens over 2 turns
    assert book.predicted_turns("p") == 2.0
    assert book.reserved() == {"e1": 90.0}  # s2 produced 10 of p's mean 100


def dispatcher(book: SessionBook) -> Dispatcher:
    """A RayBackend's dispatcher that only places (no Ray, no actors): `place` over engine names."""
    coordinator = RayBackend(ServiceConfig(engine=StubEngineConfig()), [], [], [], False)
    coordinator.attach_sessions(book)
    return coordinator.dispatcher


SERVING = [(None, 0, "e0"), (None, 0, "e1")]


def turn(session: str, problem: str = "p", predicted: float = 100.0) -> GroupRequest:
    return GroupRequest(problem_id=problem, session_id=session, prompt_token_ids=[1, 2], predicted_tokens=predicted)


def engines_of(placement: list[list[tuple[int, GroupRequest]]], serving: list = SERVING) -> dict[str, str]:
    return {group.session_id: serving[e][2] for e, items in enumerate(placement) for _, group in items}


def test_a_problems_trajectories_spread_and_each_turn_returns_to_its_engine() -> None:
    book = SessionBook(clock=Clock())
    dispatch = dispatcher(book)
    first = [turn(f"s{i}") for i in range(4)]
    book.begin("b1", [(g.session_id, g.problem_id) for g in first])
    placed = engines_of(dispatch.place(first, SERVING))
    assert sorted(Counter(placed.values()).values()) == [2, 2]  # one problem's 4 trajectories over both engines
    for g in first:
        finish(book, "b1", g.session_id, engine=placed[g.session_id])
    second = [turn(f"s{i}") for i in (3, 0)]
    book.begin("b2", [(g.session_id, "p") for g in second])
    again = engines_of(dispatch.place(second, SERVING))
    assert again == {s: placed[s] for s in again}  # each to the engine holding its prefix
    assert sum(book.moves.values()) == 0


def test_a_turn_whose_engine_is_gone_is_placed_elsewhere_and_counted() -> None:
    book = SessionBook(clock=Clock())
    dispatch = dispatcher(book)
    book.begin("b1", [("s", "p")])
    (engine,) = engines_of(dispatch.place([turn("s")], SERVING)).values()
    finish(book, "b1", "s", engine=engine)
    survivor = [e for e in SERVING if e[2] != engine]
    book.begin("b2", [("s", "p")])
    assert engines_of(dispatch.place([turn("s")], survivor), survivor) == {"s": survivor[0][2]}
    assert book.moves["not_serving"] == 1 and book.get("s").engine == survivor[0][2]


def test_new_sessions_avoid_the_engine_whose_idle_sessions_owe_the_most() -> None:
    book = SessionBook(clock=Clock())
    dispatch = dispatcher(book)
    book.begin("b1", [("long", "p")])
    book.placed("long", "e0")
    finish(book, "b1", "long", engine="e0", output=5000)  # idle now; owes another long turn on e0
    book.begin("b2", [("new", "q")])
    assert engines_of(dispatch.place([turn("new", "q")], SERVING)) == {"new": "e1"}


def test_the_incremental_reservation_ledger_equals_a_recount_after_any_sequence_of_events() -> None:
    rng = random.Random(7)
    clock = Clock()
    book = SessionBook(SessionConfig(idle_expiry_s=50, max_open_sessions=12), clock=clock)
    batches = 0
    for _ in range(600):
        clock.now += rng.uniform(0, 3)
        sid, problem = f"s{rng.randrange(20)}", f"p{rng.randrange(3)}"
        session = book.get(sid)
        action = rng.random()
        if session is None or (session.running is None and action < 0.5):
            batches += 1
            try:
                book.begin(f"b{batches}", [(sid, session.problem_id if session else problem)])
            except SessionConflict:
                continue
            if rng.random() < 0.7:
                book.placed(sid, f"e{rng.randrange(3)}")
        elif session.running is not None and action < 0.8:
            batch = session.running
            if rng.random() < 0.9:
                book.finished(batch, sid, engine=session.engine or "e0", prompt_tokens=rng.randrange(1, 50),
                              output_tokens=rng.randrange(0, 80), finish_reason="stop", policy_version=0,
                              policy_spans=None)
            book.batch_ended(batch)
        elif action < 0.9:
            book.engine_for(sid, ["e0", "e1"], [rng.uniform(0, 1e5), 0.0])
        else:
            book.close(sid, rng.choice(["closed", "aborted"]))
        book.expire()
        recount: Counter[str] = Counter()
        for open_id in [f"s{i}" for i in range(20)]:
            s = book.get(open_id)
            if s is not None and s.running is None and s.engine:
                recount[s.engine] += book.predicted_remaining(s)
        got = book.reserved()
        assert set(got) == {e for e, v in recount.items() if v > 0}
        assert all(abs(got[e] - recount[e]) < 1e-6 for e in got)
    assert sum(book.closed.values()) > 10 and book.turns > 50  # the walk went through every kind of event


def test_a_turns_budget_forecast_covers_its_trajectorys_later_turns() -> None:
    book = SessionBook(clock=Clock())
    dispatch = dispatcher(book)
    curve = LengthCurveSpec(starts=(0, 50), ends=(80.0, 120.0), tail_from=200, tail_ratio=0.5)
    assert book.trajectory_curve("unknown", curve, 60.0) is curve
    for sid in ("old1", "old2"):  # the problem's closed trajectories: 1000 output tokens each
        book.begin(f"b-{sid}", [(sid, "p")])
        finish(book, f"b-{sid}", sid, output=1000)
        book.close(sid)
    book.begin("b1", [("s", "p")])
    assert book.trajectory_curve("s", curve, 60.0).ends == (80.0 + 940, 120.0 + 940)  # 1000 - 0 - 60 to come
    finish(book, "b1", "s", output=700)
    book.begin("b2", [("s", "p")])
    assert book.trajectory_curve("s", curve, 60.0).ends == (80.0 + 240, 120.0 + 240)
    assert book.trajectory_curve("s", curve, 400.0) is curve  # nothing left to come after this turn
    assert book.trajectory_curve("s", None, 60.0) is None

    # placement hands the engines the trajectory's curve and keeps the turn's own load
    bare = GroupRequest(problem_id="p", session_id="s", prompt_token_ids=[1, 2])
    (own,) = with_length_predictions(dispatch.predictor, [bare])
    (placed,) = [g for items in dispatch.place([bare], SERVING) for _, g in items]
    later = 1000 - 700 - own.predicted_tokens
    assert later > 0 and placed.predicted_tokens == own.predicted_tokens
    assert placed.length_curve.ends == pytest.approx([e + later for e in own.length_curve.ends])
    # placed again (its engine died): not raised twice; a caller's own prediction is left alone
    (again,) = [g for items in dispatch.place([placed], SERVING) for _, g in items]
    assert again.length_curve == placed.length_curve
    (own_prediction,) = [g for items in dispatch.place([turn("s", predicted=60.0)], SERVING) for _, g in items]
    assert own_prediction.length_curve is None
