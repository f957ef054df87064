from __future__ import annotations

import pytest
from pydantic import ValidationError

from das.service.api import GroupRequest, SamplingSpec


def test_a_group_needs_exactly_one_prompt_form():
    assert GroupRequest(problem_id="p", prompt="hi").n == 1
    with pytest.raises(ValidationError, match="exactly one"):
        GroupRequest(problem_id="p")
    with pytest.raises(ValidationError, match="exactly one"):
        GroupRequest(problem_id="p", prompt="hi", prompt_token_ids=[1])
    with pytest.raises(ValidationError, match="empty"):
        GroupRequest(problem_id="p", prompt_token_ids=[])


@pytest.mark.parametrize("group", [
    {"problem_id": "p", "prompt": "x", "n": 0},
    {"problem_id": "p", "prompt": "x", "sampling": {"max_tokens": 0}},
    {"problem_id": "p", "prompt": "x", "sampling": {"temprature": 0.5}},
    {"problem_id": "p", "prompt": "x", "sampling": {"top_p": 0}},
    {"problem_id": "", "prompt": "x"},
    {"problem_id": "p", "messages": [{"role": "robot", "content": "x"}]},
    {"problem_id": "p", "prompt": "x", "priority": 3},
    {"problem_id": "p", "prompt": "x", "length_curve": {"starts": [1], "ends": [5], "tail_from": 9, "tail_ratio": 1}},
    {"problem_id": "p", "prompt": "x", "length_curve": {"starts": [0], "ends": [5], "tail_from": 9}},
    {"problem_id": "p", "prompt": "x",
     "length_curve": {"starts": list(range(5000)), "ends": list(range(1, 5001)), "tail_from": 5000, "tail_ratio": 1}},
])
def test_bad_groups_are_rejected_with_the_field_named(group):
    with pytest.raises(ValidationError) as err:
        GroupRequest.model_validate(group)
    assert err.value.errors()[0]["loc"]


def test_sampling_defaults():
    s = SamplingSpec()
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.stop) == (256, 1.0, 1.0, 0, ())
    assert SamplingSpec(stop=["\n\n"]).stop == ("\n\n",)


def test_a_length_curve_travels_as_json():
    group = GroupRequest(problem_id="p", prompt="x",
                         length_curve={"starts": [0, 10], "ends": [30, 50], "tail_from": 80, "tail_ratio": 0.5})
    assert group.length_curve is not None and group.length_curve.at(12) == 50.0
    assert GroupRequest.model_validate_json(group.model_dump_json()) == group
