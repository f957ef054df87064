"""The GRPO example's comparison: its two permutation tests and the summary it writes from the arms' step logs."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from examples.grpo.report import compare, compare_seeds, paired_sign_flip_p, slope_permutation_p


def test_sign_flip_p_is_exact_for_small_samples():
    # all 5 differences positive: only the all-+ and all-- assignments are as extreme, 2 of 32
    assert paired_sign_flip_p(np.array([1.0, 2.0, 1.5, 0.5, 1.0])) == pytest.approx(2 / 32)
    assert paired_sign_flip_p(np.array([1.0, -1.0, 1.0, -1.0])) == 1.0
    assert paired_sign_flip_p(np.arange(1.0, 21.0)) < 0.001  # n > 16: drawn assignments


def test_slope_p_separates_a_trend_from_noise():
    slope, p = slope_permutation_p(np.linspace(0.0, 1.0, 10))
    assert slope == pytest.approx(1 / 9) and p < 0.001
    flat_slope, flat_p = slope_permutation_p(np.array([0.5, 0.1, 0.4, 0.2, 0.3, 0.3, 0.2, 0.4, 0.1, 0.5]))
    assert flat_slope == pytest.approx(0.0, abs=1e-9) and flat_p > 0.3


def _write_arm(out: Path, arm: str, rewards: list[float], seconds: list[float]) -> None:
    (out / arm).mkdir(parents=True)
    lines = []
    for step, (reward, s) in enumerate(zip(rewards, seconds, strict=True), start=1):
        sources = {"sealed-age-1": {"proposed": 10, "accepted": 4}, "live": {"proposed": 5, "accepted": 1}}
        lines.append(json.dumps({"step": step, "reward": reward, "sync": {"reload_s": 1.0, "policy_version": step},
                                 "rollout": {"seconds": s, "completion_tokens": 1000, "longest_tokens": 100,
                                             "samples": 16, "draft_tokens": 15 if arm == "das" else 0,
                                             "accepted_tokens": 5 if arm == "das" else 0,
                                             "policy_versions": [step - 1],
                                             "drafts_by_source": sources if arm == "das" else {}}}))
    (out / arm / "steps.jsonl").write_text("\n".join(lines) + "\n")


def test_compare_writes_the_summary_and_the_plot(tmp_path):
    _write_arm(tmp_path, "das", [0.1, 0.2, 0.3, 0.4], [8.0, 8.0, 9.0, 9.0])
    _write_arm(tmp_path, "none", [0.1, 0.25, 0.3, 0.35], [10.0, 10.0, 10.0, 10.0])
    summary = compare(tmp_path, ["das", "none"], Console(file=io.StringIO()))
    das, paired = summary["arms"]["das"], summary["paired"]
    assert das["policy_version_advances_every_step"] and das["accepted_from_earlier_policies"] == 16
    assert paired["rollout_seconds_ratio"] == pytest.approx(34 / 40)
    assert paired["reward_difference_mean"] == pytest.approx(0.0, abs=1e-12) and paired["sign_flip_p"] == 1.0
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert (tmp_path / "grpo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_seeds_tests_the_difference_per_seed_and_per_step(tmp_path):
    runs = []
    for seed, shift in enumerate((0.0, 0.1, -0.05)):
        run = tmp_path / f"seed{seed}"
        base = [0.1 + shift, 0.2 + shift, 0.3 + shift, 0.5 + shift]
        _write_arm(run, "das-coupled", [r + 0.1 for r in base], [8.0] * 4)
        _write_arm(run, "das", base + [0.9], [8.0] * 5)  # a step more: cut to the common steps
        runs.append(run)
    summary = compare_seeds(runs, ("das-coupled", "das"), tmp_path / "out", Console(file=io.StringIO()))
    assert summary["steps"] == 4 and summary["pairs"] == 12
    assert summary["seed_difference_mean"] == pytest.approx(0.1)
    assert summary["seed_sign_flip_p"] == pytest.approx(0.25)  # 3 seeds: 2 of 8 sign assignments as extreme
    assert summary["pair_sign_flip_p"] < 0.001
    assert summary["mean_curve"]["das"] == pytest.approx([0.1 + 0.05 / 3, 0.2 + 0.05 / 3, 0.3 + 0.05 / 3,
                                                         0.5 + 0.05 / 3])
    assert json.loads((tmp_path / "out" / "seeds.json").read_text()) == summary
    assert (tmp_path / "out" / "seeds.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    same = compare_seeds(runs, ("das", "das"), tmp_path / "same", Console(file=io.StringIO()))
    assert same["seed_sign_flip_p"] == 1.0 and same["pair_sign_flip_p"] == 1.0
