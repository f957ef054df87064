"""The GRPO example's rewards: the dataset's own checker for `correct`, the asked last line for `formatted`."""

from __future__ import annotations

from das.service.client.prompt_sets import reasoning_gym_problems
from examples.grpo.rewards import Rewards, completion_text, is_formatted


def test_formatted_means_the_last_line_is_the_asked_form():
    assert is_formatted("3 + 4 = 7.\nFinal answer: 7")
    assert is_formatted("work\n\nfinal answer: -1,024.  \n\n")
    assert not is_formatted("Final answer: 7\nand some more words")
    assert not is_formatted("The final answer is 7.")
    assert not is_formatted("Final answer: seven")
    assert not is_formatted("")


def test_correct_uses_the_datasets_checker_per_problem():
    problems = reasoning_gym_problems(2)
    rewards = Rewards(problems)
    right = [f"Final answer: {p.entry['answer']}" for p in problems]
    ids = [p.problem_id for p in problems]
    assert rewards.correct(right, problem_id=ids) == [1.0, 1.0]
    assert rewards.correct(list(reversed(right)), problem_id=ids) != [1.0, 1.0]
    chat = [[{"role": "assistant", "content": text}] for text in right]  # TRL's conversational completions
    assert rewards.correct(chat, problem_id=ids) == [1.0, 1.0]
    assert rewards.formatted(chat) == [1.0, 1.0] and rewards.formatted(["no answer"]) == [0.0]
    assert rewards.formatted(["so the final answer is 7, I think"]) == [0.5]
    assert completion_text([]) == ""
