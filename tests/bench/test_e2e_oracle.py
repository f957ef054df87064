"""`das bench e2e --arms none,das,oracle,oracle-k` with scripted arms: the oracle arms get none's tokens by sample
key before each epoch, their outputs are checked against none's, and every epoch gets its bound and the oracle
table (none, das, oracle, bound, das's share of the oracle's saving, oracle / bound)."""

from __future__ import annotations

import asyncio

import pytest
from rich.console import Console

from das.bench.e2e import ARM_BUDGETS, E2EConfig, EpochOutput, Outcome, oracle_ratios, run_e2e
from das.bench.e2e_report import markdown, print_tables
from das.bench.oracle_bound import StepPrice, engine_bound
from das.service.client.prompt_sets import reasoning_gym_problems
from das.service.wire.api import GroupRequest

MAKESPAN = {"none": 10.0, "das": 7.0, "oracle": 4.0, "oracle-k": 5.0}
FIT = {"c_base_s": 0.02, "c_tok_s": 0.001, "c_spec_s": 0.0, "c_spec_req_s": 0.0}


def keyed_tokens(group: GroupRequest, index: int) -> list[int]:
    """What keyed sampling makes of a sample: tokens that depend on its key only (length 5-24)."""
    key = group.sample_key(index)
    assert key is not None
    return [(key >> s) % 1000 for s in range(5 + key % 20)]


class KeyedArm:
    def __init__(self, name: str, oracles: list) -> None:
        self.name, self.oracles = name, oracles

    def set_oracle(self, continuations: dict[int, list[int]]) -> None:
        self.oracles.append((self.name, dict(continuations)))

    async def run_epoch(self, groups: list[GroupRequest]) -> EpochOutput:
        outcomes = []
        for g, group in enumerate(groups):
            for j in range(group.n):
                tokens = keyed_tokens(group, j)
                if self.name == "oracle-k" and g == 0 and j == 0:
                    tokens = tokens + [1]  # an arm whose output changed
                outcomes.append(Outcome(g, j, tokens, "x", "stop", 0.1))
        return EpochOutput(outcomes, MAKESPAN[self.name], draft_tokens=0, accepted_tokens=0, drafts=0)

    async def reload(self, checkpoint: str, version: int) -> None:
        raise AssertionError("no drift here")

    async def proposer_stats(self) -> dict:
        return {"cost": FIT} if self.name.startswith("oracle") else {}

    async def close(self) -> None:
        pass


def test_oracle_arms_draft_nones_tokens_by_key_and_the_report_says_how_far_from_the_bound() -> None:
    problems = reasoning_gym_problems(3)
    config = E2EConfig(model="m", prompts="reasoning-gym:3", samples=2, epochs=2,
                       arms=("none", "das", "oracle", "oracle-k"), num_speculative_tokens=4)
    oracles: list = []

    async def factory(name: str, cfg: E2EConfig, repeat: int) -> KeyedArm:
        return KeyedArm(name, oracles)

    messages: list[str] = []
    result = asyncio.run(run_e2e(config, problems, progress=messages.append, arm_factory=factory))

    # before each epoch every oracle arm got that epoch's none outputs, keyed by the samples' keys
    assert [name for name, _ in oracles] == ["oracle", "oracle-k"] * 2
    none_tokens = [epoch["none"].lengths for epoch in result.runs[0]]
    for e in range(2):
        given = oracles[2 * e][1]
        assert len(given) == 6 and sorted(len(t) for t in given.values()) == sorted(none_tokens[e])
        assert oracles[2 * e + 1][1] == given
    assert oracles[0][1] != oracles[2][1]  # the epochs draw fresh keys
    assert result.oracle_identical == {"oracle": True, "oracle-k": False}
    assert any("oracle-k's outputs differ" in m for m in messages)

    price = StepPrice.from_fit(FIT)
    for e, epoch in enumerate(result.runs[0]):
        bound = engine_bound(epoch["none"].lengths, 4, price)
        assert result.bounds[0][e]["bound_s"] == pytest.approx(bound.seconds, abs=1e-3)
        assert result.bounds[0][e]["steps"] == -(-max(epoch["none"].lengths) // 5)
    table = result.oracle_table()
    assert [row["epoch"] for row in table] == [1, 2]
    row = table[1]
    assert (row["none"], row["das"], row["oracle"], row["oracle-k"]) == (10.0, 7.0, 4.0, 5.0)
    assert row["das_share_of_oracle_saving"] == 0.5  # (10 - 7) / (10 - 4)
    assert row["oracle_over_bound"] == pytest.approx(4.0 / row["bound_s"], rel=1e-3)
    data = result.to_dict()
    assert data["oracle"] == table and data["bounds"][0]["epochs"][0]["bound_s"] == result.bounds[0][0]["bound_s"]
    text = markdown(result)
    assert "das saving / oracle saving" in text and "oracle-k False" in text
    console = Console(record=True, width=200)
    print_tables(result, console)
    printed = console.export_text()
    assert "the limit: oracle drafts" in printed and "oracle outputs identical to none's: oracle True" in printed


def test_oracle_ratios_and_config_errors() -> None:
    assert oracle_ratios(10.0, 8.0, 6.0, 3.0) == {"das_share_of_oracle_saving": 0.5, "oracle_over_bound": 2.0}
    assert oracle_ratios(10.0, 8.0, 10.0, None) == {"das_share_of_oracle_saving": None, "oracle_over_bound": None}
    with pytest.raises(ValueError, match="list none before them"):
        E2EConfig(model="m", prompts="p", arms=("oracle", "none"))
    with pytest.raises(ValueError, match="list none before them"):
        E2EConfig(model="m", prompts="p", arms=("das", "oracle-k"))
    assert E2EConfig(model="m", prompts="p", arms=("none", "oracle-k")).engine_config("oracle-k", 0).budget.policy \
        == "uniform"


def test_the_user_runs_oracle_k_serves_the_budget_of_the_e2e_arm() -> None:
    """`das bench serve`'s oracle-k is `das serve --budget NAME` with the name e2e's oracle-k runs (one grammar)."""
    from das.bench.user_run import ORACLE_ARMS
    from das.scheduler.policies import UniformBudget, parse_budget

    flags = ORACLE_ARMS["oracle-k"]
    assert flags[flags.index("--budget") + 1] == ARM_BUDGETS["oracle-k"]
    assert parse_budget(ARM_BUDGETS["oracle-k"]) == UniformBudget()
