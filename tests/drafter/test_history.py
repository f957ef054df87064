"""Windowed per-problem history, draft selection across sources, budget, and msgpack round trips."""

from __future__ import annotations

import numpy as np
import pytest

from das.drafter.history import DrafterConfig, HistoryBank, ShadowOutcome
from das.drafter.records import RolloutRecord

PROMPT = np.array([1, 2, 3], np.int32)


def rec(problem: str, version: int, index: int, output: list[int]) -> RolloutRecord:
    return RolloutRecord(problem_id=problem, policy_version=version, sample_index=index,
                         prompt_token_ids=(1, 2, 3), output_token_ids=tuple(output))


def test_siblings_see_each_other_through_the_live_segment():
    bank = HistoryBank(DrafterConfig(max_depth=16))
    bank.start_request("a", "p", PROMPT, 0)
    bank.start_request("b", "p", PROMPT, 0)
    bank.extend("a", np.array([10, 11, 12, 13, 14, 15], np.int32))
    prop = bank.propose("b", np.array([1, 2, 3, 10, 11], np.int32), 4)
    assert prop.source == "live" and prop.tokens.tolist() == [12, 13, 14, 15] and prop.match_len == 2
    capped = HistoryBank(DrafterConfig(max_depth=16, match_factor=1.0))
    capped.start_request("a", "p", PROMPT, 0)
    capped.start_request("b", "p", PROMPT, 0)
    capped.extend("a", np.array([10, 11, 12, 13, 14, 15], np.int32))
    # a 2-token match drafts at most match_factor * 2 tokens
    assert capped.propose("b", np.array([1, 2, 3, 10, 11], np.int32), 4).tokens.tolist() == [12, 13]
    # another problem's requests do not see it (no sealed history anywhere yet, so no global fallback either)
    bank.start_request("c", "q", PROMPT, 0)
    assert bank.propose("c", np.array([1, 2, 3, 10, 11], np.int32), 4).source in ("", "prompt")


def test_calibration_learns_which_version_pays():
    bank = HistoryBank(DrafterConfig(max_depth=16, window=2, global_tokens=0))
    bank.add_rollouts([rec("p", 0, 0, [20, 21, 22, 23]), rec("p", 1, 0, [20, 21, 30, 31])])
    context = np.array([1, 2, 3, 20, 21], np.int32)
    bank.start_request("r0", "p", PROMPT, 2)
    # no feedback yet: equal evidence, the newer version is tried first
    assert bank.propose("r0", context, 2).source == "sealed-age-1"
    for i in range(20):  # the policy keeps writing what version 0 wrote
        rid = f"r{i}"
        if i:
            bank.start_request(rid, "p", PROMPT, 2)
        bank.propose(rid, context, 2)
        bank.extend(rid, np.array([22, 23], np.int32))
        bank.finish_request(rid)
    bank.start_request("last", "p", PROMPT, 2)
    prop = bank.propose("last", context, 2)
    assert prop.source == "sealed-age-2" and prop.tokens.tolist() == [22, 23]
    table = bank.chooser.table()
    assert table["sealed-age-2"]["mean_accepted"] > table["sealed-age-1"]["mean_accepted"]


def test_window_keeps_the_last_versions():
    bank = HistoryBank(DrafterConfig(max_depth=16, window=2))
    bank.add_rollouts([rec("p", 0, 0, [20, 21, 22, 23]), rec("p", 1, 0, [20, 21, 30, 31])])
    bank.start_request("r", "p", PROMPT, 2)
    bank.extend("r", np.array([40, 41], np.int32))
    bank.finish_request("r")
    bank.seal(2)
    assert sorted(bank.problems["p"].sealed) == [1, 2]  # version 0 left the window of 2


def test_global_fallback_for_unseen_problems():
    bank = HistoryBank(DrafterConfig(max_depth=16))
    bank.add_rollouts([rec("seen", 0, 0, [40, 41, 42, 43, 44])])
    bank.start_request("r", "unseen", PROMPT, 1)
    prop = bank.propose("r", np.array([7, 40, 41, 42], np.int32), 2)
    assert prop.source == "global" and prop.tokens.tolist() == [43, 44]


