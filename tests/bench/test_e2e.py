"""`das bench e2e`: the run's bookkeeping with scripted arms (repeats, drift, medians, output tests, goals, the
markdown and the plot), then the CLI with real engines on a tiny model (an in-process engine and the HTTP
service, drift between epochs)."""

from __future__ import annotations

import asyncio
import json
import statistics
from pathlib import Path

import pytest
from typer.testing import CliRunner

from das.bench.checkpoints import perturb_checkpoint
from das.service.cli import program
from das.bench.e2e import ARMS as ALL_ARMS
from das.bench.e2e import (
    ORACLE_ARMS,
    E2EConfig,
    E2EFailed,
    EngineArm,
    EpochOutput,
    Outcome,
    run_e2e,
    suffix_tuned_options,
)
from das.bench.e2e_report import markdown, plot
from das.scheduler.policies import DasBudget, UniformBudget, budget_from_config
from das.scheduler.cost_model import CostModel
from das.scheduler.difficulty import DifficultyBook
from das.scheduler.length import LengthCurve, LengthPredictor
from das.service.engine.stub_engine import StubEngine, StubEngineConfig
from das.service.client.prompt_sets import reasoning_gym_problems
from das.service.engine.config import EngineConfig
from das.service.engine.vllm.models import prepare_model
from das.service.wire.api import GroupRequest
from tests.tiny_models import build_tiny_model

app = program()

# Scripted makespans per arm (seconds); repeat r multiplies them by REPEAT_SCALE[r], so the median is the script.
MAKESPAN = {"none": 10.0, "ngram": 3.0, "suffix": 5.0, "suffix-t": 6.0, "das-uniform": 8.0, "das": 4.0,
            "das-service": 4.4, "none-service": 11.0}
REPEAT_SCALE = (1.0, 1.3, 0.8)
ARMS = tuple(a for a in ALL_ARMS if a not in ORACLE_ARMS)  # scripted here; the oracle arms in test_e2e_oracle.py


class ScriptedArm:
    """Every sample's length depends on its problem and index only, except `ngram` (300 tokens longer); half the
    samples answer right, except `suffix` (always wrong)."""

    def __init__(self, name: str, repeat: int, problems: list, log: list, longer: int = 0) -> None:
        self.name, self.repeat, self.problems, self.log = name, repeat, problems, log
        self.longer = longer  # tokens added to every sample (ngram: 300)

    async def run_epoch(self, groups: list[GroupRequest]) -> EpochOutput:
        self.log.append((self.repeat, self.name, "run"))
        outcomes = []
        for g, group in enumerate(groups):
            for j in range(group.n):
                length = 20 + 9 * g + 4 * j + (300 if self.name == "ngram" else self.longer)
                right = j % 2 == 0 and self.name != "suffix"
                answer = self.problems[g].entry["answer"] if right else "none"  # no number: reward 0
                outcomes.append(Outcome(g, j, [1] * length, f"so. Final answer: {answer}", "stop", 0.01 * length))
        makespan = MAKESPAN[self.name] * REPEAT_SCALE[self.repeat]
        return EpochOutput(outcomes, makespan, draft_tokens=40, accepted_tokens=10, drafts=20)

    async def reload(self, checkpoint: str, version: int) -> None:
        self.log.append((self.repeat, self.name, "reload", checkpoint, version))

    async def proposer_stats(self) -> dict:
        if not self.name.startswith("das"):
            return {}
        return {"by_source": {"live": {"proposed": 100 + self.repeat, "accepted": 30},
                              "sealed-age-1": {"proposed": 20, "accepted": 0}}}

    async def close(self) -> None:
        self.log.append((self.repeat, self.name, "close"))


