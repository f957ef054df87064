"""The native suffix index against the pure-Python reference, plus its bad-input contract."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from das.drafter._suffix_index import SuffixIndex
from tests.drafter.reference_index import ReferenceSuffixIndex

# A small alphabet makes repeats, branches, shared edges and label splits common.
tokens = st.integers(min_value=0, max_value=5)
sequences = st.lists(tokens, min_size=0, max_size=40)


def assert_same_draft(native, ref, context, k, min_prob, factor=0.0, prior=0.0):
    a = native.speculate(context, k, min_prob, factor, prior)
    b = ref.speculate(context, k, min_prob, factor, prior)
    assert (a.tokens.tolist(), a.match_len) == (b.tokens, b.match_len), (context, k, min_prob, factor, prior)
    assert np.allclose(a.probs, b.probs, rtol=1e-5)
    assert a.score == pytest.approx(b.score, rel=1e-5)


@st.composite
def operations(draw):
    """A random interleaving of appends to several live sequences, seals and removals."""
    n_seqs = draw(st.integers(1, 5))
    ops = []
    for _ in range(draw(st.integers(1, 60))):
        kind = draw(st.sampled_from(["extend", "extend", "extend", "seal", "remove"]))
        seq = draw(st.integers(0, n_seqs - 1))
        ops.append((kind, seq, draw(st.lists(tokens, min_size=1, max_size=6))))
    return n_seqs, ops


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(depth=st.integers(1, 12), script=operations(), contexts=st.lists(sequences, min_size=1, max_size=6),
       k=st.integers(0, 14), min_prob=st.sampled_from([0.0, 0.1, 0.5]),
       factor=st.sampled_from([0.0, 0.5, 1.0, 2.0]), prior=st.sampled_from([0.0, 0.5, 2.0]))
def test_native_matches_reference(depth, script, contexts, k, min_prob, factor, prior):
    native, ref = SuffixIndex(depth), ReferenceSuffixIndex(depth)
    n_seqs, ops = script
    ids = [(native.new_sequence(), ref.new_sequence()) for _ in range(n_seqs)]
    state = ["live"] * n_seqs
    for kind, i, toks in ops:
        a, b = ids[i]
        if state[i] == "removed":
            continue
        if kind == "extend" and state[i] == "live":
            native.extend(a, toks)
            ref.extend(b, toks)
        elif kind == "seal":
            native.seal(a)
            ref.seal(b)
            state[i] = "sealed"
        elif kind == "remove":
            native.remove(a)
            ref.remove(b)
            state[i] = "removed"
        assert native.check_integrity() == ""
    assert native.num_tokens == ref.num_tokens
    assert native.num_sequences == ref.num_sequences
    for context in contexts:
        assert_same_draft(native, ref, context, k, min_prob, factor, prior)
        for length in range(1, min(len(context), depth) + 1):
            assert native.count(context[-length:]) == ref.count(context[-length:])


@settings(max_examples=100, deadline=None)
@given(seqs=st.lists(sequences, min_size=1, max_size=6), depth=st.integers(2, 16))
def test_removing_everything_leaves_an_empty_index(seqs, depth):
    ix = SuffixIndex(depth)
    ids = []
    for s in seqs:
        ids.append(ix.new_sequence())
        ix.extend(ids[-1], s)
    for i in ids:
        ix.remove(i)
        assert ix.check_integrity() == ""
    assert (ix.num_nodes, ix.num_tokens, ix.num_sequences) == (1, 0, 0)


def test_repeated_text_adds_no_nodes():
    """A sibling following an existing path moves boundaries instead of splitting edges (path compression)."""
    rng = np.random.default_rng(0)
    text = rng.integers(0, 30_000, size=2_000).astype(np.int32)
    ix = SuffixIndex(32)
    ix.extend(ix.new_sequence(), text)
    nodes_one = ix.num_nodes
    ix.extend(ix.new_sequence(), text)
    assert ix.check_integrity() == ""
    # A copy may only add boundaries near its start and end, never per token.
    assert ix.num_nodes - nodes_one < 2 * 32
    assert nodes_one < 2 * len(text)


def test_draft_follows_the_most_frequent_continuation():
    ix = SuffixIndex(16)
    for tail in ([7, 8, 9], [7, 8, 9], [7, 5, 5]):
        ix.extend(ix.new_sequence(), [1, 2, 3, *tail])
    d = ix.speculate([0, 2, 3], 3)
    assert d.match_len == 2 and d.tokens.tolist() == [7, 8, 9]
    assert d.probs == pytest.approx([1.0, 2 / 3, 2 / 3])
    assert ix.speculate([1, 2, 3], 3, min_prob=0.9).tokens.tolist() == [7]


def test_numpy_context_is_read_in_place_and_agrees_with_lists():
    ix = SuffixIndex(16)
    ix.extend(ix.new_sequence(), np.arange(50, dtype=np.int32) % 7)
    ctx = (np.arange(20, dtype=np.int32) % 7)
    assert ix.speculate(ctx, 8).tokens.tolist() == ix.speculate(ctx.tolist(), 8).tokens.tolist()


@pytest.mark.parametrize("bad", [[-1], [2**31], [1, 2**40], [1.5], ["a"], [None]])
def test_hostile_tokens_raise_and_change_nothing(bad):
    ix = SuffixIndex(8)
    s = ix.new_sequence()
    ix.extend(s, [1, 2, 3])
    with pytest.raises((ValueError, TypeError)):
        ix.extend(s, [4, *bad])
    assert ix.sequence(s) == [1, 2, 3] and ix.check_integrity() == ""
    with pytest.raises((ValueError, TypeError)):
        ix.speculate(bad, 4)


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="max_depth"):
        SuffixIndex(0)
    with pytest.raises(ValueError, match="max_depth"):
        SuffixIndex(256)
    ix = SuffixIndex(8)
    with pytest.raises(ValueError, match="unknown sequence id 3"):
        ix.extend(3, [1])
    s = ix.new_sequence()
    ix.seal(s)
    with pytest.raises(ValueError, match="sealed"):
        ix.extend(s, [1])
    ix.remove(s)
    with pytest.raises(ValueError, match="unknown sequence"):
        ix.remove(s)
    with pytest.raises(TypeError):
        ix.extend(ix.new_sequence(), "abc")
    with pytest.raises(ValueError, match="min_prob"):
        ix.speculate([1], 4, min_prob=2.0)
    with pytest.raises(ValueError, match="max_tokens"):
        ix.speculate([1], -1)
    with pytest.raises(ValueError, match="match_factor"):
        ix.speculate([1], 4, 0.0, float("nan"))
    with pytest.raises(ValueError, match="prior"):
        ix.speculate([1], 4, 0.0, 1.0, -1.0)
    with pytest.raises(TypeError):
        ix.speculate(np.zeros((2, 2), dtype=np.int32), 4)


def test_empty_and_oversized_inputs_give_empty_drafts():
    ix = SuffixIndex(4)
    assert len(ix.speculate([], 4)) == 0
    assert len(ix.speculate([1, 2, 3], 4)) == 0  # empty index
    ix.extend(ix.new_sequence(), [1, 2, 3, 4, 5, 6])
    assert ix.count([1, 2, 3, 4, 5]) == 0  # longer than max_depth
    assert ix.speculate([*range(1000), 4, 5], 2).tokens.tolist() == [6]  # long context: only its tail is read


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-2**40, 2**40), max_size=30), st.integers(-5, 100),
       st.floats(allow_nan=True, allow_infinity=True))
def test_random_hostile_calls_never_crash(ctx, k, p):
    ix = SuffixIndex(8)
    ix.extend(ix.new_sequence(), [1, 2, 3, 1, 2, 4])
    try:
        ix.speculate(ctx, k, p)
    except (ValueError, TypeError):
        pass
    try:
        ix.extend(0, ctx)
    except (ValueError, TypeError):
        pass
    assert ix.check_integrity() == ""