def test_token_budget_evicts_oldest_versions_first():
    cfg = DrafterConfig(max_depth=8, window=10, token_budget=60, global_tokens=0)
    bank = HistoryBank(cfg)
    for v in range(6):
        bank.add_rollouts([rec("p", v, 0, list(range(100 + v, 120 + v)))])
    assert bank.stored_tokens() <= 60
    assert sorted(bank.problems["p"].sealed)[-1] == 5 and 0 not in bank.problems["p"].sealed
    assert bank.memory_bytes() > 0


def test_a_shadow_draft_is_settled_by_the_tokens_committed_over_the_next_steps():
    """A shadow draft is compared with what the request commits, a step at a time or several tokens at once, until
    its first wrong token (that many accepted) or its end (all accepted); one at a time per request."""
    bank = HistoryBank(DrafterConfig(max_depth=16, shadow_gap=0))
    bank.add_rollouts([rec("p", 0, 0, [10, 11, 12, 13, 14, 15])])
    bank.start_request("r", "p", PROMPT, 1)
    context = np.array([1, 2, 3, 10], np.int32)
    assert bank.shadow("r", context, 4)  # drafts 11 12 13 14
    assert not bank.shadow("r", context, 4)  # the first is still unsettled
    assert bank.extend("r", np.array([11], np.int32)) is None
    assert bank.extend("r", np.array([12], np.int32)) is None
    assert bank.extend("r", np.array([99, 5], np.int32)) == ShadowOutcome(drafted=4, accepted=2)
    assert bank.extend("r", np.array([6], np.int32)) is None  # settled: nothing followed any more
    # a draft every token of which comes true, committed in one verified step of 5 tokens
    assert bank.shadow("r", context, 3)
    assert bank.extend("r", np.array([11, 12, 13, 40, 41], np.int32)) == ShadowOutcome(drafted=3, accepted=3)
    # wrong at once
    assert bank.shadow("r", context, 3)
    assert bank.extend("r", np.array([7], np.int32)) == ShadowOutcome(drafted=3, accepted=0)
    # nothing to draft from (no source matches), or no room: none started
    assert not bank.shadow("r", np.array([77, 78], np.int32), 4) and not bank.shadow("r", context, 0)
    # a verified proposal is not a shadow draft: its outcome is the caller's to count
    assert bank.propose("r", context, 4).tokens.tolist() == [11, 12, 13, 14]
    assert bank.extend("r", np.array([11], np.int32)) is None
    # with a gap, the next shadow draft waits for that many committed tokens after one settles
    gapped = HistoryBank(DrafterConfig(max_depth=16, shadow_gap=3))
    gapped.add_rollouts([rec("p", 0, 0, [10, 11, 12, 13, 14, 15])])
    gapped.start_request("r", "p", PROMPT, 1)
    assert gapped.shadow("r", context, 4) and gapped.extend("r", np.array([7], np.int32)).accepted == 0
    assert not gapped.shadow("r", context, 4)
    gapped.extend("r", np.array([8, 9], np.int32))
    assert not gapped.shadow("r", context, 4)
    gapped.extend("r", np.array([10], np.int32))
    assert gapped.shadow("r", context, 4)
    with pytest.raises(ValueError, match="shadow_gap"):
        DrafterConfig(shadow_gap=-1)


def test_bad_requests_are_rejected_without_side_effects():
    bank = HistoryBank()
    bank.start_request("r", "p", PROMPT, 3)
    with pytest.raises(ValueError, match="already running"):
        bank.start_request("r", "p", PROMPT, 3)
    with pytest.raises(ValueError, match="older than the live version"):
        bank.start_request("x", "p", PROMPT, 2)
    with pytest.raises(KeyError, match="unknown request"):
        bank.propose("nope", PROMPT, 4)
    with pytest.raises(ValueError, match="outside"):
        bank.extend("r", np.array([1, -4], np.int64))
    with pytest.raises(ValueError, match="outside"):
        bank.start_request("y", "p", np.array([2**31], np.int64), 3)
    with pytest.raises(ValueError, match="outside"):
        bank.start_request("y", "new-problem", [1, -2], 4)
    with pytest.raises(ValueError, match="problem_id"):
        bank.start_request("y", "", PROMPT, 3)
    assert set(bank.problems) == {"p"} and bank.problems["p"].live_version == 3
    assert bank.problems["p"].live.index.sequence(0) == []
    with pytest.raises(ValueError, match="window"):
        DrafterConfig(window=0)


