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
