"""`replay_versions`: every policy version as one batch, the first included, for comparing with a measured run."""

from __future__ import annotations

import pytest

from das.drafter.records import RolloutRecord
from das.scheduler.cost_model import CostModel
from das.scheduler.simulator import EngineLimits, replay_versions

COST = CostModel("test", c_base_s=1.0, c_tok_s=0.1, source="test", c_prefill_s=0.05)


def _batch(version: int, outputs: list[tuple[int, ...]], problem: str = "p") -> list[RolloutRecord]:
    return [RolloutRecord(problem, version, i, (7, 8, 9), out, "stop") for i, out in enumerate(outputs)]


def test_a_plain_batch_costs_its_steps_by_construction() -> None:
    # Two requests of 3 and 5 tokens (3-token prompts) on one engine without drafts: one step computes both
    # prompts and samples their first tokens, then 2 steps decode 2 tokens, then 2 steps decode 1.
    replay = replay_versions(_batch(0, [(1, 2, 3), (4, 5, 6, 7, 8)]), COST, "none")
    assert len(replay) == 1
    (batch,) = replay
    assert batch.version == 0
    assert batch.makespan_s == pytest.approx((1 + 6 * 0.05) + 2 * 1.2 + 2 * 1.1)
    assert (batch.forward_passes, batch.tokens_verified, batch.accepted_tokens) == (5, 6, 0)


def test_every_version_is_a_batch_and_engines_split_the_groups() -> None:
    records = _batch(0, [(1, 2, 3)]) + _batch(1, [(1, 2, 3)], "p") + _batch(1, [(5, 6)], "q")
    one, two = replay_versions(records, COST, "none", engines=1), replay_versions(records, COST, "none", engines=2)
    assert [b.version for b in one] == [0, 1]
    assert one[1].makespan_s == pytest.approx(1.3 + 1.2 + 1.1)  # p and q share one engine
    assert two[1].makespan_s == pytest.approx(1.15 + 2 * 1.1)  # each alone: the longer one decides


def test_history_from_earlier_versions_feeds_the_drafter() -> None:
    # A repetitive output the drafter has seen in version 0 is drafted in version 1: fewer passes than without.
    out = tuple(range(10, 50))
    records = _batch(0, [out] * 4) + _batch(1, [out] * 4)
    plain = replay_versions(records, COST, "none")
    drafted = replay_versions(records, CostModel("cheap drafts", 1.0, 0.001, "test"), "uniform-8", k_max=8)
    assert plain[1].forward_passes == len(out)
    assert drafted[1].accepted_tokens > 0
    assert drafted[1].forward_passes < plain[1].forward_passes


def test_prompts_are_chunked_to_the_step_token_budget() -> None:
    # step_tokens 4, two 3-token prompts: step 1 computes the first prompt and 1 token of the second (the first
    # samples its first token), step 2 decodes the first to its end beside the second's last 2 prompt tokens,
    # step 3 decodes the second to its end.
    replay = replay_versions(_batch(0, [(1, 2), (3, 4)]), COST, "none", engine=EngineLimits(step_tokens=4))
    assert replay[0].forward_passes == 3
    assert replay[0].makespan_s == pytest.approx((1 + 4 * 0.05) + (1.1 + 2 * 0.05) + 1.1)


def test_requests_beyond_max_num_seqs_wait_for_a_free_slot() -> None:
    # One slot: the second request is admitted (and prefilled) only after the first has finished.
    replay = replay_versions(_batch(0, [(1, 2), (3, 4)]), COST, "none", engine=EngineLimits(max_num_seqs=1))
    assert replay[0].forward_passes == 4
    assert replay[0].makespan_s == pytest.approx(2 * ((1 + 3 * 0.05) + 1.1))
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineLimits(max_num_seqs=0)


def test_rejects_no_engines() -> None:
    with pytest.raises(ValueError):
        replay_versions(_batch(0, [(1,)]), COST, "none", engines=0)