def test_config_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="arms must be distinct"):
        E2EConfig(model="m", prompts="p", arms=("none", "eagle"))
    with pytest.raises(ValueError, match="samples must be >= 1"):
        E2EConfig(model="m", prompts="p", samples=0)
    with pytest.raises(ValueError, match="suffix-t arm needs"):
        E2EConfig(model="m", prompts="p", arms=("none", "suffix-t"))
    (tmp_path / "v1").mkdir()
    with pytest.raises(ValueError, match="one checkpoint per epoch after the first"):
        E2EConfig(model="m", prompts="p", arms=("none",), epochs=3, drift=(str(tmp_path / "v1"),))
    with pytest.raises(ValueError, match="v1 is not a directory with"):
        E2EConfig(model="m", prompts="p", arms=("none",), epochs=2, drift=(str(tmp_path / "v1"),))
    bad = CliRunner().invoke(app, ["bench", "e2e", "--prompts", "reasoning-gym:x"])
    assert bad.exit_code == 2 and "reasoning-gym:<count>" in bad.output
    bad = CliRunner().invoke(app, ["bench", "e2e", "--prompts", "reasoning-gym:2", "--budget", "fast"])
    assert bad.exit_code == 2 and "--budget" in bad.output


def test_arms_differ_only_in_speculation() -> None:
    from vllm.config.speculative import SpeculativeConfig

    cost = CostModel("c", c_base_s=0.044, c_tok_s=0.00049, source="test")
    tuned = suffix_tuned_options(cost, 48)
    assert tuned == {"suffix_decoding_min_token_prob": round(0.00049 / (0.00049 + 0.044 / 48), 3)}
    assert set(tuned) <= set(SpeculativeConfig.__dataclass_fields__)  # a setting vLLM knows
    budget = {"policy": "das", "c_base_s": 0.044, "c_tok_s": 0.00049}
    config = E2EConfig(model="m", prompts="p", budget=budget, suffix_tuned=tuned, seed=5)
    engines = {arm: config.engine_config(arm, repeat=2) for arm in ARMS}
    assert {e.seed for e in engines.values()} == {7}  # seed + repeat
    # a das rollout seed (any int64) names the groups' seeds; the engine's own seed wraps into vLLM's 32 bits
    negative = E2EConfig(model="m", prompts="p", arms=("none",), seed=-537132696929009172)
    assert negative.engine_config("none", repeat=1).seed == (-537132696929009172 + 1) % 2**32
    with pytest.raises(ValueError, match="seed must be an int64 with room for 2 repeats"):
        E2EConfig(model="m", prompts="p", arms=("none",), seed=2**63 - 1, repeats=2)
    assert {(e.num_speculative_tokens, e.dtype, e.max_model_len) for e in engines.values()} == {(8, "auto", 2048)}
    assert engines["none"].speculative_config() is None and engines["none-service"].speculative_config() is None
    assert engines["suffix"].speculative_config() == {"method": "suffix", "num_speculative_tokens": 8}
    assert engines["suffix-t"].speculative_config() == {"method": "suffix", "num_speculative_tokens": 8, **tuned}
    assert engines["das-uniform"].budget == UniformBudget()
    assert engines["das"].budget == engines["das-service"].budget == budget_from_config(budget)
    assert engines["ngram"].budget == DasBudget() and engines["ngram"].speculative_config()["method"] == "ngram"
    with pytest.raises(ValueError, match="suffix_decoding_"):
        EngineConfig(model="m", suffix_options={"num_speculative_tokens": 3})


class RecordingStub(StubEngine):
    """The stub engine with a sample length per problem, remembering the order groups started in and the
    predicted length each came with."""

    def __init__(self, lengths: dict[str, int]) -> None:
        super().__init__(StubEngineConfig())
        self.lengths = lengths
        self.started: list[tuple[str, float | None]] = []
        self.curves: list[LengthCurve | None] = []

    async def generate(self, group: GroupRequest, on_progress=None):  # type: ignore[override]
        self.started.append((group.problem_id, group.predicted_tokens))
        curve = group.length_curve  # read as the engine reads it (VllmEngine._sampling_params)
        self.curves.append(None if curve is None else LengthCurve.from_dict(curve.model_dump()))
        self.config = StubEngineConfig(tokens=self.lengths[group.problem_id])
        async for sample in super().generate(group, on_progress):
            yield sample


