"""AcceptanceCounts: per-request and pooled acceptance by draft position, and the drafter parameters from them."""

from __future__ import annotations

import numpy as np
import pytest

from das.scheduler.acceptance import EXPLORE_DRAFTS, AcceptanceCounts
from das.scheduler.budget import estimate_drafter_params


def test_counts_by_position_per_request_and_pooled():
    book = AcceptanceCounts(k_max=4)
    a, b = book.start("a"), book.start("b")
    book.record(np.array([a, b]), np.array([4, 2]), np.array([1, 2]))
    book.record(np.array([a]), np.array([6]), np.array([0]))  # positions beyond k_max are not counted
    assert book.pool_proposed.tolist() == [3, 3, 2, 2] and book.pool_accepted.tolist() == [2, 1, 0, 0]
    own = book.params(book.slots(["a", "b"]))
    # b always accepted everything it drafted, a rarely: b's tokens per step and first-token acceptance are higher
    assert own.tokens_per_step[1] > own.tokens_per_step[0]
    assert own.acceptance[1, 0] > own.acceptance[0, 0]


def test_a_new_request_starts_from_the_pooled_acceptance_and_slots_are_reused():
    book = AcceptanceCounts(k_max=3)
    for i in range(40):  # more requests than the initial slots: the arrays grow
        book.start(f"r{i}")
    slots = book.slots([f"r{i}" for i in range(40)])
    assert len(set(slots.tolist())) == 40
    book.record(slots, np.full(40, 3), np.full(40, 3))  # every draft fully accepted
    book.finish("r0")
    fresh = book.start("new")
    assert fresh == slots[0]  # the finished request's slot, zeroed
    new, old = book.params(book.slots(["new", "r1"])).tokens_per_step
    assert new > 3.0  # the engine's drafts are usually right: a newcomer is expected to do well too (at most 4)
    assert new < old  # but less than a request measured to
    with pytest.raises(KeyError):
        book.slots(["r0"])


def test_the_pooled_window_halves_old_evidence():
    book = AcceptanceCounts(k_max=1, pool_window=10)
    book.start("a")
    s = book.slots(["a"])
    for _ in range(11):
        book.record(s, np.array([1]), np.array([1]))
    assert book.pool_proposed[0] == 5.5 and book.pool_accepted[0] == 5.5


def test_estimate_takes_a_prior_per_position():
    none = np.zeros(3)
    flat = estimate_drafter_params(none, none, prior_q=np.array([0.9, 0.8, 0.7]))
    geometric = estimate_drafter_params(none, none)
    assert flat.tokens_per_step > geometric.tokens_per_step
    with pytest.raises(ValueError, match="prior_q"):
        estimate_drafter_params(none, none, prior_q=np.array([0.9, 0.0, 0.7]))
    with pytest.raises(ValueError, match="k_max"):
        AcceptanceCounts(0)


def test_a_request_is_unmeasured_until_enough_of_its_drafts_were_verified():
    counts = AcceptanceCounts(k_max=4)
    old, new = counts.start("old"), counts.start("new")
    for _ in range(EXPLORE_DRAFTS - 1):
        counts.record(np.array([old]), np.array([2]), np.array([0]))
    assert counts.params(np.array([old, new])).unmeasured.tolist() == [True, True]
    counts.record(np.array([old]), np.array([3]), np.array([1]))
    counts.record(np.array([new]), np.array([0]), np.array([0]))  # no draft, nothing measured
    assert counts.params(np.array([old, new])).unmeasured.tolist() == [False, True]


def test_positions_never_drafted_are_expected_to_hold_up_as_the_first_one_does():
    """High first-position acceptance measured with one-token drafts only: the untried positions follow it (so the
    budget may try long drafts), where a fixed prior kept them at 0.5^j; below 0.5 they keep the 0.5^j prior."""
    for rate, least_tokens, most_tokens in ((0.95, 5.0, 9.0), (0.2, 1.4, 2.0)):
        book = AcceptanceCounts(k_max=8)
        slot = book.start("a")
        rng = np.random.default_rng(0)
        for _ in range(400):
            book.record(np.array([slot]), np.array([1]), np.array([int(rng.random() < rate)]))
        q = book.pooled_acceptance()
        assert q[0] == pytest.approx(rate, abs=0.05)
        assert q[7] == pytest.approx(max(q[0], 0.5) ** 8, rel=0.2)
        assert np.all(np.diff(q[1:]) < 0)
        newcomer = book.params(np.array([book.start("b")]))
        assert least_tokens <= newcomer.tokens_per_step[0] <= most_tokens


def test_a_request_whose_first_tokens_hold_is_expected_to_hold_further_out_than_the_pool():
    """A pool measured on poor drafts (every position accepted ~40% of the time after the one before it); a new
    request whose 8 one-token explorations were all accepted gets a higher prior on the positions it has not
    tried than the pool's (which would keep its drafts short), one that failed them a lower one, and one with no
    drafts of its own the pool's unchanged."""
    book = AcceptanceCounts(k_max=8)
    old = book.start("old")
    rng = np.random.default_rng(0)
    for _ in range(500):
        book.record(np.array([old]), np.array([8]), np.array([int(np.argmin(rng.random(9) < 0.4))]))
    good, bad, fresh = book.start("good"), book.start("bad"), book.start("fresh")
    for _ in range(8):
        book.record(np.array([good, bad]), np.array([1, 1]), np.array([1, 0]))
    got = book.params(np.array([good, bad, fresh]))
    pool_only = estimate_drafter_params(book._proposed[[good, bad, fresh]], book._accepted[[good, bad, fresh]],
                                        prior_q=book.pooled_acceptance())
    assert got.tokens_per_step[0] > pool_only.tokens_per_step[0] + 0.1
    assert got.tokens_per_step[1] < pool_only.tokens_per_step[1]
    assert got.tokens_per_step[2] == pytest.approx(pool_only.tokens_per_step[2])
    assert got.unmeasured.tolist() == [False, False, True]
