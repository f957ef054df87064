from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from das.scheduler.length import LengthCurve
from das.service.wire.api import (
    GroupRequest,
    HistoryRequest,
    LengthCurveSpec,
    SamplingSpec,
    WeightsRequest,
    seeded_groups,
    wire_problem,
)
from das.service.wire.sample_keys import derive


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


CURVES = [
    ((), (), 0, 1.0), ((0,), (9.0,), 20, 0.5), ((0, 10, 30), (25.0, 40.0, 60.0), 90, 0.0),
    ((1,), (5.0,), 9, 1.0), ((0, 0), (5.0, 6.0), 9, 1.0), ((0, 5), (5.0, 6.0), 9, 1.0), ((0,), (0.0,), 9, 1.0),
    ((0,), (math.inf,), 9, 1.0), ((0,), (5.0,), 0, 1.0), ((), (), 3, 1.0), ((0,), (5.0,), 9, -0.5),
    ((0,), (5.0,), 9, math.nan), ((0, 3), (5.0,), 9, 1.0),
]


@pytest.mark.parametrize("starts, ends, tail_from, tail_ratio", CURVES)
def test_the_wire_curve_takes_exactly_the_curves_the_scheduler_takes(starts, ends, tail_from, tail_ratio):
    """The wire's numpy-free checks and scheduler.length.LengthCurve's agree, valid or not."""
    try:
        LengthCurve(starts, ends, tail_from, tail_ratio)
        engine_takes = True
    except ValueError:
        engine_takes = False
    try:
        LengthCurveSpec(starts=starts, ends=ends, tail_from=tail_from, tail_ratio=tail_ratio)
        wire_takes = True
    except ValidationError:
        wire_takes = False
    assert wire_takes == engine_takes


def test_a_length_curve_travels_as_json():
    group = GroupRequest(problem_id="p", prompt="x",
                         length_curve={"starts": [0, 10], "ends": [30, 50], "tail_from": 80, "tail_ratio": 0.5})
    assert group.length_curve is not None
    assert LengthCurve.from_dict(group.length_curve.model_dump()).at(12) == 50.0  # what the engine reads
    assert GroupRequest.model_validate_json(group.model_dump_json()) == group


@pytest.mark.parametrize("sampling, loc", [
    ({"temperature": 3}, ("sampling", "temperature")),  # vLLM's limit is 2: above it the engine refuses the group
    ({"temperature": math.nan}, ("sampling", "temperature")),
    ({"top_p": math.inf}, ("sampling", "top_p")),
    ({"top_k": -2}, ("sampling", "top_k")),
    ({"top_k": 10**30}, ("sampling", "top_k")),
    ({"max_tokens": 2**31}, ("sampling", "max_tokens")),
    ({"stop": [""]}, ("sampling", "stop", 0)),
    ({"stop": ["\ud800"]}, ("sampling", "stop", 0)),
    ({"stop_token_ids": [2**40]}, ("sampling", "stop_token_ids", 0)),
])
def test_sampling_the_engine_would_refuse_is_refused_here(sampling, loc):
    with pytest.raises(ValidationError) as err:
        GroupRequest(problem_id="p", prompt="x", sampling=sampling)
    assert err.value.errors()[0]["loc"] == loc


def test_sampling_bounds_reach_vllms():
    s = SamplingSpec(temperature=2.0, top_k=-1, top_p=1e-9, max_tokens=2**31 - 1)
    assert (s.temperature, s.top_k) == (2.0, -1)


@pytest.mark.parametrize("group, loc", [
    ({"problem_id": "\ud800", "prompt": "x"}, ("problem_id",)),
    ({"problem_id": "p", "prompt": "\udc80"}, ("prompt",)),
    ({"problem_id": "p", "prompt": ""}, ("prompt",)),
    ({"problem_id": "p", "messages": [{"role": "user", "content": "a\ud800"}]}, ("messages", 0, "content")),
    ({"problem_id": "p", "prompt_token_ids": [1, 2**63]}, ("prompt_token_ids", 1)),
    ({"problem_id": "p", "prompt": "x", "predicted_tokens": math.inf}, ("predicted_tokens",)),
    ({"problem_id": "p", "prompt": "x", "length_curve": {"starts": [0, 2**64], "ends": [5, 2.0**65],
                                                          "tail_from": 2**65, "tail_ratio": 1}}, ("length_curve",)),
    ({"problem_id": "p", "prompt": "x", "length_curve": {"starts": [0], "ends": [5], "tail_from": 10**30,
                                                          "tail_ratio": 1}}, ("length_curve",)),
])
def test_what_msgpack_or_a_tokenizer_cannot_hold_is_refused(group, loc):
    with pytest.raises(ValidationError) as err:
        GroupRequest.model_validate(group)
    assert err.value.errors()[0]["loc"] == loc


@pytest.mark.parametrize("body", [
    {"path": "w", "version": 10**30},
    {"path": "w", "version": 2**63},
    {"path": "a\x00b", "version": 1},
    {"path": "\ud800", "version": 1},
])
def test_weights_requests_are_bounded(body):
    with pytest.raises(ValidationError):
        WeightsRequest.model_validate(body)
    assert WeightsRequest(path="w", version=2**63 - 1).version == 2**63 - 1


RECORD = {"problem_id": "p", "policy_version": 0, "sample_index": 0, "prompt_token_ids": [1], "output_token_ids": [2]}


@pytest.mark.parametrize("change, message", [
    ({"policy_version": 10**30}, "record 0.policy_version: integer beyond int64"),
    ({"sample_index": -(2**64)}, "record 0.sample_index: integer beyond int64"),
    ({"problem_id": "\ud800"}, "record 0.problem_id: not valid Unicode"),
    ({"reward": math.nan}, "record 0.reward: nan is not a finite number"),
    ({"output_token_ids": [1, 2**64]}, r"record 0.output_token_ids\[1\]: integer beyond int64"),
])
def test_history_records_must_be_storable(change, message):
    with pytest.raises(ValidationError, match=message):
        HistoryRequest(records=[{**RECORD, **change}])
    assert HistoryRequest(records=[RECORD]).records == [RECORD]


def test_wire_problem_names_the_part_at_fault():
    assert wire_problem({"a": [1, 2.5, "x", None, True, {"b": -(2**63)}]}) is None
    assert wire_problem({"a": [1, {"b": 2**63}]}, "r") == "r.a[1].b: integer beyond int64"
    assert wire_problem([math.inf]) == "value[0]: inf is not a finite number"
    assert wire_problem({"\udc80": 1}) == "value key: not valid Unicode (a lone UTF-16 surrogate)"


def test_a_samples_key_follows_the_groups_seed_and_its_key_index() -> None:
    group = GroupRequest(problem_id="p", n=3, prompt_token_ids=[1, 2])
    assert group.sample_key(0) is None  # no seed yet: unkeyed
    (seeded,) = seeded_groups([group], 7)
    assert seeded.sampling.seed == derive(7, 0)
    keys = [seeded.sample_key(i) for i in range(3)]
    assert keys == [derive(derive(7, 0), i) for i in range(3)] and len(set(keys)) == 3
    redrawn = seeded.model_copy(update={"n": 2, "key_indices": (2, 0)})  # what a re-dispatch sends
    assert [redrawn.sample_key(i) for i in range(2)] == [keys[2], keys[0]]
