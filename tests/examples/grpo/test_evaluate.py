"""The GRPO example's evaluation on fresh draws: scores, the arms' comparison, the checkpoint it picks."""

from __future__ import annotations

from pathlib import Path

import pytest

from das.service.client.prompt_sets import reasoning_gym_problems
from examples.grpo.evaluate import compare_arms, final_checkpoint, score


def test_score_weighs_correct_and_formatted_as_the_training_does():
    problems = reasoning_gym_problems(2)
    right = f"Final answer: {problems[0].entry['answer']}"
    completions = [[right, "no answer"], ["so the final answer is -1, maybe", "no answer"]]
    scored = score(problems, completions)
    assert [p["reward"] for p in scored["per_problem"]] == [pytest.approx(1.5 / 2), pytest.approx(0.25 / 2)]
    assert scored["correct"] == pytest.approx(0.25) and scored["formatted"] == pytest.approx((0.5 + 0.25) / 2)
    assert scored["reward"] == pytest.approx((0.75 + 0.125) / 2)


def test_the_arms_are_compared_per_run_and_per_run_and_problem():
    def policy(rewards: list[float]) -> dict:
        return {"reward": sum(rewards) / len(rewards), "per_problem": [{"reward": r} for r in rewards]}

    runs = [Path("a"), Path("b"), Path("c")]
    scores = {}
    for run, shift in zip(runs, (0.1, 0.2, 0.15)):
        scores[f"{run}/x"] = policy([0.3 + shift, 0.5 + shift])
        scores[f"{run}/y"] = policy([0.3, 0.5])
    c = compare_arms(scores, runs, ("x", "y"))
    assert c["per_run"] == pytest.approx([0.1, 0.2, 0.15]) and c["mean"] == pytest.approx(0.15)
    assert c["run_sign_flip_p"] == pytest.approx(0.25) and c["pairs"] == 6 and c["pair_sign_flip_p"] < 0.05
    assert compare_arms(scores, runs, ("y", "y"))["pair_sign_flip_p"] == 1.0


def test_the_final_checkpoint_is_the_last_step_kept(tmp_path):
    for step in (3, 10, 9):
        (tmp_path / "weights" / f"step-{step:05d}").mkdir(parents=True)
    assert final_checkpoint(tmp_path).name == "step-00010"
    with pytest.raises(FileNotFoundError, match="no weights"):
        final_checkpoint(tmp_path / "elsewhere")
