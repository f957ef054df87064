"""The native source calibrator: cells, prior, learning, fading, and its input checks."""

from __future__ import annotations

import numpy as np
import pytest

from das.drafter._suffix_index import SuffixIndex
from das.drafter.source_choice import SourceChooser


def index_with(*seqs: list[int]) -> SuffixIndex:
    ix = SuffixIndex(16)
    for s in seqs:
        ix.extend(ix.new_sequence(), s)
    return ix


def test_cells_are_distinct_and_in_range():
    cal = SourceChooser(["a", "b"])
    cells = {cal.cell(k, m, p, a) for k in range(2) for m in (1, 2, 3, 5, 8, 12, 20, 40)
             for p in np.linspace(0, 1, 8, endpoint=False) + 0.01 for a in (1, 2, 3)}
    assert len(cells) == 2 * 8 * 8 * 3 and min(cells) == 0 and max(cells) == len(cal.counts) - 1
    assert cal.cell(0, 3, 0.5, 9) == cal.cell(0, 3, 0.5, 3)  # 3+ agreeing sources share a bucket
    with pytest.raises(ValueError, match="kind"):
        cal.cell(2, 1, 0.5, 1)


def test_expected_starts_at_the_score_and_follows_observations():
    cal = SourceChooser(["a"], pseudo_count=5.0, horizon=10.0)
    c = cal.cell(0, 4, 0.9, 1)
    assert cal.expected(c, 3.0) == pytest.approx(3.0)
    choice = cal.choose([index_with([1, 2, 3, 4])], [0], [1, 2], 2)
    assert choice.best == 0 and choice.tokens.tolist() == [3, 4] and choice.match_len == 2
    for _ in range(100):
        cal.observe(choice, [9, 9])  # always wrong
    n = cal.counts[choice.cells[0]]
    assert 9.0 <= n <= 10.0 + 1e-9  # old observations fade at the horizon
    assert cal.sums[choice.cells[0]] == 0.0
    assert cal.expected(choice.cells[0], 2.0) == pytest.approx(5.0 * 2.0 / (n + 5.0))


def test_choice_prefers_agreeing_sources_once_agreement_has_paid():
    cal = SourceChooser(["x", "y", "z"])
    a, b, c = index_with([5, 6, 7]), index_with([5, 6, 8]), index_with([5, 6, 8])
    choice = cal.choose([a, b, c], [0, 1, 2], [5, 6], 1)
    assert [d.tokens.tolist() for d in choice.drafts] == [[7], [8], [8]]
    for _ in range(30):
        cal.observe(cal.choose([a, b, c], [0, 1, 2], [5, 6], 1), [8])
    assert cal.choose([a, b, c], [0, 1, 2], [5, 6], 1).tokens.tolist() == [8]


def test_no_match_gives_no_choice_and_bad_input_is_rejected():
    cal = SourceChooser(["a"])
    ix = index_with([1, 2, 3])
    choice = cal.choose([ix], [0], [9], 4)
    assert choice.best == -1 and len(choice.tokens) == 0 and choice.cells == [-1]
    cal.observe(choice, [1])  # nothing to score: no change
    assert cal.counts.sum() == 0
    with pytest.raises(ValueError, match="one kind per index"):
        cal.choose([ix], [0, 0], [1], 4)
    with pytest.raises(ValueError, match="kind out of range"):
        cal.choose([ix], [3], [1], 4)
    with pytest.raises(TypeError):
        cal.choose([None], [0], [1], 4)
    with pytest.raises(ValueError):
        SourceChooser(["a"], pseudo_count=0.0)
    big = SourceChooser(["a", "b", "c", "d"])
    foreign = big.choose([ix], [3], [1, 2], 1)
    with pytest.raises(ValueError, match="foreign"):
        cal.observe(foreign, [3])


