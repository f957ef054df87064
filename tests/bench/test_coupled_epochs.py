"""`das bench coupled`: the same-key agreement of revisited samples and the same-key drafter in the replay."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from das.service.cli import program
from das.bench.coupled_epochs import SameKeyDrafter, agreement, common_prefix, coupled_bench, revisits
from das.bench.drafter_replay import replay_arm
from das.drafter.records import RolloutRecord, write_rollouts

app = program()

PROMPT = (1, 2, 3)


def record(problem: str, version: int, index: int, output: list[int]) -> RolloutRecord:
    return RolloutRecord(problem, version, index, PROMPT, tuple(output))


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([5], [1]) == 0


def test_revisits_pair_each_sample_with_the_latest_earlier_visit_of_its_key():
    records = [record("p", 0, 0, [10, 11, 12, 13]), record("p", 0, 1, [20, 21]),
               record("p", 2, 0, [10, 11, 99, 13]), record("p", 2, 1, [20, 21]),
               record("p", 5, 0, [10, 11, 99, 13]), record("q", 1, 0, [7, 8])]
    visits = revisits(records)
    assert [(v.policy_version, v.sample_index, v.visit, v.gap, v.prefix, v.identical) for v in visits] == [
        (2, 0, 2, 2, 2, False), (2, 1, 2, 2, 2, True), (5, 0, 3, 3, 4, True)]
    rows = {(r.by, r.value): r for r in agreement(visits, "visit")}
    assert rows[("visit", 0)].samples == 3 and rows[("visit", 0)].tokens == 10
    assert rows[("visit", 0)].prefix_share == pytest.approx(8 / 10)
    assert rows[("visit", 2)].prefix_share == pytest.approx(4 / 6)
    assert rows[("visit", 2)].mean_sample_share == pytest.approx((2 / 4 + 1.0) / 2)
    assert rows[("visit", 3)].identical_share == 1.0
    assert {r.value for r in agreement(visits, "gap")} == {0, 2, 3}


def test_revisits_refuse_two_samples_of_one_key_in_one_version():
    with pytest.raises(ValueError, match="two samples of index 0"):
        revisits([record("p", 1, 0, [1]), record("p", 1, 0, [2]), record("p", 0, 0, [1])])


def test_the_same_key_drafter_drafts_the_previous_visit_until_the_first_difference():
    earlier = list(range(100, 140))
    now = earlier[:20] + [7] + earlier[21:]   # the update flipped token 20
    records = [record("p", 0, 0, earlier), record("p", 1, 0, now)]
    stats = replay_arm(SameKeyDrafter(), records, max_draft=8)
    # the first 20 tokens come 9 a step (8 drafted, 8 accepted, 1 sampled): 3 steps reach token 27 > 20, but the
    # third draft fails at token 20 (2 accepted of 8); then one token a step, no drafts, for the 19 left
    assert stats.steps == 3 + 19
    assert stats.acceptance_rate == pytest.approx((8 + 8 + 2) / 24)
    other = replay_arm(SameKeyDrafter(), [record("p", 0, 1, earlier), record("p", 1, 0, now)], max_draft=8)
    assert other.steps == len(now) and other.draft_tokens_per_step == 0  # another key: nothing to draft from


def test_with_a_fallback_the_drafter_hands_over_after_the_difference():
    from das.bench.drafter_replay import DasDrafter
    from das.drafter.history import DrafterConfig

    earlier = list(range(100, 140))
    now = earlier[:20] + [7] + earlier[21:]
    records = [record("p", 0, 0, earlier), record("p", 1, 0, now)]
    alone = replay_arm(SameKeyDrafter(), records, max_draft=8)
    both = replay_arm(SameKeyDrafter(DasDrafter(DrafterConfig.for_drafts(8))), records, max_draft=8)
    assert both.steps < alone.steps  # the drafter's history of `earlier` carries on after the flip


def test_bench_coupled_prints_json(tmp_path: Path):
    rng = np.random.default_rng(0)
    base = rng.integers(10, 500, size=30).tolist()
    records = [record(f"p{p}", v, i, base if v < 2 or i else base[:5] + [1] + base[6:])
               for p in range(2) for v in range(3) for i in range(2)]
    path = tmp_path / "t.jsonl.gz"
    write_rollouts(path, records)
    result = CliRunner().invoke(app, ["bench", "coupled", "--traces", str(path), "--max-draft", "4", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    (run,) = out["runs"]
    all_visits = run["by_visit"][0]
    assert all_visits["value"] == 0 and all_visits["samples"] == 8
    assert set(run["arms"]) == {"das", "same-key", "das+same-key", "das-keyed"}
    assert run["arms"]["same-key"]["tokens_per_step"] > 1.0
    assert coupled_bench([path], max_draft=4, arms=("same-key",)).results[0].arms["same-key"].steps > 0


def test_the_drafter_with_sample_keys_drafts_each_keys_own_continuation():
    from das.bench.drafter_replay import DasDrafter
    from das.drafter.history import DrafterConfig

    rng = np.random.default_rng(1)
    shared = rng.integers(10, 500, size=4).tolist()
    outputs = [shared + rng.integers(10, 500, size=24).tolist() for _ in range(4)]  # 4 keys, one prefix
    records = [record("p", v, i, outputs[i]) for v in range(3) for i in range(4)]
    plain = replay_arm(DasDrafter(DrafterConfig.for_drafts(8)), records, max_draft=8)
    keyed = replay_arm(DasDrafter(DrafterConfig.for_drafts(8), keyed=True), records, max_draft=8)
    # where the keys part, the history's four continuations are alike to the plain drafter; each key's own is one
    assert keyed.tokens_per_step > plain.tokens_per_step and keyed.acceptance_rate > plain.acceptance_rate
