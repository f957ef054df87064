"""`replay_versions`: every policy version as one batch, the first included, for comparing with a measured run."""

from __future__ import annotations

import pytest

from das.drafter.records import RolloutRecord
from das.scheduler.cost_model import CostModel
from das.scheduler.simulator import replay_versions

COST = CostModel("test", c_base_s=1.0, c_tok_s=0.1, source="test")


def _batch(version: int, outputs: list[tuple[int, ...]], problem: str = "p") -> list[RolloutRecord]:
    return [RolloutRecord(problem, version, i, (7, 8, 9), out, "stop") for i, out in enumerate(outputs)]


def test_a_plain_batch_costs_its_steps_by_construction() -> None:
    # Two requests of 3 and 5 tokens on one engine without drafts: 3 steps of 2 tokens, then 2 steps of 1.
    replay = replay_versions(_batch(0, [(1, 2, 3), (4, 5, 6, 7, 8)]), COST, "none")
    assert len(replay) == 1
    (batch,) = replay
    assert batch.version == 0
    assert batch.makespan_s == pytest.approx(3 * 1.2 + 2 * 1.1)
    assert (batch.forward_passes, batch.tokens_verified, batch.accepted_tokens) == (5, 8, 0)
    assert batch.prompt_tokens == 6


def test_every_version_is_a_batch_and_engines_split_the_groups() -> None:
    records = _batch(0, [(1, 2, 3)]) + _batch(1, [(1, 2, 3)], "p") + _batch(1, [(5, 6)], "q")
    one, two = replay_versions(records, COST, "none", engines=1), replay_versions(records, COST, "none", engines=2)
    assert [b.version for b in one] == [0, 1]
    assert one[1].makespan_s == pytest.approx(2 * 1.2 + 1.1)  # p and q share one engine
    assert two[1].makespan_s == pytest.approx(3 * 1.1)  # each alone: the longer one decides


def test_history_from_earlier_versions_feeds_the_drafter() -> None:
    # A repetitive output the drafter has seen in version 0 is drafted in version 1: fewer passes than without.
    out = tuple(range(10, 50))
    records = _batch(0, [out] * 4) + _batch(1, [out] * 4)
    plain = replay_versions(records, COST, "none")
    drafted = replay_versions(records, CostModel("cheap drafts", 1.0, 0.001, "test"), "uniform-8", k_max=8)
    assert plain[1].forward_passes == len(out)
    assert drafted[1].accepted_tokens > 0
    assert drafted[1].forward_passes < plain[1].forward_passes


def test_rejects_no_engines() -> None:
    with pytest.raises(ValueError):
        replay_versions(_batch(0, [(1,)]), COST, "none", engines=0)