def test_live_samples_of_an_imported_version_join_it_when_sealed():
    bank = HistoryBank()
    bank.add_rollouts([rec("p", 0, 0, [1, 2, 3, 4])])
    bank.start_request("r", "p", np.array([9], np.int32), policy_version=0)
    bank.extend("r", np.array([5, 6, 7], np.int32))
    bank.finish_request("r")
    bank.seal(0)
    sealed = bank.problems["p"].sealed
    assert list(sealed) == [0]
    assert sorted(sealed[0].sequences()) == [[1, 2, 3, 4], [5, 6, 7]]
    bank.add_rollouts([rec("p", 0, 1, [8, 8])])  # importing into a sealed version adds to it too
    assert len(bank.problems["p"].sealed[0].sequences()) == 3


def _history_bank() -> HistoryBank:
    bank = HistoryBank(DrafterConfig(max_depth=16, shadow_gap=2))
    bank.add_rollouts([rec("p", 0, 0, [10, 11, 12, 13, 14, 15, 16]), rec("p", 0, 1, [10, 11, 20, 21, 22]),
                       rec("q", 0, 0, [30, 31, 32, 33, 34])])
    for rid, problem in (("a", "p"), ("b", "p"), ("c", "q")):
        bank.start_request(rid, problem, PROMPT, 1)
    return bank


def test_a_batch_step_is_the_single_request_calls_row_by_row():
    """commit_step and draft_step over a batch give what extend, propose and shadow give one request at a time:
    the same drafts, the same shadow outcomes, the same chooser table."""
    batch, single = _history_bank(), _history_bank()
    rids = ["a", "b", "c"]
    slots = np.array([batch._requests[r].slot for r in rids], np.int32)
    steps = [[[10], [10], [30]], [[11, 12], [11], [31]], [[13], [20], [99, 98]], [[14], [21], [32]], [[15], [22], [33]]]
    k, floor, room = np.array([4, 0, 3], np.int32), np.zeros(3), np.array([0, 4, 0], np.int32)
    text = {r: list(PROMPT) for r in rids}
    seen = {"draft": 0, "shadow started": 0, "shadow settled": 0}
    for step in steps:
        width = max(len(text[r]) + len(t) for r, t in zip(rids, step)) + 1
        table = np.zeros((3, width), np.int32)
        start = np.array([len(text[r]) for r in rids], np.int64)
        for i, (r, tokens) in enumerate(zip(rids, step)):
            text[r] += tokens
            table[i, :len(text[r])] = text[r]
        end = np.array([len(text[r]) for r in rids], np.int64)
        settled = batch.commit_step(slots, table, start, end)
        outcomes = [single.extend(r, np.array(t, np.int32)) for r, t in zip(rids, step)]
        assert [(int(d), int(a)) if d else None for d, a in zip(settled.shadow_drafted, settled.shadow_accepted)] \
            == [None if o is None else (o.drafted, o.accepted) for o in outcomes]
        drafts = batch.draft_step(slots, table, end, k, floor, room)
        context = {r: np.array(text[r], np.int32) for r in rids}
        expected = [single.propose(r, context[r], int(n)).tokens.tolist() if n else [] for r, n in zip(rids, k)]
        started = [single.shadow(r, context[r], int(m)) if m else False for r, m in zip(rids, room)]
        assert drafts.lists() == expected and drafts.shadowed.tolist() == started
        seen["draft"] += sum(map(bool, expected))
        seen["shadow started"] += sum(started)
        seen["shadow settled"] += sum(o is not None for o in outcomes)
    assert min(seen.values()) > 0, seen  # every path was taken
    assert np.array_equal(batch.chooser.sums, single.chooser.sums) and batch.chooser.counts.sum() > 0


