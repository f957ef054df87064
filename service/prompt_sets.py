"""Prompt sets for benchmarks: a JSONL file, or problems generated from the `reasoning-gym` package.

File format: one JSON object per line, `problem_id` plus exactly one of `messages` (chat; the model's template is
applied), `prompt` (text) or `prompt_token_ids`. Blank lines are skipped; an error names the file and line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from das.service.api_types import GroupRequest, SamplingSpec

REASONING_GYM_PREFIX = "reasoning-gym:"
SYSTEM_PROMPT = ("You are a careful math assistant. Reason step by step, then give the final answer on the last "
                 "line in the form 'Final answer: <number>'.")
REASONING_GYM_DATASETS = ("chain_sum", "basic_arithmetic", "gsm_symbolic")


class PromptSetError(ValueError):
    """A prompt set that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class Problem:
    """One problem of a prompt set: its id and one prompt form (exactly one of the three is set)."""

    problem_id: str
    messages: tuple[dict[str, str], ...] | None = None
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None

    def group(self, n: int, sampling: SamplingSpec) -> GroupRequest:
        return GroupRequest(problem_id=self.problem_id, n=n, sampling=sampling, messages=self.messages,
                            prompt=self.prompt, prompt_token_ids=self.prompt_token_ids)


def load_prompt_set(source: str) -> list[Problem]:
    """`reasoning-gym:N` (N problems spread over three reasoning-gym datasets, seed 42) or a JSONL path."""
    if source.startswith(REASONING_GYM_PREFIX):
        try:
            count = int(source[len(REASONING_GYM_PREFIX):])
        except ValueError:
            raise PromptSetError(f"{source!r}: expected reasoning-gym:<count>") from None
        return reasoning_gym_problems(count)
    return read_prompt_file(Path(source))


def read_prompt_file(path: Path) -> list[Problem]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptSetError(f"{path}: {exc}") from None
    problems: list[Problem] = []
    seen: set[str] = set()
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            raw: Any = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptSetError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(raw, dict):
            raise PromptSetError(f"{where}: expected a JSON object")
        try:  # the group model checks the fields and the one-prompt rule
            group = GroupRequest.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "line"
            raise PromptSetError(f"{where}: {field}: {first['msg']}") from None
        if group.problem_id in seen:
            raise PromptSetError(f"{where}: problem_id {group.problem_id!r} appears twice")
        seen.add(group.problem_id)
        problems.append(Problem(group.problem_id,
                                tuple(m.model_dump() for m in group.messages) if group.messages else None,
                                group.prompt, group.prompt_token_ids))
    if not problems:
        raise PromptSetError(f"{path}: no problems")
    return problems


def reasoning_gym_problems(count: int, seed: int = 42) -> list[Problem]:
    """`count` chat problems, round-robin over REASONING_GYM_DATASETS, ids `<dataset>/<index>`."""
    if count < 1:
        raise PromptSetError(f"reasoning-gym: count must be >= 1, got {count}")
    import reasoning_gym

    per = -(-count // len(REASONING_GYM_DATASETS))
    datasets = {name: reasoning_gym.create_dataset(name, size=per, seed=seed) for name in REASONING_GYM_DATASETS}
    problems = []
    for i in range(count):
        name = REASONING_GYM_DATASETS[i % len(REASONING_GYM_DATASETS)]
        entry = datasets[name][i // len(REASONING_GYM_DATASETS)]
        problems.append(Problem(f"{name}/{i // len(REASONING_GYM_DATASETS)}",
                                messages=({"role": "system", "content": SYSTEM_PROMPT},
                                          {"role": "user", "content": entry["question"]})))
    return problems
