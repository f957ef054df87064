"""The makespan simulator: bookkeeping against hand-computable cases, and the CLI's labelled output."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from das.drafter.records import RolloutRecord, write_rollouts
from das.scheduler.cost_model import CostModel
from das.scheduler.simulator import longest_group, simulate
from das.service.cli import app

FLAT = CostModel(name="flat", c_base_s=1.0, c_tok_s=0.0, source="test")


def records(lengths_by_version: dict[int, list[int]], problem: str = "p") -> list[RolloutRecord]:
    out = []
    for v, lengths in lengths_by_version.items():
        for i, n in enumerate(lengths):
            out.append(RolloutRecord(problem_id=f"{problem}{i % 2}", policy_version=v, sample_index=i,
                                     prompt_token_ids=(1, 2), output_token_ids=tuple(range(10, 10 + n))))
    return out


def test_no_speculation_makespan_is_the_longest_sample():
    recs = records({0: [5, 5, 5, 5], 1: [3, 9, 4, 2]})
    r = simulate(recs, FLAT, engines=2, policy_name="none")
    assert r.makespan_s == pytest.approx(9.0)  # one pass per token, a pass costs 1 s
    assert r.tokens_verified == 3 + 9 + 4 + 2 and r.accepted_tokens == 0
    assert r.forward_passes >= 9


def test_the_longest_group_alone_is_the_critical_path():
    """Problems p0 (samples 0, 2) and p1 (samples 1, 3): p1 holds the longest sample, so the reference runs p1's
    two samples on one engine; with a per-token cost its steps are cheaper than with the whole batch."""
    recs = records({0: [5, 5, 5, 5], 1: [3, 9, 4, 2]})
    assert [r.sample_index for r in longest_group(sorted(recs[4:], key=lambda r: r.problem_id))] == [1, 3]
    per_token = CostModel(name="t", c_base_s=1.0, c_tok_s=0.5, source="test")
    alone = simulate(recs, per_token, engines=4, policy_name="none", longest_group_only=True)
    assert alone.tokens_verified == 9 + 2 and alone.forward_passes == 9
    assert alone.makespan_s == pytest.approx(2 * 2.0 + 7 * 1.5)  # two requests for 2 steps, then one
    for engines in (1, 2, 4):  # without drafting, no placement beats it
        for placement in ("length-aware", "round-robin"):
            assert simulate(recs, per_token, engines, "none", placement).makespan_s >= alone.makespan_s


def test_repeated_text_is_drafted_and_shortens_the_makespan():
    recs = records({0: [40, 40, 40, 40], 1: [40, 40, 40, 40]})  # every sample writes the same tokens
    none = simulate(recs, FLAT, engines=1, policy_name="none")
    uniform = simulate(recs, FLAT, engines=1, policy_name="uniform-8")
    assert uniform.accepted_tokens > 0
    assert uniform.makespan_s < 0.5 * none.makespan_s
    assert uniform.tokens_verified > none.tokens_verified  # drafts are verified work


def test_bad_arguments():
    recs = records({0: [3], 1: [3]})
    with pytest.raises(ValueError, match="engines"):
        simulate(recs, FLAT, engines=0, policy_name="none")
    with pytest.raises(ValueError, match="unknown policy"):
        simulate(recs, FLAT, engines=1, policy_name="magic")
    with pytest.raises(ValueError, match="placement"):
        simulate(recs, FLAT, engines=1, policy_name="none", placement="random")
    with pytest.raises(ValueError, match="two policy versions"):
        simulate(records({0: [3]}), FLAT, engines=1, policy_name="none")


def test_cli_labels_everything_as_simulated(tmp_path):
    path = tmp_path / "t.jsonl"
    write_rollouts(path, records({0: [20, 30, 20, 30], 1: [25, 35, 20, 30]}))
    result = CliRunner().invoke(app, ["bench", "simulate", "--traces", str(path), "--engines", "2", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["simulated"] is True and set(doc["arms"]) == {"none", "uniform-4", "uniform-8", "uniform-16",
                                                            "classes", "das-token", "das"}
    assert set(doc["placement"]) == {"round-robin", "length-aware"}
    assert doc["longest_group_alone"]["makespan_s"] > 0 and "longest-group-alone/round-robin" in doc["ratios"]
    for arm in doc["arms"].values():
        assert {"makespan_s", "tail_share", "forward_passes", "tokens_verified"} <= set(arm)
    table = CliRunner().invoke(app, ["bench", "simulate", "--traces", str(path), "--engines", "2",
                                     "--policy", "das"])
    assert table.exit_code == 0 and "SIMULATED" in table.output
    bad = CliRunner().invoke(app, ["bench", "simulate", "--traces", str(path), "--cost-model", "nope"])
    assert bad.exit_code == 2