def test_a_batch_step_scores_the_last_draft_as_a_verifier_accepts_it():
    """The committed tokens confirm the last draft's common prefix, at most all but the last committed token
    (a verification step commits the accepted draft tokens plus one of its own); the source is reported."""
    bank = _history_bank()
    slot = np.array([bank._requests["a"].slot], np.int32)
    table = np.array([[1, 2, 3, 10, 11, 12, 13, 14, 0, 0]], np.int32)
    drafts = bank.draft_step(slot, table, np.array([4]), np.array([4], np.int32), np.zeros(1), np.zeros(1, np.int32))
    assert drafts.lists() == [[11, 12, 13, 14]] and bank.chooser.kinds[drafts.sources[0]] == "sealed-age-1"
    settled = bank.commit_step(slot, table, np.array([4]), np.array([7]))  # 11 12 13: two drafts + its own
    assert (settled.drafted[0], settled.accepted[0], settled.source[0]) == (4, 2, drafts.sources[0])
    again = bank.commit_step(slot, table, np.array([7]), np.array([8]))  # scored once only
    assert (again.drafted[0], again.accepted[0], again.source[0]) == (0, 0, -1)


def test_a_bad_batch_is_rejected_and_changes_nothing():
    bank = _history_bank()
    slots = np.array([bank._requests[r].slot for r in ("a", "b")], np.int32)
    table = np.array([[1, 2, 3, 10, 11], [1, 2, 3, 10, 0]], np.int32)
    before = [bank.problems["p"].live.index.num_tokens, bank.chooser.counts.sum()]
    bad = [(np.array([slots[0], slots[0]], np.int32), table, [3, 3], [5, 4], "twice"),
           (np.array([slots[0], 99], np.int32), table, [3, 3], [5, 4], "no request"),
           (slots, table, [3, 3], [5, 6], "outside the token table"),
           (slots, np.array([[1, 2, 3, 10, 11], [1, 2, 3, -1, 0]], np.int32), [3, 3], [5, 4], "negative token")]
    for bad_slots, bad_table, start, end, message in bad:
        with pytest.raises(ValueError, match=message):
            bank.commit_step(bad_slots, bad_table, np.array(start), np.array(end))
    with pytest.raises(ValueError, match="one entry per row"):
        bank.commit_step(slots, table, np.array([3]), np.array([5, 4]))
    with pytest.raises(ValueError, match="a token table has one row per request"):
        bank.commit_step(slots, np.array([1, 2, 3], np.int32), np.array([3, 3]), np.array([3, 3]))
    with pytest.raises(ValueError, match="twice"):
        bank.draft_step(np.array([slots[0], slots[0]], np.int32), table, np.array([5, 4]), np.array([4, 4], np.int32),
                        np.zeros(2), np.zeros(2, np.int32))
    assert [bank.problems["p"].live.index.num_tokens, bank.chooser.counts.sum()] == before
    assert bank.commit_step(slots, table, np.array([3, 3]), np.array([5, 4])).drafted.tolist() == [0, 0]
    assert bank.problems["p"].live.index.num_tokens == before[0] + 3


def test_running_requests_draft_from_their_problems_sources_as_they_change():
    """A version imported, a version evicted by the token budget, the global source appearing: a running
    request's next draft reads the sources as they are now, and an evicted segment is not read again."""
    bank = HistoryBank(DrafterConfig(max_depth=8, window=10, token_budget=30, global_tokens=0))
    bank.start_request("r", "p", PROMPT, 5)
    context = np.array([1, 2, 3, 50], np.int32)
    assert bank.propose("r", context, 3).source == ""
    bank.add_rollouts([rec("p", 0, 0, [50, 51, 52, 53, 54, 55, 56, 57, 58, 59])])
    assert bank.propose("r", context, 3).tokens.tolist() == [51, 52, 53]
    bank.add_rollouts([rec("p", 1, 0, [50, 61, 62, 63, 64, 65, 66, 67, 68, 69]), rec("p", 2, 0, [70] * 12)])
    assert 0 not in bank.problems["p"].sealed  # evicted: over the token budget
    assert bank.propose("r", context, 3).tokens.tolist() == [61, 62, 63]
    other = HistoryBank(DrafterConfig(max_depth=8))
    other.start_request("r", "new", PROMPT, 1)
    assert other.propose("r", context, 2).source == ""
    other.add_rollouts([rec("seen", 0, 0, [50, 81, 82])])
    assert other.propose("r", context, 2).source == "global"


