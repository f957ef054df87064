"""Peer drafters of the replay benchmark: vLLM's `suffix` (ArcticInference) and `ngram` methods."""

from __future__ import annotations

import numpy as np
import pytest

from das.bench.peers import ArcticSuffixDrafter, NgramDrafter, ReplayDrafter, ngram_lookup


def ids(*tokens: int) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int32)


def run_request(drafter: ReplayDrafter, request_id: str, prompt: np.ndarray, output: np.ndarray) -> None:
    """Starts a request, commits its whole output in one chunk and finishes it."""
    drafter.start_request(request_id, "p0", prompt)
    drafter.extend(request_id, output)
    drafter.finish_request(request_id)


# ---------------------------------------------------------------- ngram


def test_ngram_proposes_the_true_continuation_of_a_repeat():
    phrase = np.arange(100, 120, dtype=np.int32)
    d = NgramDrafter()
    assert (d.name, d.min_n, d.max_n) == ("ngram", 5, 5)
    d.start_request("r", "p0", np.concatenate([ids(1, 2), phrase]))
    d.extend("r", phrase[:7])  # the output starts repeating the phrase
    context = np.concatenate([ids(1, 2), phrase, phrase[:7]])
    np.testing.assert_array_equal(d.propose("r", context, 8), phrase[7:15])


def test_ngram_edge_cases():
    # no earlier occurrence of the last token
    assert ngram_lookup(ids(1, 2, 3, 4, 5, 6), 1, 3, 4).size == 0
    # the last 2 tokens occurred, but min_n is 3
    assert ngram_lookup(ids(7, 8, 1, 2, 9, 7, 8), 3, 4, 4).size == 0
    # context too short to hold an earlier occurrence of n tokens (needs n + 1 tokens)
    assert ngram_lookup(ids(5, 5, 5), 3, 3, 4).size == 0
    assert ngram_lookup(ids(5, 5, 5, 5), 3, 3, 4).tolist() == [5]
    assert ngram_lookup(ids(5), 1, 1, 4).size == 0
    assert ngram_lookup(ids(), 1, 1, 4).size == 0
    # max_tokens clips the draft, and so does the end of the context
    ctx = ids(1, 2, 3, 4, 5, 6, 7, 1, 2)
    assert ngram_lookup(ctx, 2, 2, 3).tolist() == [3, 4, 5]
    assert ngram_lookup(ctx, 2, 2, 100).tolist() == [3, 4, 5, 6, 7, 1, 2]
    assert ngram_lookup(ctx, 2, 2, 0).size == 0
    # drafts are int32 copies, not views into the context
    draft = ngram_lookup(ctx, 2, 2, 3)
    assert draft.dtype == np.int32 and not np.shares_memory(draft, ctx)


def test_ngram_prefers_the_longest_match_then_the_earliest_occurrence():
    # "2 3" occurs after 1 (-> 40) and after 9 (-> 50); "9 2 3" only once, so max_n=3 picks it over the
    # earlier 2-gram occurrence
    ctx = ids(1, 2, 3, 40, 9, 2, 3, 50, 9, 2, 3)
    assert ngram_lookup(ctx, 1, 3, 1).tolist() == [50]
    assert ngram_lookup(ctx, 1, 2, 1).tolist() == [40]  # longest is 2: earliest occurrence, as vLLM
    assert ngram_lookup(ctx, 1, 2, 1, latest=True).tolist() == [50]
    d = NgramDrafter(1, 2, prefer="latest")
    d.start_request("r", "p0", ctx)
    assert d.name == "ngram-latest" and d.propose("r", ctx, 1).tolist() == [50]


def test_ngram_matches_vllm_reference_on_random_contexts():
    """Same drafts as vLLM v1's own ngram search (its pure-Python body, to skip the numba compile)."""
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as vllm_ngram

    rng = np.random.default_rng(0)
    checked_nonempty = 0
    for _ in range(400):
        length = int(rng.integers(1, 60))
        ctx = rng.integers(0, int(rng.integers(2, 6)), size=length).astype(np.int32)
        min_n = int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 4))
        k = int(rng.integers(1, 10))
        expected = vllm_ngram.py_func(ctx, min_n, max_n, 1 << 20, k)
        got = ngram_lookup(ctx, min_n, max_n, k)
        np.testing.assert_array_equal(got, expected, err_msg=f"ctx={ctx.tolist()} n=[{min_n},{max_n}] k={k}")
        checked_nonempty += got.size > 0
    assert checked_nonempty > 100