def test_das_arms_get_the_coordinators_length_predictions() -> None:
    groups = [GroupRequest(problem_id=f"p{i}", n=2, prompt_token_ids=[1, 2], sampling={"max_tokens": 64})
              for i in range(3)]
    lengths = {"p0": 8, "p1": 30, "p2": 16}  # the stub's sample length per problem

    async def two_epochs(predict: bool) -> tuple[RecordingStub, list[EpochOutput]]:
        stub = RecordingStub(lengths)
        arm = EngineArm(stub, predict)  # type: ignore[arg-type]
        return stub, [await arm.run_epoch(groups), await arm.run_epoch(groups)]

    stub, (first, second) = asyncio.run(two_epochs(predict=True))
    # the coordinator's calls (RayBackend.place): first from an empty book, in the prompt set's order; then each
    # problem's mean length, longest first
    book = DifficultyBook()
    cold = LengthPredictor(book).predict(["p0"], [0]).mean[0]
    for pid, n in lengths.items():
        for _ in range(2):
            book.history(pid).add_length(0, n, "stop")
    warm = dict(zip(lengths, LengthPredictor(book).predict(list(lengths), [0, 0, 0]).mean))
    assert stub.started == [("p0", cold), ("p1", cold), ("p2", cold),
                            ("p1", warm["p1"]), ("p2", warm["p2"]), ("p0", warm["p0"])]
    assert warm["p1"] > warm["p2"] > warm["p0"]
    # and the curve the draft budget reads every step, from the same book
    assert stub.curves == [*LengthPredictor(DifficultyBook()).curves(["p0", "p1", "p2"]),
                           *LengthPredictor(book).curves(["p1", "p2", "p0"])]
    # outcomes come back in the prompt set's order whatever order the groups ran in
    assert [(o.group, o.sample_index) for o in second.outcomes] == [(g, j) for g in range(3) for j in range(2)]
    assert [len(o.token_ids) for o in second.outcomes] == [8, 8, 30, 30, 16, 16]
    assert first.drafts == 0
    stub, _ = asyncio.run(two_epochs(predict=False))
    assert stub.started == [(f"p{i}", None) for i in range(3)] * 2 and stub.curves == [None] * 6