def test_the_index_is_sized_to_the_draft_length_unless_named():
    assert DrafterConfig.for_drafts(8).max_depth == 16
    assert DrafterConfig.for_drafts(16, window=2) == DrafterConfig(max_depth=24, window=2)
    assert DrafterConfig.for_drafts(8, max_depth=40).max_depth == 40
    assert DrafterConfig.for_drafts(250).max_depth == 255
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="max_draft"):
            DrafterConfig.for_drafts(bad)
    # a draft of K tokens after a match of up to MATCH_CONTEXT fits: depth K + 8 follows a repeat as far as 32 does
    seq = np.arange(100, 160, dtype=np.int32)
    drafts = []
    for depth in (16, 32):
        bank = HistoryBank(DrafterConfig(max_depth=depth))
        bank.add_rollouts([RolloutRecord("p", 0, 0, (1, 2), tuple(seq.tolist()))])
        bank.start_request("r", "p", np.asarray([1, 2], np.int32), 1)
        drafts.append(bank.propose("r", np.concatenate([[1, 2], seq[:20]]).astype(np.int32), 8).tokens.tolist())
    assert drafts[0] == drafts[1] == seq[20:28].tolist()


def test_a_sessions_turns_extend_one_context_and_draft_from_it():
    bank = HistoryBank(DrafterConfig(max_depth=16))
    first = np.array([1, 2, 3, 4], np.int32)
    bank.start_request("t1", "p", first, 0, session_id="s")
    bank.extend("t1", np.array([5, 6], np.int32))
    bank.finish_request("t1")
    assert bank.context_tokens == 4 and bank.problem("p").prompts.tokens == 0  # not among the problem's prompts
    tool = [40, 41, 42, 43, 44, 45]
    second = np.array([1, 2, 3, 4, 5, 6, *tool], np.int32)
    bank.start_request("t2", "p", second, 0, session_id="s")
    assert bank.context_tokens == len(second)  # extended by its 8 new tokens, not indexed again
    # the model re-emits the tool's output: the session's context drafts the rest of it
    prop = bank.propose("t2", np.array([*second, 9, 40, 41], np.int32), 4)
    assert prop.source == "context" and prop.tokens.tolist() == [42, 43, 44, 45]
    bank.finish_request("t2")
    # another session of the problem does not draft from this one's context
    bank.start_request("u1", "p", np.array([7, 8], np.int32), 0, session_id="u")
    assert bank.propose("u1", np.array([7, 8, 40, 41], np.int32), 4).source != "context"


def test_a_rewritten_context_is_indexed_anew_and_idle_contexts_are_bounded():
    bank = HistoryBank(DrafterConfig(max_depth=16, context_tokens=100))
    bank.start_request("a1", "p", np.arange(1, 61, dtype=np.int32), 0, session_id="a")
    bank.finish_request("a1")
    bank.start_request("a2", "p", np.arange(2, 52, dtype=np.int32), 0, session_id="a")  # not an extension
    assert bank.context_tokens == 50
    bank.finish_request("a2")
    bank.start_request("b1", "p", np.arange(1, 41, dtype=np.int32), 0, session_id="b")
    assert bank.context_tokens == 90  # within the bound: both kept
    bank.start_request("c1", "p", np.arange(1, 31, dtype=np.int32), 0, session_id="c")
    assert bank.context_tokens == 70  # "a" (idle, least recently used) went; "b" and "c" run
    bank.start_request("d1", "p", np.arange(1, 61, dtype=np.int32), 0, session_id="d")
    assert bank.context_tokens == 130  # over the bound, but every context held has a request running
    bank.finish_request("b1")
    assert bank.context_tokens == 90  # "b" went as soon as it was idle
    # a new turn of the evicted session starts its context over, and drafts still run
    bank.start_request("a3", "p", np.arange(2, 62, dtype=np.int32), 0, session_id="a")
    assert bank.propose("a3", np.array([*range(2, 62), 10, 11], np.int32), 3).source == "context"


