"""`das bench gpu-check`'s verdicts and report (bench/gpu_check.py) on made-up batches and samples."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from das.bench.gpu_check import (ArmBatch, Check, GpuCheckConfig, GpuCheckReport, control_plane_check, e2e_check,
                                 identity_check, kill_check)
from das.service.wire.api import SampleRecord


def sample(problem: str, index: int, tokens: list[int], finish: str = "length", version: int = 0,
           drafted: int = 0, accepted: int = 0) -> SampleRecord:
    return SampleRecord(group_index=0, problem_id=problem, sample_index=index, output_token_ids=tokens, text=None,
                        finish_reason=finish, policy_version=version, draft_tokens=drafted,
                        accepted_tokens=accepted, latency_s=0.1)


SAME = [sample("p", 0, [1, 2, 3]), sample("p", 1, [4, 5]), sample("q", 0, [6])]


def batch(arm: str, samples: list[SampleRecord], seconds: float = 2.0) -> ArmBatch:
    return ArmBatch.of(arm, samples, seconds)


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
    report = GpuCheckReport(GpuCheckConfig(), "NVIDIA H100", [batch("none", SAME), batch("das", SAME)],
                            [Check("a", True, "fine"), Check("b", True, "fine")])
    assert report.passed
    data = json.loads(json.dumps(report.to_dict()))
    assert data["passed"] and data["arms"][0] == {"arm": "none", "makespan_s": 2.0, "tokens": 6, "draft_tokens": 0,
                                                  "accepted_tokens": 0, "errors": 0, "tokens_per_s": 3.0}
    console = Console(record=True, width=160)
    report.print(console)
    text = " ".join(console.export_text().split())  # titles wrap
    assert "das bench gpu-check on NVIDIA H100" in text and "acceptance checks: all passed" in text
    report.checks.append(Check("c", False, "broken"))
    assert not report.passed and not report.to_dict()["passed"]
    assert not GpuCheckReport(GpuCheckConfig(), "cpu").passed  # no check run is no pass


def test_config_refuses_greedy() -> None:
    with pytest.raises(ValueError, match="temperature must be > 0"):
        GpuCheckConfig(temperature=0)
