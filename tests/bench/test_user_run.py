"""`das bench serve`: real `das serve` processes (stub engines: no model), the user's epochs against each, the
medians and ratios it reports."""

from __future__ import annotations

import json
import socket

import pytest
from typer.testing import CliRunner

from das.service.cli import program
from das.bench.user_run import UserRunConfig, UserRunResult
from das.service.client.rollout_run import EpochFigures

app = program()


def figures(makespans: list[float], tokens: int = 1000, longest: int = 100, critical: int = 100) -> list[EpochFigures]:
    return [EpochFigures(e + 1, m, 16, tokens, 0, 0, 0, [0], longest, critical) for e, m in enumerate(makespans)]


def test_medians_over_repeats_and_ratios_to_the_first_arm():
    result = UserRunResult(UserRunConfig(arms=("none", "das"), repeats=3, epochs=2), "reasoning-gym:2", {
        "none": [figures([10, 20]), figures([12, 22]), figures([11, 100])],
        "das": [figures([8, 10], critical=50), figures([9, 11], longest=50, critical=50), figures([30, 12])],
    })
    assert [m["makespan_s"] for m in result.medians("none")] == [11, 22]
    assert [m["makespan_s"] for m in result.medians("das")] == [9, 11]
    ratios = result.ratios("das")
    assert ratios[0]["makespan_s"] == pytest.approx(9 / 11) and ratios[1]["makespan_s"] == pytest.approx(0.5)
    assert ratios[1]["tokens_per_s"] == pytest.approx((1000 / 11) / (1000 / 22))
    # per longest-sample token: das epoch 2 medians 0.10, 0.22, 0.12 s per token; none 0.2, 0.22, 1.0
    assert ratios[1]["s_per_longest_token"] == pytest.approx(0.12 / 0.22)
    # per critical-path step: das epoch 2 medians 0.20, 0.22, 0.12 s per step; none as per longest token
    assert ratios[1]["s_per_critical_step"] == pytest.approx(0.20 / 0.22)
    assert "| das | 2 | 11.0 |" in result.markdown()
    assert json.loads(json.dumps(result.to_dict()))["ratios"]["none"][0]["makespan_s"] == 1.0


def test_paired_ratios_divide_each_repeat_by_the_baselines_same_repeat():
    result = UserRunResult(UserRunConfig(arms=("none", "das", "none@2"), repeats=3, epochs=2), "code:2", {
        "none": [figures([10, 20]), figures([12, 22]), figures([11, 100])],
        "das": [figures([8, 10]), figures([18, 11]), figures([11, 50])],
        "none@2": [figures([10, 21]), figures([12, 22]), figures([12, 90])],
    })
    das = result.paired("das")
    assert das[0]["makespan"]["each"] == [0.8, 1.5, 1.0] and das[0]["makespan"]["median"] == 1.0
    assert (das[0]["makespan"]["min"], das[0]["makespan"]["max"]) == (0.8, 1.5)
    # tokens/s ratios are the inverse of makespan ratios at equal tokens (the same samples)
    assert das[1]["tokens_per_s"]["each"] == [2.0, 2.0, 2.0]
    # the ratio of medians differs from the median of paired ratios: das epoch 1 medians 11 / 11, pairs 1.0
    assert result.ratios("das")[0]["makespan_s"] == pytest.approx(1.0)
    floor = result.paired("none@2")
    assert floor[1]["makespan"]["each"] == [1.05, 1.0, 0.9]
    doc = json.loads(json.dumps(result.to_dict()))
    assert set(doc["paired"]) == {"das", "none@2"} and doc["paired"]["das"][0]["makespan"]["median"] == 1.0
    assert "| none@2 | 2 | 1.000 (0.900-1.050) |" in result.markdown()


@pytest.mark.parametrize("arms", [("none", "das", "none"), ("none", "das", "ngram@2"), ("none", "das@1"),
                                  ("none", "oracle", "oracle@2"), ("none", "none@x")])
def test_a_second_run_of_an_arm_must_name_an_arm_in_the_run(arms):
    with pytest.raises(ValueError, match="ARM@"):
        UserRunConfig(arms=arms)


def test_a_second_run_serves_as_its_arm():
    from das.bench.user_run import served_arm

    assert served_arm("none@2") == "none" and served_arm("das") == "das"
    assert UserRunConfig(arms=("none", "das", "none@2")).order(1) == ("none@2", "das", "none")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_runs_real_servers_per_arm_and_prints_the_ratios(tmp_path):
    out = tmp_path / "run.md"
    result = CliRunner().invoke(app, [
        "bench", "serve", "--arms", "none,das", "--problems", "reasoning-gym:2", "--samples", "2", "--epochs", "2",
        "--repeats", "1", "--max-tokens", "16", "--port", str(_free_port()), "--serve-args", "--stub-engine",
        "--log-dir", str(tmp_path / "logs"), "--markdown", str(out), "--profile", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout[result.stdout.index("{"):])
    for arm in ("none", "das"):
        (run,) = doc["runs"][arm]
        assert [e["samples"] for e in run] == [4, 4] and all(e["output_tokens"] > 0 for e in run)
    assert doc["ratios"]["none"][1]["makespan_s"] == 1.0 and doc["ratios"]["das"][1]["makespan_s"] > 0
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["metrics-das-1.txt", "metrics-none-1.txt",
                                                                      "serve-das-1.log", "serve-none-1.log"]
    assert "das_engine_runner_info" in (tmp_path / "logs" / "metrics-das-1.txt").read_text()
    assert "| das | 2 |" in out.read_text() and doc["paired"]["das"][1]["makespan"]["each"][0] > 0


def test_step_profiles_are_medians_over_repeats_and_feed_the_simulators_host_price(tmp_path):
    from rich.console import Console

    from das.bench.server_profile import host_ms_from

    def summary(host: float, model: float) -> dict:
        return {"runner": "V1", "async_scheduling": False, "profiled_steps": 100, "host_ms_per_step": host,
                "model_ms_per_step": model, "parts_ms_per_step": {"forward_ms": model + 1.0, "model_ms": model,
                                                                  "sample_ms": 2.0, "propose_ms": 0.5,
                                                                  "budget_ms": 0.1, "rest_ms": 0.2, "gap_ms": 1.0}}

    result = UserRunResult(UserRunConfig(arms=("none", "das"), repeats=3, epochs=1, profile=True), "code:2",
                           {"none": [figures([10])] * 3, "das": [figures([9])] * 3},
                           profiles={"none": [summary(4.0, 20.0), summary(5.0, 21.0), {}],
                                     "das": [summary(6.0, 20.0), summary(8.0, 22.0), summary(7.0, 30.0)]})
    rows = {row["arm"]: row for row in result.step_profiles()}
    assert rows["none"]["repeats"] == 2 and rows["none"]["host_ms_per_step"] == 4.5  # a repeat without figures
    assert rows["das"]["host_ms_per_step"] == 7.0 and rows["das"]["model_ms_per_step"] == 22.0
    report = tmp_path / "serve.json"
    report.write_text(json.dumps(result.to_dict()))
    assert host_ms_from(str(report)) == 7.0
    console = Console(record=True, width=200)
    result.print(console)
    assert "where a step's time goes" in console.export_text()