def test_a_sample_drafts_from_the_latest_finished_sample_with_its_key():
    bank = HistoryBank(DrafterConfig(max_depth=16, window=2, global_tokens=0))
    same, other = [10, 11, 12, 13, 14, 15, 16, 17], [10, 11, 30, 31, 32, 33, 34, 35]
    for rid, key, output in (("a", 7, same), ("b", 8, other)):
        bank.start_request(rid, "p", PROMPT, 0, sample_key=key)
        bank.extend(rid, np.array(output, np.int32))
        bank.finish_request(rid)
    assert sorted(bank.problem("p").keyed) == [7, 8]
    before = bank.memory_bytes()
    # next visit: the sealed version holds both continuations after [10, 11]; each key's own sample has one
    bank.start_request("a1", "p", PROMPT, 1, sample_key=7)
    bank.start_request("b1", "p", PROMPT, 1, sample_key=8)
    bank.start_request("n1", "p", PROMPT, 1)
    assert bank.memory_bytes() > before  # the two keys' indexes, built at their first request
    at = np.array([1, 2, 3, 10, 11], np.int32)
    a, b = bank.propose("a1", at, 4), bank.propose("b1", at, 4)
    assert (a.source, a.tokens.tolist()) == ("same-key", same[2:6])
    assert (b.source, b.tokens.tolist()) == ("same-key", other[2:6])
    assert bank.propose("n1", at, 4).source != "same-key"
    # from the start of the output too: the index holds the prompt's tail before the sample
    assert bank.propose("a1", PROMPT, 3).tokens.tolist() == same[:3]
    # a key's latest sample replaces its older one when it finishes; versions out of the window drop it
    bank.extend("a1", np.array([10, 11, 40], np.int32))
    bank.finish_request("a1")
    assert bank.problem("p").keyed[7].version == 1 and bank.problem("p").keyed[7].tokens[-1] == 40
    for v in (2, 3):
        bank.start_request(f"x{v}", "p", PROMPT, v)
        bank.finish_request(f"x{v}")
    bank.seal(3)
    assert bank.problem("p").keyed == {}


def test_a_bad_sample_key_is_refused_before_anything_changes():
    bank = HistoryBank(DrafterConfig(max_depth=16))
    for bad in (2**63, "7", True, 1.5):
        with pytest.raises(ValueError, match="sample_key"):
            bank.start_request("a", "p", PROMPT, 0, sample_key=bad)
    assert bank.problems == {}
    bank.start_request("a", "p", PROMPT, 0, sample_key=-(2**63))  # every int64 is a key


def test_imported_rollouts_with_a_sample_key_are_drafted_from_by_that_key():
    bank = HistoryBank(DrafterConfig(max_depth=16, global_tokens=0))
    keyed = [RolloutRecord("p", 0, i, (1, 2, 3), (10, 11, 20 + i, 21 + i, 22 + i), sample_key=100 + i)
             for i in range(3)]
    newer = RolloutRecord("p", 2, 0, (1, 2, 3), (10, 11, 50, 51, 52), sample_key=100)
    bank.add_rollouts([newer, *keyed])  # the newer version's sample is the key's, whatever the order given
    assert {k: v.version for k, v in bank.problem("p").keyed.items()} == {100: 2, 101: 0, 102: 0}
    bank.start_request("r", "p", np.array([1, 2, 3], np.int32), 3, sample_key=101)
    prop = bank.propose("r", np.array([1, 2, 3, 10, 11], np.int32), 3)
    assert (prop.source, prop.tokens.tolist()) == ("same-key", [21, 22, 23])
    bank.start_request("s", "p", np.array([1, 2, 3], np.int32), 3, sample_key=100)
    assert bank.propose("s", np.array([1, 2, 3, 10, 11], np.int32), 3).tokens.tolist() == [50, 51, 52]
