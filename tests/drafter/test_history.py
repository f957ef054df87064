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
