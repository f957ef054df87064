"""Prompt sets for benchmarks: a JSONL file, problems generated from the `reasoning-gym` package, or the bundled
code tasks (`code:N`, service/client/code_tasks.py).

File format: one JSON object per line, `problem_id` plus exactly one of `messages` (chat; the model's template is
applied), `prompt` (text) or `prompt_token_ids`. Blank lines are skipped; an error names the file and line.

reasoning-gym problems keep their dataset entry, so `Problem.score(text)` rates a model's answer with the
dataset's own checker (`score_answer`). The answer is taken from the text as the number after the last "Final
answer" (what SYSTEM_PROMPT asks for) or in the last `\\boxed{}`, else the last number in the text: a lenient
extraction, the same for every arm of a benchmark.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from das.service.client.code_tasks import CODE_SYSTEM_PROMPT, CODE_TASKS
from das.service.wire.api import GroupRequest, SamplingSpec

REASONING_GYM_PREFIX = "reasoning-gym:"
CODE_PREFIX = "code:"
SYSTEM_PROMPT = ("You are a careful math assistant. Reason step by step, then give the final answer on the last "
                 "line in the form 'Final answer: <number>'.")
REASONING_GYM_DATASETS = ("chain_sum", "basic_arithmetic", "gsm_symbolic")


class PromptSetError(ValueError):
    """A prompt set that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class Problem:
    """One problem of a prompt set: its id and one prompt form (exactly one of the three is set). `entry`: the
    reasoning-gym dataset entry (question, answer, metadata naming its source dataset), None for file prompts."""

    problem_id: str
    messages: tuple[dict[str, str], ...] | None = None
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    entry: dict[str, Any] | None = field(default=None, hash=False)

    def group(self, n: int, sampling: SamplingSpec) -> GroupRequest:
        return GroupRequest(problem_id=self.problem_id, n=n, sampling=sampling, messages=self.messages,
                            prompt=self.prompt, prompt_token_ids=self.prompt_token_ids)

    @property
    def scorable(self) -> bool:
        return self.entry is not None

    def score(self, text: str | None) -> float:
        """The reward of an answer text in [0, 1] by the source dataset's checker (0 when no answer is found).
        ValueError for a problem without an entry."""
        if self.entry is None:
            raise ValueError(f"problem {self.problem_id!r} has no checker (not a reasoning-gym problem)")
        import reasoning_gym

        check = reasoning_gym.get_score_answer_fn(self.entry["metadata"]["source_dataset"])
        return float(check(extract_answer(text or ""), self.entry))


_FINAL_ANSWER = re.compile(r"final\s+answer\b[^\n\d]*?(-?\d[\d,]*(?:\.\d+)?)", re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\{\s*(-?\d[\d,]*(?:\.\d+)?)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def states_final_answer(text: str) -> bool:
    """Whether the text gives a number after "final answer" (what SYSTEM_PROMPT asks for), in any wording."""
    return _FINAL_ANSWER.search(text) is not None


def extract_answer(text: str) -> str | None:
    """The number a model's text gives as its answer (commas dropped), or None: after the last "Final answer",
    else in the last \\boxed{}, else the last number in the text."""
    for pattern in (_FINAL_ANSWER, _BOXED, _NUMBER):
        found = pattern.findall(text)
        if found:
            return found[-1].replace(",", "")
    return None


def load_prompt_set(source: str) -> list[Problem]:
    """`reasoning-gym:N` (N problems spread over three reasoning-gym datasets, seed 42), `code:N` (the first N
    bundled code tasks) or a JSONL path."""
    for prefix, make in ((REASONING_GYM_PREFIX, reasoning_gym_problems), (CODE_PREFIX, code_problems)):
        if source.startswith(prefix):
            try:
                count = int(source[len(prefix):])
            except ValueError:
                raise PromptSetError(f"{source!r}: expected {prefix}<count>") from None
            return make(count)
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
        messages = tuple(m.model_dump(exclude_none=True) for m in group.messages) if group.messages else None
        problems.append(Problem(group.problem_id, messages, group.prompt, group.prompt_token_ids))
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
                                          {"role": "user", "content": entry["question"]}), entry=dict(entry)))
    return problems


def code_problems(count: int) -> list[Problem]:
    """The first `count` bundled code tasks as chat problems, ids `code/<name>`; no checker (`scorable` False)."""
    if not 1 <= count <= len(CODE_TASKS):
        raise PromptSetError(f"code: count must be 1-{len(CODE_TASKS)} (the bundled tasks), got {count}")
    return [Problem(f"code/{name}", messages=({"role": "system", "content": CODE_SYSTEM_PROMPT},
                                              {"role": "user", "content": f"```python\n{task}\n```"}))
            for name, task in CODE_TASKS[:count]]