def test_token_cells_are_distinct_and_token_prob_starts_at_the_walks_own_conditional():
    cal = SourceChooser(["a", "b"])
    cells = {cal.token_cell(k, m, j, c, a) for k in range(2) for m in (1, 2, 3, 5, 8, 12, 20, 40)
             for j in (0, 1, 2, 3, 5, 8, 9) for c in np.linspace(0, 1, 10, endpoint=False) + 0.01 for a in (0, 1, 2)}
    assert len(cells) == 2 * 8 * 7 * 10 * 3 and min(cells) == 0 and max(cells) == len(cal.token_counts) - 1
    assert cal.token_cell(0, 3, 40, 0.5, 7) == cal.token_cell(0, 3, 9, 0.5, 2)  # 9+ and 2+ share buckets
    c = cal.token_cell(0, 4, 0, 0.75, 0)
    assert cal.token_prob(c, 0.75) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="kind"):
        cal.token_cell(2, 1, 0, 0.5, 0)


def test_a_draft_stops_where_its_tokens_have_been_rejected_once_that_has_been_seen():
    cal = SourceChooser(["a"])
    ix = index_with([1, 2, 3, 4, 5, 6])
    first = cal.choose([ix], [0], [1, 2], 4, floor=0.5)
    assert first.tokens.tolist() == [3, 4, 5, 6] and first.best_len == 4  # one occurrence: the walk says certain
    for _ in range(30):
        cal.observe(cal.choose([ix], [0], [1, 2], 4, floor=0.5), [3, 4, 9])  # the third token is always wrong
    later = cal.choose([ix], [0], [1, 2], 4, floor=0.5)
    assert later.tokens.tolist() == [3, 4] and later.best_len == 2
    assert later.probs[1] > 0.9  # the first two kept their calibrated certainty
    assert later.drafts[0].tokens.tolist() == [3, 4, 5, 6]  # the walk goes on: its third token is still scored
    assert later.drafts[0].probs[2] < 0.5
    # With no floor the whole walk is sent: the floor is the price, not a cap.
    assert cal.choose([ix], [0], [1, 2], 4).tokens.tolist() == [3, 4, 5, 6]


def test_no_candidate_above_the_floor_sends_nothing_but_still_learns():
    cal = SourceChooser(["a"])
    ix = index_with([1, 2, 3, 1, 2, 4])  # after [1, 2]: 3 or 4, each with conditional 0.5
    choice = cal.choose([ix], [0], [1, 2], 2, floor=0.6)
    assert choice.best == -1 and choice.tokens.tolist() == [] and choice.best_len == 0
    assert len(choice.drafts[0].tokens) == 2  # the candidate was walked all the same
    before = cal.token_counts.sum()
    cal.observe(choice, [3, 9])
    assert cal.token_counts.sum() == before + 2  # its first token accepted, its second seen rejected


def test_the_choice_follows_which_source_kind_gets_its_tokens_accepted():
    cal = SourceChooser(["x", "y"])
    a, b = index_with([1, 2, 7, 7, 7]), index_with([1, 2, 8, 8, 8])
    assert cal.choose([a, b], [0, 1], [1, 2], 3).tokens.tolist() == [7, 7, 7]  # a tie goes to the first
    for _ in range(30):
        cal.observe(cal.choose([a, b], [0, 1], [1, 2], 3), [8, 8, 8, 8])
    assert cal.choose([a, b], [0, 1], [1, 2], 3).tokens.tolist() == [8, 8, 8]


def test_token_cells_count_the_other_sources_that_agree_up_to_the_token():
    cal = SourceChooser(["x", "y", "z"])
    a, b, c = index_with([5, 6, 7, 1]), index_with([5, 6, 8, 1]), index_with([5, 6, 8, 2])
    choice = cal.choose([a, b, c], [0, 1, 2], [5, 6], 2)
    assert [d.tokens.tolist() for d in choice.drafts] == [[7, 1], [8, 1], [8, 2]]
    assert choice.token_cells[0] == [cal.token_cell(0, 2, 0, 1.0, 0), cal.token_cell(0, 2, 1, 1.0, 0)]
    assert choice.token_cells[1] == [cal.token_cell(1, 2, 0, 1.0, 1), cal.token_cell(1, 2, 1, 1.0, 0)]