def test_repeats_drift_medians_output_tests_goals_and_reports(tmp_path: Path) -> None:
    problems = reasoning_gym_problems(6)
    drift = []
    for v in (1, 2):
        (tmp_path / f"v{v}").mkdir()
        (tmp_path / f"v{v}" / "model.safetensors").write_bytes(b"")
        drift.append(str(tmp_path / f"v{v}"))
    config = E2EConfig(model="m", prompts="reasoning-gym:6", samples=8, epochs=3, repeats=3, arms=ARMS,
                       drift=tuple(drift), ignore_eos=True, suffix_tuned={"suffix_decoding_min_token_prob": 0.3})
    log: list = []

    async def factory(name: str, cfg: E2EConfig, repeat: int) -> ScriptedArm:
        assert cfg is config
        return ScriptedArm(name, repeat, problems, log)

    result = asyncio.run(run_e2e(config, problems, arm_factory=factory))

    # each repeat: every arm's epochs in turn, every arm reloading drift[e-2] as version e-1 before epoch e >= 2
    for r in range(3):
        mine = [entry[1:] for entry in log if entry[0] == r]
        expected = ([(a, "run") for a in ARMS] + [(a, "reload", drift[0], 1) for a in ARMS]
                    + [(a, "run") for a in ARMS] + [(a, "reload", drift[1], 2) for a in ARMS]
                    + [(a, "run") for a in ARMS] + [(a, "close") for a in ARMS])
        assert mine == expected
    assert len(result.runs) == 3 and all(len(run) == 3 for run in result.runs)

    medians = result.medians()
    for e in range(3):
        for arm in ARMS:
            assert medians[e][arm]["makespan_s"] == pytest.approx(MAKESPAN[arm])
            assert medians[e][arm]["tokens_per_s"] == pytest.approx(statistics.median(
                run[e][arm].tokens / run[e][arm].makespan_s for run in result.runs), rel=1e-3)
            assert medians[e][arm]["acceptance_length"] == 1.5  # 1 + 10 accepted / 20 drafts
    none = result.runs[0][0]["none"]
    assert none.reward_mean == 0.5 and result.runs[0][0]["suffix"].reward_mean == 0  # half right; none right

    tests = result.tests
    assert set(tests) == set(ARMS) - {"none"}
    assert tests["ngram"].changes_lengths and tests["ngram"].length.ks_distance == 1.0
    assert not tests["ngram"].changes_rewards
    suffix = tests["suffix"]
    assert suffix.changes_rewards and suffix.reward.ci_high < 0 and not suffix.changes_lengths
    for arm in ("suffix-t", "das-uniform", "das", "das-service", "none-service"):  # the same outputs: nothing to see
        assert not tests[arm].flagged and tests[arm].length.p_value == 1.0 and tests[arm].reward.difference == 0

    goals = {g.name.split(" makespan")[0]: g for g in result.goals() if "makespan" in g.name}
    assert goals["das / none"].ratio == pytest.approx(0.4) and goals["das / none"].counted
    best = goals["das / best suffix (suffix)"]  # the faster suffix arm; it changed the rewards, so no win
    assert best.ratio == pytest.approx(0.8) and not best.counted and "suffix" in best.note
    assert goals["das / das-uniform"].ratio == pytest.approx(0.5)
    assert goals["das-service / das"].ratio == pytest.approx(1.1)
    assert goals["das-service / none-service"].ratio == pytest.approx(0.4)  # the quick start's das against none
    never = [g for g in result.goals() if "never a loss" in g.name]
    assert len(never) == 1 and never[0].ratio == pytest.approx(2.5) and never[0].passed is True

    doc = json.loads(json.dumps(result.to_dict()))
    assert doc["tests"]["arms"]["ngram"]["changes_lengths"] is True
    assert set(doc["drafts_by_source"]) == {"das-uniform", "das", "das-service"}  # the arms with our proposer
    assert [s["live"]["proposed"] for s in doc["drafts_by_source"]["das"]] == [100, 101, 102]
    assert len(doc["runs"][2]["epochs"][1]["arms"]["das"]["lengths"]) == 48
    text = markdown(result, "das bench e2e --fake")
    assert "| 2 | das | 4.0 (4.0, 5.2, 3.2) | x0.40 |" in text
    assert "| ngram |" in text and "lengths differ" in text and "rewards differ" in text
    assert "- das-service draft tokens accepted/proposed by source: live 90/303 (30%), sealed-age-1 0/60 (0%)" in text
    assert ("das / best suffix (suffix) makespan, epochs 2-3: 0.800 (per token of the longest sample: 0.800) "
            "(not counted: output changed: suffix)") in text
    plot(result, tmp_path / "e2e.png")
    png = (tmp_path / "e2e.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def test_sequential_keeps_one_engine_alive_at_a_time() -> None:
    problems = reasoning_gym_problems(3)
    config = E2EConfig(model="m", prompts="reasoning-gym:3", samples=2, epochs=2, arms=("none", "das"),
                       sequential=True)
    log: list = []

    async def factory(name: str, cfg: E2EConfig, repeat: int) -> ScriptedArm:
        log.append((repeat, name, "start"))
        return ScriptedArm(name, repeat, problems, log, longer=48 if name == "das" else 0)

    result = asyncio.run(run_e2e(config, problems, arm_factory=factory))
    assert [entry[1:] for entry in log] == [("none", "start"), ("none", "run"), ("none", "run"), ("none", "close"),
                                            ("das", "start"), ("das", "run"), ("das", "run"), ("das", "close")]
    assert [list(row) for row in result.runs[0]] == [["none", "das"], ["none", "das"]]
    (goal,) = result.goals()
    longest = {arm: result.runs[0][1][arm].longest_tokens for arm in ("none", "das")}
    assert longest == {"none": 20 + 9 * 2 + 4 * 1, "das": 20 + 9 * 2 + 4 * 1 + 48}
    assert goal.name.startswith("das / none") and goal.ratio == pytest.approx(0.4)
    assert goal.per_longest_token == pytest.approx(0.4 * longest["none"] / longest["das"], abs=1e-3)


class DyingArm(ScriptedArm):
    """Runs `epochs_alive` epochs, then its engine is dead: every sample comes back as an error."""

    def __init__(self, *args, epochs_alive: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.epochs_alive = epochs_alive

    async def run_epoch(self, groups: list[GroupRequest]) -> EpochOutput:
        out = await super().run_epoch(groups)
        self.epochs_alive -= 1
        if self.epochs_alive >= 0:
            return out
        dead = [Outcome(o.group, o.sample_index, [], None, "error", 0.0) for o in out.outcomes]
        return EpochOutput(dead, out.makespan_s, 0, 0, 0)


def test_an_arm_that_dies_stops_the_run_and_keeps_what_finished(monkeypatch) -> None:
    problems = reasoning_gym_problems(2)
    config = E2EConfig(model="m", prompts="reasoning-gym:2", samples=2, epochs=3, arms=("none", "das", "suffix"))
    log: list = []

    async def factory(name: str, cfg: E2EConfig, repeat: int) -> ScriptedArm:
        if name == "das":
            return DyingArm(name, repeat, problems, log, epochs_alive=1)
        return ScriptedArm(name, repeat, problems, log)

    with pytest.raises(E2EFailed) as failed:
        asyncio.run(run_e2e(config, problems, arm_factory=factory))
    assert failed.value.where == "epoch 2/3 das" and "every sample failed" in failed.value.reason
    assert [(c["epoch"], c["arm"]) for c in failed.value.completed] == [(1, "none"), (1, "das"), (1, "suffix"),
                                                                        (2, "none")]
    assert failed.value.completed[1]["makespan_s"] == MAKESPAN["das"]
    assert sorted(entry[1] for entry in log if entry[2] == "close") == ["das", "none", "suffix"]  # all engines shut

    async def stops(config, problems, progress):  # the CLI on such a run: exit 1, the finished figures in the JSON
        raise E2EFailed("epoch 2/3 das", RuntimeError("every sample failed"), failed.value.completed)

    monkeypatch.setattr("das.bench.e2e.run_e2e", stops)
    monkeypatch.setattr("das.service.engine.vllm.models.prepare_model", lambda model, progress, dtype=None: Path(model))
    result = CliRunner().invoke(app, ["bench", "e2e", "--model", "m", "--prompts", "reasoning-gym:2",
                                      "--arms", "none,das", "--budget", "uniform", "--json"])
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert doc["failed"] == "epoch 2/3 das: RuntimeError: every sample failed" and len(doc["completed"]) == 4
    assert "--sequential" in result.stderr and "4 arm-epochs" in result.stderr


def test_real_engines_and_the_service_with_drift(tmp_path: Path) -> None:
    """none, das (length-aware budget) and das-service on a tiny model, greedy in float32 (so every arm must give
    the same tokens), with a perturbed checkpoint loaded before epoch 2 in every arm."""
    model = build_tiny_model(tmp_path / "tiny", prepare_model("smollm2", progress=False), vocab_size=64, seed=0,
                             sharpness=12.0)
    drifted = perturb_checkpoint(model, tmp_path / "ckpt" / "v1", scale=0.05, seed=1).path
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"name": "test", "c_base_s": 0.02, "c_tok_s": 0.0005, "source": "test"}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"problem_id": f"p{i}", "prompt_token_ids": [5, 6, 7 + i]})
                                 for i in range(3)) + "\n")
    out = CliRunner().invoke(app, [
        "bench", "e2e", "--model", str(model), "--prompts", str(prompts), "--samples", "4", "--epochs", "2",
        "--max-tokens", "24", "--temperature", "0", "--arms", "none,das,das-service", "--dtype", "float32",
        "--max-model-len", "256", "--kv-cache-gib", "1", "--eager", "--budget", f"das:{cost}",
        "--drift", str(drifted), "--plot", str(tmp_path / "e2e.png"), "--markdown", str(tmp_path / "e2e.md"),
        "--profile", "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["config"]["budget"]["policy"] == "das" and doc["config"]["budget"]["prior"]["c_base_s"] == 0.02
    (run,) = doc["runs"]
    assert [e["epoch"] for e in run["epochs"]] == [1, 2]
    for epoch in run["epochs"]:
        for name, arm in epoch["arms"].items():
            assert arm["tokens"] > 0 and arm["makespan_s"] > 0 and arm["errors"] == 0 and len(arm["lengths"]) == 12
            assert arm["reward_mean"] is None and arm["rewards"] is None  # token prompts have no checker
        assert epoch["arms"]["none"]["draft_tokens"] == 0
        assert epoch["arms"]["das-service"]["acceptance_length"] is None  # not observable through the service
    for name in ("das", "das-service"):  # the second epoch drafts from the first epoch's rollouts
        second = run["epochs"][1]["arms"][name]
        assert second["accepted_tokens"] > 0 and second["draft_tokens"] >= second["accepted_tokens"]
    assert doc["identical_outputs"] is True and doc["divergence"] == {"das": 0.0, "das-service": 0.0}
    assert doc["noise_floor"] is None  # the policy changed between the epochs
    assert set(doc["tests"]["arms"]) == {"das", "das-service"}
    assert all(t["length"]["ks_distance"] == 0 for t in doc["tests"]["arms"].values())
    assert {g["name"].split(" makespan")[0] for g in doc["goals"]} == {"das / none", "das-service / das"}
    assert doc["proposer"]["steps"] > 0
    for name in ("das", "das-service"):  # by source, both arms: the same totals as their per-epoch counts
        (by_source,) = doc["drafts_by_source"][name]
        assert "live" in by_source and all(0 <= c["accepted"] <= c["proposed"] for c in by_source.values())
        for epoch_key, source_key in (("draft_tokens", "proposed"), ("accepted_tokens", "accepted")):
            per_epoch = sum(epoch["arms"][name][epoch_key] for epoch in run["epochs"])
            assert sum(c[source_key] for c in by_source.values()) == per_epoch
    assert "das-service draft tokens accepted/proposed by source: " in (tmp_path / "e2e.md").read_text()
    for epoch in run["epochs"]:  # step profiles: the in-process arms only, their shapes as scheduled
        none, das = epoch["arms"]["none"]["profile"], epoch["arms"]["das"]["profile"]
        assert epoch["arms"]["das-service"]["profile"] is None
        assert none["steps"] >= epoch["arms"]["none"]["longest_tokens"]  # one token per request and step at most
        assert none["drafts"] == 0 and none["propose_ms"] == 0
        assert none["forward_ms"] > 0 and none["sample_ms"] > 0 and none["requests"] <= 12
        assert das["propose_ms"] > 0 and das["tokens"] >= das["requests"]
    assert run["epochs"][1]["arms"]["das"]["profile"]["drafts"] > 0
    assert run["epochs"][1]["arms"]["das"]["profile"]["steps"] <= run["epochs"][1]["arms"]["none"]["profile"]["steps"]
    assert (tmp_path / "e2e.png").read_bytes()[:4] == b"\x89PNG"
    report = (tmp_path / "e2e.md").read_text()
    assert "--drift" in report and "| 2 | das-service |" in report
    assert "Where an engine step's time goes" in report


class SeedArm:
    """Each sample's tokens are a function of its group's seed and index (as under keyed sampling); `drift` arms
    change one sample. Records the seeds of every epoch."""

    def __init__(self, name: str, seen: list) -> None:
        self.name, self.seen = name, seen

    async def run_epoch(self, groups: list[GroupRequest]) -> EpochOutput:
        self.seen.append((self.name, [g.sampling.seed for g in groups]))
        outcomes = [Outcome(g, j, [abs(group.sampling.seed) % 97, j, int(self.name == "ngram" and g == j == 0)],
                            "", "stop", 0.01) for g, group in enumerate(groups) for j in range(group.n)]
        return EpochOutput(outcomes, 1.0, draft_tokens=0, accepted_tokens=0, drafts=0)

    async def reload(self, checkpoint: str, version: int) -> None: ...

    async def proposer_stats(self) -> dict:
        return {}

    async def close(self) -> None: ...


@pytest.mark.parametrize("same_seeds", [False, True])
def test_every_arm_draws_an_epoch_with_the_same_seeds_and_identity_is_judged_at_any_temperature(same_seeds):
    problems = reasoning_gym_problems(3)
    config = E2EConfig(model="m", prompts="reasoning-gym:3", samples=2, epochs=2, repeats=2, temperature=0.8,
                       arms=("none", "das", "ngram"), same_seeds=same_seeds)
    seen: list = []

    async def factory(name: str, cfg: E2EConfig, repeat: int) -> SeedArm:
        return SeedArm(name, seen)

    result = asyncio.run(run_e2e(config, problems, arm_factory=factory))
    by_run = [seen[i:i + 3] for i in range(0, len(seen), 3)]  # (repeat, epoch): the three arms in turn
    assert len(by_run) == 4 and all(len({tuple(s) for _, s in run}) == 1 for run in by_run)  # arms alike
    seeds = [run[0][1] for run in by_run]
    assert all(len(set(s)) == 3 and None not in s for s in seeds)  # every group its own seed
    assert (seeds[0] == seeds[1]) is same_seeds and seeds[0] != seeds[2]  # epochs (unless same), repeats differ
    # ngram changed one of the six samples of every epoch
    assert result.identical_outputs is False and result.divergence == {"das": 0.0, "ngram": round(4 / 24, 4)}
    assert result.noise_floor == (0.0 if same_seeds else None)


def test_every_arm_gets_the_same_runner_on_a_gpu_and_the_output_says_which() -> None:
    from das.service.engine.runner_choice import RunnerChoice

    from das.service.engine.runner_choice import forces_v1

    config = E2EConfig(model="m", prompts="p", arms=("none", "das", "suffix"))
    engines = [config.engine_config(arm, 0) for arm in config.arms]
    # every arm keyed: V1 without async scheduling on a GPU, vLLM's choice (V1 anyway) on this CPU
    assert {(e.model_runner, e.keyed_sampling) for e in engines} == {("keyed", True)}
    assert all(forces_v1(e.model_runner, e.keyed_sampling, cpu=False) for e in engines)

    problems = reasoning_gym_problems(2)
    runners = {"none": RunnerChoice("cuda", "V1", False, True), "das": RunnerChoice("cuda", "V1", False, True)}

    async def factory(name: str, cfg: E2EConfig, repeat: int) -> ScriptedArm:
        arm = ScriptedArm(name, repeat, problems, [])
        arm.runner = runners.get(name)  # the suffix stand-in reports none: nothing is recorded for it
        return arm

    messages: list[str] = []
    result = asyncio.run(run_e2e(E2EConfig(model="m", prompts="reasoning-gym:2", samples=2, arms=("none", "das",
                                                                                                    "suffix")),
                                 problems, progress=messages.append, arm_factory=factory))
    assert result.runners == {"none": "cuda model runner V1, async scheduling off, keyed sampling",
                              "das": "cuda model runner V1, async scheduling off, keyed sampling"}
    assert result.to_dict()["runners"] == result.runners
    assert "das: cuda model runner V1, async scheduling off, keyed sampling" in messages
