"""Verifiable rewards for the GRPO example, in TRL's reward-function shape: `f(completions, problem_id, **_)` ->
one float per completion. The problems are reasoning-gym arithmetic (`das.service.client.prompt_sets`), whose system
prompt asks for the answer on the last line as 'Final answer: <number>'.

- `correct`: 1.0 when the answer the text gives is right by the dataset's own checker (`Problem.score`, lenient:
  the number after the last "Final answer", else the last number).
- `formatted`: 1.0 when the last non-empty line is exactly 'Final answer: <number>', so the answer can be read
  without guessing; 0.5 when the text at least states a number after "final answer" somewhere ("so the final
  answer is 7"); else 0. A tiny model mostly rambles past its token budget at first, so this graded reward is the
  one it can learn within a few steps; `correct` is the one that matters.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from das.service.client.prompt_sets import Problem, states_final_answer

_FORMAT = re.compile(r"^\s*final answer:\s*-?\d[\d,]*(?:\.\d+)?\s*\.?\s*$", re.IGNORECASE)


def completion_text(completion: str | Sequence[Mapping[str, Any]]) -> str:
    """The text of a TRL completion: a string, or (conversational prompts) a list of messages ending with the
    assistant's."""
    if isinstance(completion, str):
        return completion
    return str(completion[-1].get("content") or "") if completion else ""


def is_formatted(text: str) -> bool:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return bool(lines) and _FORMAT.match(lines[-1]) is not None


def format_score(text: str) -> float:
    """1.0 in the asked form, 0.5 for a final answer stated some other way, else 0 (module docstring)."""
    return 1.0 if is_formatted(text) else 0.5 if states_final_answer(text) else 0.0


class Rewards:
    """The two reward functions over one problem set (TRL passes the dataset's `problem_id` column to each)."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self._problems = {problem.problem_id: problem for problem in problems}

    def correct(self, completions: Sequence[Any], problem_id: Sequence[str], **_: Any) -> list[float]:
        return [self._problems[pid].score(completion_text(c)) for c, pid in zip(completions, problem_id, strict=True)]

    def formatted(self, completions: Sequence[Any], **_: Any) -> list[float]:
        return [format_score(completion_text(c)) for c in completions]