def test_ngram_memory_and_request_lifecycle():
    d = NgramDrafter()
    assert isinstance(d, ReplayDrafter)
    d.start_request("a", "p0", np.arange(10, dtype=np.int32))
    d.start_request("b", "p0", np.arange(3, dtype=np.int32))
    d.extend("a", ids(1, 2, 3, 4, 5))
    assert d.stored_tokens() == 15 + 3
    assert d.memory_bytes() >= 4 * 18
    for _ in range(100):  # growth keeps every committed token
        d.extend("b", ids(7))
    assert d.stored_tokens() == 15 + 103
    with pytest.raises(ValueError, match="context has"):
        d.propose("a", np.arange(14, dtype=np.int32), 4)
    d.finish_request("a")
    d.finish_request("b")
    assert d.stored_tokens() == 0 and d.memory_bytes() == 0
    with pytest.raises(KeyError):
        d.propose("a", np.arange(15, dtype=np.int32), 4)


# ---------------------------------------------------------------- arctic


def test_arctic_proposes_a_repeat_from_the_prompt_tree():
    phrase = np.arange(200, 230, dtype=np.int32)
    d = ArcticSuffixDrafter(max_depth=24)
    assert d.name == "arctic-d24" and isinstance(d, ReplayDrafter)
    prompt = np.concatenate([ids(1, 2, 3), phrase])
    d.start_request("r", "p0", prompt)
    d.extend("r", phrase[:8])
    draft = d.propose("r", np.concatenate([prompt, phrase[:8]]), 6)
    np.testing.assert_array_equal(draft, phrase[8:14])
    assert draft.dtype == np.int32


def test_arctic_reuses_a_finished_response_for_a_new_request():
    response = np.arange(500, 560, dtype=np.int32)
    d = ArcticSuffixDrafter(max_depth=64)
    assert d.name == "arctic-d64"
    run_request(d, "old", ids(1, 2, 3), response)
    # a new request with an unrelated prompt, whose output so far is a prefix of the old response
    d.start_request("new", "p0", ids(9, 9, 9))
    d.extend("new", response[:20])
    context = np.concatenate([ids(9, 9, 9), response[:20]])
    draft = d.propose("new", context, 16)
    np.testing.assert_array_equal(draft, response[20:36])
    # budget clipping, and max_spec_factor=1 (vLLM's): a draft is at most as long as the matched context
    assert d.propose("new", context, 5).tolist() == response[20:25].tolist()
    assert d.propose("new", context, 0).size == 0
    short = d.propose("new", np.concatenate([ids(9, 9, 9), response[:20]])[-3:], 16)
    assert 0 < short.size <= 3 and short.tolist() == response[20:20 + short.size].tolist()


def test_arctic_without_history_has_no_draft():
    d = ArcticSuffixDrafter(max_depth=24)
    d.start_request("r", "p0", ids(1, 2, 3, 4))
    d.extend("r", ids(5, 6))
    assert d.propose("r", ids(1, 2, 3, 4, 5, 6), 8).size == 0


def test_arctic_memory_and_stored_tokens_follow_the_cache():
    d = ArcticSuffixDrafter(max_depth=24, max_cached_requests=2)
    assert d.memory_bytes() > 0  # the empty global tree's root
    empty_bytes = d.memory_bytes()
    d.start_request("a", "p0", np.arange(10, dtype=np.int32))
    d.extend("a", np.arange(100, 130, dtype=np.int32))
    # live: the response is in the global tree and, with the prompt, in the request's prompt tree
    assert d.stored_tokens() == 30 + (10 + 30)
    live_bytes = d.memory_bytes()
    assert live_bytes > empty_bytes
    d.finish_request("a")
    assert d.stored_tokens() == 30  # prompt tree dropped, response stays in the global tree
    assert empty_bytes < d.memory_bytes() < live_bytes
    run_request(d, "b", ids(1), np.arange(200, 220, dtype=np.int32))
    assert d.stored_tokens() == 30 + 20
    # a third request evicts the oldest response (FIFO, max_cached_requests=2)
    run_request(d, "c", ids(1), np.arange(300, 305, dtype=np.int32))
    assert d.stored_tokens() == 20 + 5
    assert set(d._response_len) == {"b", "c"}  # evicted lengths are forgotten
    # starting a request takes a slot too: "b" goes, "c" stays
    d.start_request("x", "p0", ids(9, 9, 9))
    assert d.stored_tokens() == 5 + 3
    assert d.propose("x", ids(9, 9, 9, 100, 101, 102, 103), 4).size == 0
    assert d.propose("x", ids(9, 9, 9, 200, 201, 202, 203), 4).size == 0
    assert d.propose("x", ids(9, 9, 9, 300, 301, 302), 4).tolist() == [303, 304]
