"""`das bench e2e --rollouts-out` and `das bench validate`: the rollouts file and its sidecar round-trip, and the
validation's arithmetic on a run whose simulated makespan is known by construction (scripted arms, no engine)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from das.service.cli import program
from das.bench.e2e import (
    E2EConfig,
    EpochOutput,
    Outcome,
    RolloutsSidecar,
    rollout_tag,
    run_e2e,
    sidecar_path,
    write_rollouts_file,
)
from das.bench.e2e_report import EpochCheck, Validation, profile_cost, validate_rollouts
from das.drafter.records import load_rollouts
from das.service.client.prompt_sets import Problem
from das.service.wire.api import GroupRequest

app = program()

PROBLEMS = [Problem("p0", prompt="a"), Problem("p1", prompt="b")]
PROMPT = (5, 6, 7)
# 2 problems x 2 samples of 3-token prompts, outputs of 1..4 tokens (no repeats: the drafter finds nothing).
# Without drafts on one engine under c_base 1 s, c_tok 0.1 s, c_prefill 0.05 s: one step prefills the 12 prompt
# tokens and samples every first token, then steps decode 3, 2, 1 tokens -> 1.6 + 1.3 + 1.2 + 1.1 = 5.2 s an epoch.
SIMULATED_NONE_S = 5.2
FIT = {"c_base_s": 1.0, "c_tok_s": 0.1, "c_spec_s": 0.0, "c_prefill_s": 0.05, "prior": "test", "steps": 100,
       "fit_error": 0.05}
MEASURED = {"none": (5.0, 10.0), "das": (4.0, 4.0), "ngram": (3.0, 3.0)}  # per epoch


class ScriptedArm:
    def __init__(self, name: str) -> None:
        self.name, self.epoch = name, 0

    async def run_epoch(self, groups: list[GroupRequest]) -> EpochOutput:
        outcomes = [Outcome(g, j, [100 + 10 * g + t for t in range(1 + 2 * g + j)], "x", "stop", 0.1, PROMPT)
                    for g in range(len(groups)) for j in range(groups[g].n)]
        if self.name == "ngram":  # a failed sample is not a rollout
            outcomes[-1] = Outcome(1, 1, [], None, "error", 0.1, PROMPT)
        self.epoch += 1
        return EpochOutput(outcomes, MEASURED[self.name][self.epoch - 1], draft_tokens=6, accepted_tokens=2, drafts=3)

    async def reload(self, checkpoint: str, version: int) -> None: ...

    async def proposer_stats(self) -> dict:
        return {"cost": FIT} if self.name == "das" else {}

    async def close(self) -> None: ...


def _run(tmp_path: Path, arms: tuple[str, ...] = ("none", "das", "ngram")) -> Path:
    async def factory(name: str, config: E2EConfig, repeat: int) -> ScriptedArm:
        return ScriptedArm(name)

    config = E2EConfig(model="m", prompts="x", samples=2, epochs=2, arms=arms, num_speculative_tokens=4)
    result = asyncio.run(run_e2e(config, PROBLEMS, arm_factory=factory))
    path = tmp_path / "rollouts.jsonl.gz"
    assert write_rollouts_file(result, path) == len(arms) * 2 * 4 - 2 * ("ngram" in arms)
    return path


def test_the_rollouts_file_round_trips(tmp_path: Path) -> None:
    path = _run(tmp_path)
    records = load_rollouts(path)
    assert {r.problem_id for r in records} == {rollout_tag(a, 0, p.problem_id) for a in ("none", "das", "ngram")
                                               for p in PROBLEMS}
    assert rollout_tag("das", 0, "p1") == "das/r1/p1"
    assert {r.policy_version for r in records} == {0, 1}  # the epoch
    assert all(r.prompt_token_ids == PROMPT and r.finish_reason == "stop" for r in records)
    mine = sorted(len(r.output_token_ids) for r in records if r.problem_id.startswith("none/r1/") and
                  r.policy_version == 1)
    assert mine == [1, 2, 3, 4]

    sidecar = RolloutsSidecar.load(path)
    assert sidecar_path(path).name == "rollouts.jsonl.gz.runs.json"
    assert (sidecar.engines, sidecar.num_speculative_tokens, sidecar.samples) == (1, 4, 2)
    runs = {r.arm: r for r in sidecar.runs}
    assert runs["none"].makespan_s == [5.0, 10.0]
    assert (runs["das"].cost, runs["das"].cost_source) == (FIT, "own fit")
    assert (runs["none"].cost, runs["none"].cost_source) == (FIT, "das fit")  # no proposer: the das arm's fit
    assert runs["das"].accepted_tokens == [2, 2]


def test_validation_replays_each_epoch_against_the_measured_makespan(tmp_path: Path) -> None:
    result = validate_rollouts(_run(tmp_path))
    assert result.skipped == ["ngram (r1): vLLM's drafter"]
    none = [c for c in result.checks if c.arm == "none"]
    assert [c.epoch for c in none] == [1, 2]
    assert [c.simulated_s for c in none] == pytest.approx([SIMULATED_NONE_S] * 2)
    assert [c.error for c in none] == pytest.approx([0.04, -0.48])  # measured 5 s, then 10 s
    assert result.median_error("none") == pytest.approx(0.26)
    assert none[0].simulated_passes == 4
    das = [c for c in result.checks if c.arm == "das"]
    assert [c.measured_accepted for c in das] == [2, 2]
    out = result.to_dict()
    assert out["simulated"] is True and out["met"]["none"] is False
    assert out["costs"]["none/r1"]["source"] == "das fit"


def test_validation_arithmetic() -> None:
    checks = [EpochCheck("das", 1, e, measured, simulated, 10, None, 0, None)
              for e, (measured, simulated) in enumerate([(10.0, 11.0), (10.0, 8.0), (20.0, 21.0)], 1)]
    validation = Validation("f", {}, checks)
    assert [c.ratio for c in checks] == pytest.approx([1.1, 0.8, 1.05])
    assert validation.median_error("das") == pytest.approx(0.1)  # |errors| 0.1, 0.2, 0.05
    assert validation.to_dict()["met"] == {"das": True}


def test_the_profile_cost_is_the_mean_of_the_epochs_fits() -> None:
    epochs = [{"steps": 100, "cost_base_ms": 50.0, "cost_ms_per_token": 4.0, "cost_ms_per_prompt_token": 3.0,
               "cost_spec_ms": None},
              {"steps": 120, "cost_base_ms": 70.0, "cost_ms_per_token": 6.0, "cost_ms_per_prompt_token": None,
               "cost_spec_ms": -2.0}]
    cost = profile_cost(epochs)
    assert cost == pytest.approx({"c_base_s": 0.06, "c_tok_s": 0.005, "c_spec_s": 0.0, "c_prefill_s": 0.003,
                                  "steps": 220})
    assert profile_cost(None) is None
    assert profile_cost([*epochs, {"steps": 5, "cost_base_ms": None, "cost_ms_per_token": None}]) is None


def test_the_validate_command(tmp_path: Path) -> None:
    path = _run(tmp_path, arms=("none",))
    # a run with no das arm has no cost fit for none: nothing to replay
    failed = CliRunner().invoke(app, ["bench", "validate", str(path)])
    assert failed.exit_code != 0 and "simulator can model" in " ".join(failed.output.split())

    path = _run(tmp_path, arms=("none", "das"))
    out = CliRunner().invoke(app, ["bench", "validate", str(path), "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["simulated"] is True and set(data["median_abs_error"]) == {"none", "das"}
    table = CliRunner().invoke(app, ["bench", "validate", str(path)])
    assert table.exit_code == 0 and "SIMULATED" in table.output
