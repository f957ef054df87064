"""Difficulty history: window and size bounds, acceptance counts, the book's cached prior, and the msgpack format
(round trips, and corrupt or hostile blobs that must raise DifficultyFormatError and nothing else)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from das.drafter.records import RolloutRecord
from das.scheduler.difficulty import (
    MAX_FINISH_REASONS,
    MAX_K,
    MAX_PER_VERSION,
    MAX_REASON_CHARS,
    MAX_WINDOW,
    OTHER_REASON,
    DifficultyBook,
    DifficultyFormatError,
    DifficultyHistory,
    dump_difficulty,
    load_difficulty,
)


def _rec(problem: str, version: int, length: int, reason: str | None = "stop", sample: int = 0) -> RolloutRecord:
    return RolloutRecord(problem, version, sample, (1, 2), tuple(range(length)), reason)


def _state(h: DifficultyHistory) -> dict[str, Any]:
    """Everything observable about a history, for equality checks."""
    return {"problem_id": h.problem_id, "bounds": (h.window, h.max_per_version, h.k_max),
            "versions": {v: h.lengths(v).tolist() for v in h.policy_versions},
            "reasons": h.finish_reasons(), "proposed": h.proposed.tolist(), "accepted": h.accepted.tolist()}


def _sample_history() -> DifficultyHistory:
    h = DifficultyHistory("gsm/7", window=3, max_per_version=5, k_max=4)
    for v, lengths in ((2, [10, 20, 30]), (5, [7]), (9, [100, 200, 300, 400, 500, 600])):
        for x in lengths:
            h.add_length(v, x, "length" if x >= 500 else "stop")
    h.add_length(9, 0, None)
    for proposed, accepted in ((4, 2), (6, 6), (1, 0), (0, 0)):
        h.record_acceptance(proposed, accepted)
    return h


# --- bounds ---------------------------------------------------------------------------------------------------

def test_window_keeps_the_highest_versions() -> None:
    h = DifficultyHistory("p", window=4)
    for v in range(6):
        assert h.add_length(v, 10 + v)
    assert h.policy_versions == [2, 3, 4, 5]
    assert h.lengths().tolist() == [12, 13, 14, 15]
    assert not h.add_length(1, 99)  # older than everything held, window full: ignored
    assert h.policy_versions == [2, 3, 4, 5]
    assert h.add_length(3, 33)  # a held version still takes lengths
    assert h.lengths(3).tolist() == [13, 33]


def test_out_of_order_versions_fill_the_window_then_evict_the_oldest() -> None:
    h = DifficultyHistory("p", window=3)
    for v in (5, 3, 4):
        assert h.add_length(v, v)
    assert not h.add_length(2, 2)
    assert h.add_length(6, 6)
    assert h.policy_versions == [4, 5, 6]
    assert h.lengths().tolist() == [4, 5, 6]  # oldest version first


def test_each_version_keeps_its_most_recent_lengths() -> None:
    h = DifficultyHistory("p", max_per_version=3)
    for x in range(10):
        h.add_length(0, x)
    assert h.lengths(0).tolist() == [7, 8, 9]


def test_bounded_under_a_long_stream() -> None:
    h = DifficultyHistory("p", window=2, max_per_version=4, k_max=3)
    rng = np.random.default_rng(0)
    for step in range(2000):
        h.add_length(step // 50, int(rng.integers(0, 5000)), f"reason-{rng.integers(0, 100)}")
        h.record_acceptance(int(rng.integers(0, 10)), 0)
    assert len(h.policy_versions) == 2
    assert all(len(h.lengths(v)) == 4 for v in h.policy_versions)
    assert len(h.finish_reasons()) <= 2 * MAX_FINISH_REASONS  # each held version keeps at most that many
    assert h.proposed.shape == (3,)


def test_finish_reasons_are_bounded_and_leave_with_their_version() -> None:
    h = DifficultyHistory("p", window=2)
    for i in range(40):
        h.add_length(0, 1, f"r{i}")
    h.add_length(0, 1, "x" * (MAX_REASON_CHARS + 1))
    reasons = h.finish_reasons()
    assert len(reasons) == MAX_FINISH_REASONS
    assert reasons[OTHER_REASON] == 40 - (MAX_FINISH_REASONS - 1) + 1
    assert sum(reasons.values()) == 41
    h.add_length(1, 5, "stop")
    h.add_length(2, 5, "length")  # evicts version 0 and its reasons
    assert h.finish_reasons() == {"stop": 1, "length": 1}


def test_none_finish_reason_is_not_counted() -> None:
    h = DifficultyHistory("p")
    h.add_length(0, 3, None)
    assert h.finish_reasons() == {}
    assert h.lengths().tolist() == [3]


@pytest.mark.parametrize("kwargs", [{"window": 0}, {"window": MAX_WINDOW + 1}, {"max_per_version": 0},
                                    {"max_per_version": MAX_PER_VERSION + 1}, {"k_max": 0}, {"k_max": MAX_K + 1},
                                    {"window": True}, {"window": 2.0}])
def test_bounds_are_validated(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        DifficultyHistory("p", **kwargs)
    with pytest.raises(ValueError):
        DifficultyBook(**kwargs)


@pytest.mark.parametrize(("version", "length"), [(-1, 3), (0, -1), (0, 2**31), (True, 3), (0, 2.5), ("0", 3)])
def test_bad_lengths_are_rejected(version: Any, length: Any) -> None:
    h = DifficultyHistory("p")
    with pytest.raises(ValueError):
        h.add_length(version, length)
    assert h.policy_versions == [] and h.revision == 0


def test_lengths_are_read_only() -> None:
    h = DifficultyHistory("p")
    h.add_length(0, 3)
    for arr in (h.lengths(), h.lengths(0)):
        with pytest.raises(ValueError):
            arr[0] = 99
    assert h.lengths().tolist() == [3]


# --- acceptance -----------------------------------------------------------------------------------------------

def test_record_acceptance_counts_by_position() -> None:
    h = DifficultyHistory("p", k_max=4)
    h.record_acceptance(3, 1)
    h.record_acceptance(2, 2)
    h.record_acceptance(0, 0)
    h.record_acceptance(7, 5)  # positions >= k_max are not tracked
    assert h.proposed.tolist() == [3, 3, 2, 1]
    assert h.accepted.tolist() == [3, 2, 1, 1]
    rate = h.acceptance_rate()
    np.testing.assert_allclose(rate, [1.0, 2 / 3, 0.5, 1.0])
    assert np.isnan(DifficultyHistory("q").acceptance_rate()).all()


@pytest.mark.parametrize(("proposed", "accepted"), [(2, 3), (-1, 0), (3, -1), (2.0, 1), (True, 0)])
def test_record_acceptance_rejects_impossible_steps(proposed: Any, accepted: Any) -> None:
    h = DifficultyHistory("p")
    with pytest.raises(ValueError):
        h.record_acceptance(proposed, accepted)
    assert not h.proposed.any() and not h.accepted.any()


def test_record_acceptance_takes_numpy_ints() -> None:
    h = DifficultyHistory("p", k_max=2)
    h.record_acceptance(np.int64(2), np.int32(1))
    assert h.proposed.tolist() == [1, 1] and h.accepted.tolist() == [1, 0]


# --- the book -------------------------------------------------------------------------------------------------

def test_book_collects_records_by_problem() -> None:
    book = DifficultyBook(window=2)
    kept = book.add_records([_rec("a", 0, 5), _rec("a", 1, 6, "length"), _rec("b", 1, 7), _rec("a", 2, 8),
                             _rec("a", 0, 9)])  # the last is older than a's window: dropped
    assert kept == 4
    assert sorted(book) == ["a", "b"] and len(book) == 2 and "a" in book and "c" not in book
    assert book.lengths("a").tolist() == [6, 8]
    assert book.lengths("c").tolist() == []
    assert sorted(book.all_lengths().tolist()) == [6, 7, 8]
    assert book.get("a") is book.history("a") and book.get("c") is None
    assert book.history("a").finish_reasons() == {"length": 1, "stop": 1}


def test_all_lengths_follows_every_change() -> None:
    book = DifficultyBook()
    book.add_record(_rec("a", 0, 5))
    first, rev = book.all_lengths(), book.revision
    assert book.all_lengths() is first  # cached while nothing changes
    book.history("a").add_length(0, 11)  # directly on the history: the book still notices
    assert book.revision > rev
    assert sorted(book.all_lengths().tolist()) == [5, 11]
    loaded = load_difficulty(dump_difficulty(book.history("a")))
    loaded.add_length(0, 13)  # a standalone history does not touch the book
    assert sorted(book.all_lengths().tolist()) == [5, 11]
    book.put(loaded)
    assert sorted(book.all_lengths().tolist()) == [5, 11, 13]
    loaded.add_length(0, 17)  # after put, it is the book's
    assert sorted(book.all_lengths().tolist()) == [5, 11, 13, 17]
    book.remove("a")
    book.remove("never-seen")
    assert book.all_lengths().tolist() == []


def test_put_requires_the_books_bounds() -> None:
    book = DifficultyBook(window=4)
    with pytest.raises(ValueError, match="differ"):
        book.put(DifficultyHistory("p", window=3))
    assert "p" not in book


# --- serialization --------------------------------------------------------------------------------------------

def test_round_trip() -> None:
    h = _sample_history()
    blob = dump_difficulty(h)
    back = load_difficulty(blob)
    assert _state(back) == _state(h)
    assert back.policy_versions == [2, 5, 9]
    assert back.lengths(9).tolist() == [300, 400, 500, 600, 0]
    assert dump_difficulty(back) == blob  # deterministic


def test_round_trip_of_an_empty_history() -> None:
    h = DifficultyHistory("fresh")
    assert _state(load_difficulty(dump_difficulty(h))) == _state(h)


def test_a_loaded_history_keeps_its_bounds_when_it_grows() -> None:
    h = DifficultyHistory("p", window=2, max_per_version=2)
    for i in range(MAX_FINISH_REASONS + 3):
        h.add_length(0, i, f"r{i}")
    back = load_difficulty(dump_difficulty(h))
    back.add_length(0, 1, "new")  # the reason map is full: counted as OTHER_REASON
    back.add_length(1, 1)
    back.record_acceptance(50, 50)
    again = load_difficulty(dump_difficulty(back))  # still within every limit the loader checks
    assert _state(again) == _state(back)
    assert again.policy_versions == [0, 1]
    # 15 named reasons, the other 4 of the first 19 and "new" under OTHER_REASON.
    assert again.finish_reasons()[OTHER_REASON] == (MAX_FINISH_REASONS + 3) - (MAX_FINISH_REASONS - 1) + 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 8), st.integers(0, 3000), st.sampled_from([None, "stop", "length"])),
                max_size=60),
       st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), max_size=20),
       st.integers(1, 5), st.integers(1, 6), st.integers(1, 8))
def test_round_trip_of_any_history(adds: list[tuple[int, int, str | None]], steps: list[tuple[int, int]],
                                   window: int, per_version: int, k_max: int) -> None:
    h = DifficultyHistory("p", window=window, max_per_version=per_version, k_max=k_max)
    for v, x, reason in adds:
        h.add_length(v, x, reason)
    for proposed, accepted in steps:
        h.record_acceptance(max(proposed, accepted), min(proposed, accepted))
    assert len(h.policy_versions) <= window
    assert all(1 <= len(h.lengths(v)) <= per_version for v in h.policy_versions)
    assert _state(load_difficulty(dump_difficulty(h))) == _state(h)


def _doc() -> dict[str, Any]:
    return msgpack.unpackb(dump_difficulty(_sample_history()), raw=False)


def _pack(doc: Any) -> bytes:
    return msgpack.packb(doc, use_bin_type=True)


def _edit(fn: Callable[[dict[str, Any]], None]) -> bytes:
    doc = _doc()
    fn(doc)
    return _pack(doc)


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """An edit that sets doc[a][b]... (integer parts index lists)."""
    def edit(doc: dict[str, Any]) -> None:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        for p in parents:
            doc = doc[p]
        doc[last] = value
    return edit


def _delete(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda doc: doc.pop(key)


CORRUPT: list[tuple[str, Any, str]] = [
    ("not bytes", "a string", "expected bytes"),
    ("empty", b"", "not a msgpack document"),
    ("garbage", b"\xc1\xc1\xc1", "not a msgpack document"),
    ("truncated", dump_difficulty(_sample_history())[:-3], "not a msgpack document"),
    ("trailing data", dump_difficulty(_sample_history()) + b"\x00", "not a msgpack document"),
    ("not a map", _pack([1, 2, 3]), "not a das-difficulty-history"),
    ("drafter format", _pack({"format": "das-problem-history", "version": 1}), "not a das-difficulty-history"),
    ("future version", _edit(_set("version", 2)), "unsupported"),
    ("version as bool", _edit(_set("version", True)), "unsupported"),
    ("non-string map key", b"\x81\x01\x02", "not a msgpack document"),
    ("deep nesting", b"\x91" * 100_000 + b"\x00", "not a msgpack document"),
    ("missing field", _edit(_delete("k_max")), "missing field"),
    ("unknown field", _edit(_set("extra", 1)), "unknown field"),
    ("empty problem id", _edit(_set("problem_id", "")), "problem_id"),
    ("problem id as bytes", _edit(_set("problem_id", b"p")), "problem_id must be str"),
    ("window zero", _edit(_set("window", 0)), "window"),
    ("window huge", _edit(_set("window", 2**40)), "window"),
    ("window as float", _edit(_set("window", 3.0)), "window must be int"),
    ("k_max huge", _edit(_set("k_max", 2**63)), "k_max"),
    ("per-version cap negative", _edit(_set("max_per_version", -1)), "max_per_version"),
    ("too many versions", _edit(_set("window", 2)), "more than window"),
    ("versions not a list", _edit(_set("versions", {})), "versions must be list"),
    ("version entry not a map", _edit(_set("versions.0", [1])), "must be a map"),
    ("version entry missing key", _edit(lambda d: d["versions"][0].pop("lengths")), "missing field"),
    ("version entry extra key", _edit(_set("versions.0.x", 1)), "unknown field"),
    ("versions not increasing", _edit(_set("versions.1.policy_version", 2)), "not increasing"),
    ("negative version", _edit(_set("versions.0.policy_version", -4)), "policy_version"),
    ("lengths not bytes", _edit(_set("versions.0.lengths", [1, 2])), "lengths must be bytes"),
    ("lengths ragged", _edit(_set("versions.0.lengths", b"\x01\x00\x00")), "multiple of 4"),
    ("no lengths", _edit(_set("versions.0.lengths", b"")), "need 1 to"),
    ("too many lengths", _edit(_set("versions.0.lengths", b"\x01\x00\x00\x00" * 6)), "max_per_version"),
    ("negative length", _edit(_set("versions.0.lengths", b"\xff\xff\xff\xff")), "negative length"),
    ("reasons not a map", _edit(_set("versions.0.finish_reasons", ["stop"])), "finish_reasons must be dict"),
    ("reason count negative", _edit(_set("versions.0.finish_reasons.stop", -1)), "count"),
    ("reason count float", _edit(_set("versions.0.finish_reasons.stop", 1.5)), "count"),
    ("reason count bool", _edit(_set("versions.0.finish_reasons.stop", True)), "count"),
    ("reason empty", _edit(_set("versions.0.finish_reasons.", 1)), "is not a string"),
    ("reason too long", _edit(_set("versions.0.finish_reasons." + "x" * (MAX_REASON_CHARS + 1), 1)),
     "is not a string"),
    ("reason as bytes", _edit(lambda d: d["versions"][0]["finish_reasons"].update({b"stop": 1})),
     "is not a string"),
    ("too many reasons", _edit(_set("versions.0.finish_reasons", {f"r{i}": 1 for i in range(MAX_FINISH_REASONS)})),
     "reasons"),
    ("proposed wrong size", _edit(_set("proposed", b"\x00" * 8 * 5)), "4 x 8 bytes"),
    ("accepted not bytes", _edit(_set("accepted", [0, 0, 0, 0])), "accepted must be bytes"),
    ("negative count", _edit(_set("proposed", np.array([5, 3, -1, -1], "<i8").tobytes())), "negative"),
    ("accepted above proposed", _edit(_set("accepted", np.array([9, 0, 0, 0], "<i8").tobytes())), "exceeds"),
    ("proposed increasing", _edit(_set("proposed", np.array([5, 6, 6, 6], "<i8").tobytes())), "non-increasing"),
    ("ext type", _edit(_set("proposed", msgpack.ExtType(5, b"\x00" * 32))), "proposed must be bytes"),
]


@pytest.mark.parametrize(("blob", "message"), [(b, m) for _, b, m in CORRUPT], ids=[n for n, _, _ in CORRUPT])
def test_corrupt_blobs_raise_a_format_error(blob: Any, message: str) -> None:
    with pytest.raises(DifficultyFormatError, match=message) as info:
        load_difficulty(blob)
    assert isinstance(info.value, ValueError)


def test_the_sample_blob_itself_loads() -> None:
    # Guards the corrupt cases above: each must fail because of its edit, not because the base blob is bad.
    assert _state(load_difficulty(_pack(_doc()))) == _state(_sample_history())


def _load_or_format_error(blob: bytes) -> None:
    try:
        h = load_difficulty(blob)
    except DifficultyFormatError:
        return
    assert isinstance(h, DifficultyHistory)
    assert _state(load_difficulty(dump_difficulty(h))) == _state(h)  # whatever loads is a valid history


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_raise_anything_else(blob: bytes) -> None:
    _load_or_format_error(blob)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_blobs_never_raise_anything_else(data: st.DataObject) -> None:
    blob = bytearray(dump_difficulty(_sample_history()))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(blob) - 1))
        blob[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(blob)))
    _load_or_format_error(bytes(blob[:cut]) if data.draw(st.booleans()) else bytes(blob))


_MSGPACK_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted({"format", "version", "problem_id", "window", "max_per_version",
                                                "k_max", "versions", "proposed", "accepted", "zz"})),
                       _MSGPACK_VALUES))
def test_hostile_documents_never_raise_anything_else(doc: dict[str, Any]) -> None:
    base = _doc()
    base.update(doc)
    _load_or_format_error(_pack(base))
