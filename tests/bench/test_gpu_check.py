"""`das bench gpu-check`'s verdicts and report (bench/gpu_check.py) on made-up batches and samples."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from das.bench import gpu_check
from das.bench.gpu_check import (PLAIN, ArmBatch, Check, GpuCheckConfig, GpuCheckReport, arm_flags, control_plane_check,
                                 default_arms, e2e_check, host_time_check, identity_check, kill_check,
                                 plain_comparison, runner_check)
from das.service.wire.api import SampleRecord


def sample(problem: str, index: int, tokens: list[int], finish: str = "length", version: int = 0,
           drafted: int = 0, accepted: int = 0) -> SampleRecord:
    return SampleRecord(group_index=0, problem_id=problem, sample_index=index, output_token_ids=tokens, text=None,
                        finish_reason=finish, policy_version=version, draft_tokens=drafted,
                        accepted_tokens=accepted, latency_s=0.1)


SAME = [sample("p", 0, [1, 2, 3]), sample("p", 1, [4, 5]), sample("q", 0, [6])]


V1 = {"runner": "V1", "async_scheduling": False, "keyed": True, "host_ms_per_step": 1.5, "model_ms_per_step": 6.0}
V2 = {"runner": "V2", "async_scheduling": True, "keyed": False, "host_ms_per_step": None, "model_ms_per_step": None}


def batch(arm: str, samples: list[SampleRecord], seconds: float = 2.0, engine: dict | None = None) -> ArmBatch:
    return ArmBatch.of(arm, samples, seconds, engine)


def test_arm_batches_count_tokens_drafts_and_errors() -> None:
    b = batch("das", [sample("p", 0, [1, 2, 3], drafted=4, accepted=2), sample("p", 1, [], finish="error")])
    assert (b.tokens, b.draft_tokens, b.accepted_tokens, b.errors) == (3, 4, 2, 1)
    assert b.tokens_per_s == 1.5 and b.tokens_of == {"p/0": [1, 2, 3], "p/1": []}


def test_identity_passes_only_when_every_arm_drew_the_baselines_tokens() -> None:
    good = [batch("none", SAME), batch("suffix", SAME), batch("das", SAME)]
    assert identity_check(good, 3).passed
    changed = [*SAME[:2], sample("q", 0, [7])]
    verdict = identity_check([batch("none", SAME), batch("das", changed)], 3)
    assert not verdict.passed and "das: 1 samples differ from none (first q/0)" in verdict.detail
    assert not identity_check([batch("none", SAME), batch("das", SAME[:2])], 3).passed  # a sample missing
    assert not identity_check([batch("das", SAME)], 3).passed  # no baseline
    assert not identity_check([batch("none", SAME)], 3).passed  # nothing compared


def test_e2e_needs_every_arm_complete_without_errors() -> None:
    arms = ("none", "suffix", "das")
    assert e2e_check([batch(a, SAME) for a in arms], 3, arms).passed
    verdict = e2e_check([batch("none", SAME), batch("das", [*SAME[:2], sample("q", 0, [], "error")])], 3, arms)
    assert not verdict.passed and "suffix: did not run" in verdict.detail and "das: 1 error samples" in verdict.detail


def test_control_plane_verdicts() -> None:
    held = [sample("p", 0, [1], version=1), sample("p", 1, [2], version=1)]
    assert control_plane_check(0, True, 1, held, 2, False).passed
    leaked = control_plane_check(1, True, 1, held, 2, False)
    assert not leaked.passed and "1 samples arrived while paused" in leaked.detail
    failed = control_plane_check(0, True, 1, [held[0], sample("p", 1, [], "error", 1)], 2, False)
    assert not failed.passed and "1 errors" in failed.detail  # the 0.33 behaviour: a batch sent while paused fails
    assert not control_plane_check(0, False, 1, held, 2, False).passed
    assert not control_plane_check(0, True, None, held, 2, False).passed
    assert not control_plane_check(0, True, 1, held, 2, True).passed
    old = control_plane_check(0, True, 2, held, 2, False)
    assert not old.passed and "new policy version" in old.detail


def test_kill_verdicts() -> None:
    assert kill_check([123], SAME, 3).passed
    assert not kill_check([], SAME, 3).passed
    assert not kill_check([123], SAME[:2], 3).passed


def test_report_passes_only_with_every_check_passed_and_prints_and_serialises() -> None:
    report = GpuCheckReport(GpuCheckConfig(), "NVIDIA H100", [batch("none", SAME, 2.0, V1), batch("das", SAME, 1.0, V1),
                                                              batch(PLAIN, SAME[:1], 1.6, V2)],
                            [Check("a", True, "fine"), Check("b", True, "fine")], ["suffix: not importable"])
    assert report.passed
    data = json.loads(json.dumps(report.to_dict()))
    assert data["passed"] and data["arms"][0] == {
        "arm": "none", "makespan_s": 2.0, "tokens": 6, "draft_tokens": 0, "accepted_tokens": 0, "errors": 0,
        "tokens_per_s": 3.0, "compared": True, "runner": "V1", "async_scheduling": False, "host_ms_per_step": 1.5,
        "keyed": True, "model_ms_per_step": 6.0}
    assert data["arms"][2]["compared"] is False and data["arms"][2]["runner"] == "V2"
    assert data["skipped"] == ["suffix: not importable"]
    assert data["plain_vllm"]["das_over_plain_makespan"] == 0.625  # 1.0 s against 1.6 s
    console = Console(record=True, width=200)
    report.print(console)
    text = " ".join(console.export_text().split())  # titles wrap
    assert "das bench gpu-check on NVIDIA H100" in text and "acceptance checks: all passed" in text
    assert "skipped suffix: not importable" in text and "das against plain vLLM (V2, async scheduling on" in text
    report.checks.append(Check("c", False, "broken"))
    assert not report.passed and not report.to_dict()["passed"]
    assert not GpuCheckReport(GpuCheckConfig(), "cpu").passed  # no check run is no pass


def test_config_refuses_greedy() -> None:
    with pytest.raises(ValueError, match="temperature must be > 0"):
        GpuCheckConfig(temperature=0)


def test_the_compared_arms_must_share_one_keyed_runner() -> None:
    assert runner_check([batch("none", SAME, engine=V1), batch("das", SAME, engine=V1),
                         batch(PLAIN, SAME, engine=V2)]).passed  # the plain arm is not compared
    mixed = runner_check([batch("none", SAME, engine=V2 | {"keyed": True}), batch("das", SAME, engine=V1)])
    assert not mixed.passed and "runners differ" in mixed.detail
    unkeyed = runner_check([batch("none", SAME, engine=V1 | {"keyed": False}), batch("das", SAME, engine=V1)])
    assert not unkeyed.passed and "none: samples not keyed" in unkeyed.detail
    assert not runner_check([batch("none", SAME), batch("das", SAME, engine=V1)]).passed  # none reported no runner


def test_identity_leaves_the_plain_arm_out_and_host_time_must_be_measured_for_every_compared_arm() -> None:
    other = [sample("p", 0, [9]), *SAME[1:]]
    assert identity_check([batch("none", SAME), batch("das", SAME), batch(PLAIN, other)], 3).passed
    assert host_time_check([batch("none", SAME, engine=V1), batch("das", SAME, engine=V1),
                            batch(PLAIN, SAME, engine=V2)]).passed
    missing = host_time_check([batch("none", SAME, engine=V1), batch("das", SAME, engine=V2)])
    assert not missing.passed and "not measured for das" in missing.detail
    assert plain_comparison([batch("none", SAME), batch("das", SAME)]) is None  # no plain arm ran


def test_arms_default_to_none_and_das_plus_suffix_where_it_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_check, "suffix_unavailable", lambda: "--speculation suffix needs arctic-inference (x)")
    arms, skipped = default_arms()
    assert arms == ("none", "das") and skipped == ["suffix: --speculation suffix needs arctic-inference (x)"]
    with pytest.raises(ValueError, match="arms: --speculation suffix needs arctic-inference"):
        GpuCheckConfig(arms=("none", "das", "suffix"))
    monkeypatch.setattr(gpu_check, "suffix_unavailable", lambda: None)
    assert default_arms() == (("none", "das", "suffix"), [])
    assert GpuCheckConfig(arms=("das", "suffix", "none")).order == ("none", "suffix", PLAIN, "das")
    assert GpuCheckConfig(arms=("none", "das"), plain=False).order == ("none", "das")


@pytest.mark.parametrize("arms", [("none",), ("das", "suffix"), ("none", "das", "eagle"), ("none", "das", "das")])
def test_arms_need_none_and_das_and_known_methods(arms: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="arms"):
        GpuCheckConfig(arms=arms)


def test_every_arm_is_profiled_and_only_the_plain_arm_leaves_the_runner_to_vllm() -> None:
    assert arm_flags("das") == ("--speculation", "das", "--profile-steps")
    assert arm_flags(PLAIN) == ("--speculation", "none", "--model-runner", "auto", "--profile-steps")


def test_suffix_unavailable_names_the_package_when_it_does_not_import(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "arctic_inference", None)  # None in sys.modules: import raises ImportError
    reason = gpu_check.suffix_unavailable()
    assert reason is not None and "needs arctic-inference, which cannot be imported" in reason
    assert "requirements/peers.txt" in reason
