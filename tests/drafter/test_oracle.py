"""OracleDrafts: a request's drafts are exactly its recorded future tokens, never past the recorded end, scored as
the history bank scores its own drafts."""

from __future__ import annotations

import numpy as np
import pytest

from das.drafter.oracle import OracleDrafts

FUTURE = [50, 51, 52, 53, 54, 55, 56]


def test_drafts_are_the_next_k_recorded_tokens_and_stop_at_the_recorded_end() -> None:
    oracle = OracleDrafts()
    oracle.set(3, FUTURE)
    slots = np.array([3, 3, 3, 3, 3])
    generated = np.array([0, 2, 5, 6, 7])
    k = np.array([4, 4, 4, 4, 4])
    for slot, done, n in zip(slots, generated, k):
        (draft,) = oracle.draft(np.array([slot]), np.array([done]), np.array([n]))
        assert draft == FUTURE[done:done + n]
    assert oracle.draft(np.array([3]), np.array([5]), np.array([4])) == [[55, 56]]  # cut at the end
    assert oracle.draft(np.array([3]), np.array([7]), np.array([4])) == [[]]  # nothing past it
    assert oracle.draft(np.array([3]), np.array([1]), np.array([0])) == [[]]  # K = 0: no draft


def test_rows_of_a_batch_draft_their_own_continuations() -> None:
    oracle = OracleDrafts(capacity=1)  # slots beyond the capacity grow the columns
    oracle.set(0, [1, 2, 3])
    oracle.set(9, [7, 8, 9, 10])
    assert oracle.active[[0, 9]].all() and not oracle.active[1:9].any() and len(oracle) == 2
    assert oracle.draft(np.array([9, 0]), np.array([1, 0]), np.array([2, 5])) == [[8, 9], [1, 2, 3]]
    oracle.clear(0)
    assert not oracle.active[0] and len(oracle) == 1


def test_settle_counts_the_accepted_prefix_but_the_verifiers_own_last_token() -> None:
    oracle = OracleDrafts()
    oracle.set(0, FUTURE)
    oracle.set(1, FUTURE)
    prompt = [9, 9]
    oracle.draft(np.array([0, 1]), np.array([0, 0]), np.array([3, 3]))
    table = np.zeros((2, 16), np.int32)
    table[0, :6] = prompt + FUTURE[:4]  # all 3 drafts accepted, plus the bonus token
    table[1, :4] = prompt + [50, 99]  # the first accepted, the second rejected (99 the recovered token)
    drafted, accepted = oracle.settle(np.array([0, 1]), table, np.array([2, 2]), np.array([6, 4]))
    assert drafted.tolist() == [3, 3] and accepted.tolist() == [3, 1]
    # settled drafts are not counted again; a row that committed nothing keeps no count either
    drafted, accepted = oracle.settle(np.array([0, 1]), table, np.array([6, 4]), np.array([6, 4]))
    assert drafted.tolist() == [0, 0] and accepted.tolist() == [0, 0]


def test_bad_continuations_are_refused_and_change_nothing() -> None:
    oracle = OracleDrafts()
    with pytest.raises(ValueError, match="token ids >= 0"):
        oracle.set(0, [1, -2])
    with pytest.raises(ValueError, match="slot must be >= 0"):
        oracle.set(-1, [1])
    assert len(oracle) == 0 and not oracle.active.any()


def test_continuation_files_round_trip_and_bad_ones_are_named(tmp_path) -> None:
    from das.drafter.oracle import load_continuations, write_continuations

    path = tmp_path / "oracle.json"
    write_continuations(path, {-(2**63): [1, 2], 2**63 - 1: []})
    assert load_continuations(path) == {-(2**63): [1, 2], 2**63 - 1: []}
    path.write_text('{"other": {}}')
    with pytest.raises(ValueError, match="oracle.json: not an oracle continuations file"):
        load_continuations(path)
    path.write_text('{"continuations": {"1": [-3]}}')
    with pytest.raises(ValueError, match="token ids must be >= 0"):
        load_continuations(path)
