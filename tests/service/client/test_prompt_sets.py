from __future__ import annotations

import json

import pytest

from das.service.client.code_tasks import CODE_TASKS
from das.service.client.prompt_sets import REASONING_GYM_DATASETS, PromptSetError, extract_answer, load_prompt_set


def write(tmp_path, *lines: object):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_the_three_prompt_forms_and_blank_lines(tmp_path):
    path = write(tmp_path, {"problem_id": "a", "prompt": "hi"}, "",
                 {"problem_id": "b", "prompt_token_ids": [1, 2]},
                 {"problem_id": "c", "messages": [{"role": "user", "content": "x"}]})
    problems = load_prompt_set(str(path))
    assert [p.problem_id for p in problems] == ["a", "b", "c"]
    assert problems[1].prompt_token_ids == (1, 2) and problems[2].messages == ({"role": "user", "content": "x"},)


@pytest.mark.parametrize("line, message", [
    ("{not json", ":1: not JSON"),
    ([1, 2], ":1: expected a JSON object"),
    ({"problem_id": "a"}, "exactly one"),
    ({"problem_id": "a", "prompt": "x", "tokens": 3}, ":1: tokens"),
])
def test_bad_lines_name_file_and_line(tmp_path, line, message):
    with pytest.raises(PromptSetError, match=message):
        load_prompt_set(str(write(tmp_path, line)))


def test_duplicate_ids_empty_files_and_bad_sources(tmp_path):
    with pytest.raises(PromptSetError, match=":2: problem_id 'a' appears twice"):
        load_prompt_set(str(write(tmp_path, {"problem_id": "a", "prompt": "x"}, {"problem_id": "a", "prompt": "y"})))
    with pytest.raises(PromptSetError, match="no problems"):
        load_prompt_set(str(write(tmp_path, "")))
    with pytest.raises(PromptSetError, match="reasoning-gym:<count>"):
        load_prompt_set("reasoning-gym:many")
    with pytest.raises(PromptSetError, match="code:<count>"):
        load_prompt_set("code:")
    for count in ("0", str(len(CODE_TASKS) + 1)):
        with pytest.raises(PromptSetError, match="count must be 1-12"):
            load_prompt_set(f"code:{count}")
    with pytest.raises(PromptSetError, match="No such file"):
        load_prompt_set(str(tmp_path / "missing.jsonl"))


def test_reasoning_gym_problems_are_reproducible_chat_prompts():
    a, b = load_prompt_set("reasoning-gym:4"), load_prompt_set("reasoning-gym:4")
    assert a == b and len({p.problem_id for p in a}) == 4
    assert all(p.messages and p.messages[-1]["role"] == "user" for p in a)


def test_code_tasks_are_chat_prompts_holding_a_python_definition():
    problems = load_prompt_set(f"code:{len(CODE_TASKS)}")
    assert [p.problem_id for p in problems] == [f"code/{name}" for name, _ in CODE_TASKS]
    assert load_prompt_set("code:3") == problems[:3]
    for problem, (_, task) in zip(problems, CODE_TASKS, strict=True):
        system, user = problem.messages
        assert system["role"] == "system" and user["role"] == "user" and task in user["content"]
        assert not problem.scorable
        last = task.splitlines()[-1]
        body = " " * (len(last) - len(last.lstrip()) + 4 * last.endswith(":")) + "..."
        compile(f"{task}\n{body}\n", problem.problem_id, "exec")  # each task is a definition up to its body


@pytest.mark.parametrize("text, answer", [
    ("4 + 3 = 7.\nFinal answer: 7", "7"),
    ("first 12, then Final Answer: **-1,234** (checked 99)", "-1234"),
    ("Final answer: 3. Wait. Final answer: 5", "5"),
    ("so the result is \\boxed{42} and 7 more steps", "42"),
    ("the sum is 10, or maybe 11", "11"),
    ("I do not know", None),
])
def test_answer_extraction(text, answer):
    assert extract_answer(text) == answer


def test_reasoning_gym_problems_are_scored_by_their_dataset_checker(tmp_path):
    problems = load_prompt_set("reasoning-gym:3")
    assert [p.entry["metadata"]["source_dataset"] for p in problems] == list(REASONING_GYM_DATASETS)
    for p in problems:
        right = p.entry["answer"]
        assert p.score(f"Let me think.\nFinal answer: {right}") == 1.0
        assert p.score(f"Final answer: {int(float(right)) + 1}") < 1.0
        assert p.score("no idea") == 0.0 and p.score(None) == 0.0
    (plain,) = load_prompt_set(str(write(tmp_path, {"problem_id": "a", "prompt": "hi"})))
    assert not plain.scorable
    with pytest.raises(ValueError, match="no checker"):
        plain.score("Final answer: 1")
