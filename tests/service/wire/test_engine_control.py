"""One control message for every verb the service asks of its engines: parsed by its verb, its arguments the engine
method's (per engine where the verb says so), its replies combined as the verb says, a disagreement refused."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter, ValidationError

from das.service.wire.engine_control import (
    AbortSamples,
    AbortWeightUpdate,
    AddHistory,
    EngineControl,
    EnginesDisagree,
    FinishWeightUpdate,
    InitWeightTransfer,
    IsPaused,
    Pause,
    ReloadWeights,
    Resume,
    SaveWeightUpdate,
    ShutdownWeightTransfer,
    StartWeightUpdate,
    UpdateWeights,
)

CONTROL: TypeAdapter[EngineControl] = TypeAdapter(EngineControl)
RECORD = {"problem_id": "p", "policy_version": 0, "sample_index": 0, "prompt_token_ids": [1], "output_token_ids": [2]}
UPDATE = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2, 2]]}


@pytest.mark.parametrize("data, kind, arguments", [
    ({"verb": "pause", "mode": "keep", "clear_cache": False}, Pause, {"mode": "keep", "clear_cache": False}),
    ({"verb": "pause"}, Pause, {"mode": "abort", "clear_cache": True}),
    ({"verb": "resume"}, Resume, {}),
    ({"verb": "is_paused"}, IsPaused, {}),
    ({"verb": "abort_samples"}, AbortSamples, {}),
    ({"verb": "reload_weights", "checkpoint": "/ckpt/3", "version": 3}, ReloadWeights,
     {"checkpoint": "/ckpt/3", "version": 3}),
    ({"verb": "add_history", "rollouts": [RECORD]}, AddHistory, {"rollouts": [RECORD]}),
    ({"verb": "init_weight_transfer", "init_info": {"rank_offset": 1, "world_size": 3}}, InitWeightTransfer,
     {"init_info": {"rank_offset": 1, "world_size": 3}}),
    ({"verb": "start_weight_update"}, StartWeightUpdate, {}),
    ({"verb": "update_weights", "update_info": UPDATE}, UpdateWeights, {"update_info": UPDATE}),
    ({"verb": "update_weights", "update_info": [UPDATE, UPDATE]}, UpdateWeights, {"update_info": [UPDATE, UPDATE]}),
    ({"verb": "finish_weight_update", "version": 2}, FinishWeightUpdate, {"version": 2, "keep": False}),
    ({"verb": "save_weight_update", "root": "/state/pushed", "version": 2}, SaveWeightUpdate,
     {"root": "/state/pushed", "version": 2}),
    ({"verb": "abort_weight_update"}, AbortWeightUpdate, {}),
    ({"verb": "shutdown_weight_transfer"}, ShutdownWeightTransfer, {}),
])
def test_a_message_is_its_verb_with_the_engine_methods_arguments(data, kind, arguments) -> None:
    message = CONTROL.validate_python(data)
    assert type(message) is kind and message.arguments() == arguments
    assert CONTROL.validate_python(message.model_dump()) == message  # what crosses to an engine actor comes back


@pytest.mark.parametrize("data", [{"verb": "reboot"}, {"verb": "pause", "mode": "later"},
                                  {"verb": "resume", "mode": "keep"}, {"verb": "reload_weights", "checkpoint": "/c"},
                                  {"verb": "add_history", "rollouts": ["not a record"]},
                                  {"verb": "init_weight_transfer", "init_info": {}, "workers_per_engine": 0},
                                  {"verb": "finish_weight_update"}])
def test_an_unknown_verb_mode_or_argument_is_refused(data) -> None:
    with pytest.raises(ValidationError):
        CONTROL.validate_python(data)


def test_a_history_import_hands_the_engines_its_rollouts_as_they_are() -> None:
    rollouts = [dict(RECORD)]
    message = AddHistory(rollouts=rollouts)
    assert message.arguments()["rollouts"] is message.rollouts  # not copied per engine: an import is large


def test_each_engine_of_a_transfer_group_gets_its_own_rank_and_only_the_first_keeps_and_saves() -> None:
    join = InitWeightTransfer(init_info={"rank_offset": 5, "world_size": 11, "master_port": 7}, workers_per_engine=2)
    assert [join.arguments(e)["init_info"]["rank_offset"] for e in range(3)] == [5, 7, 9]
    assert join.arguments(1)["init_info"]["master_port"] == 7 and join.init_info["rank_offset"] == 5
    finish = FinishWeightUpdate(version=4, keep=True)
    assert [finish.arguments(e) for e in range(2)] == [{"version": 4, "keep": True}, {"version": 4, "keep": False}]
    save = SaveWeightUpdate(root="/state/pushed", version=4)
    assert save.arguments(0) == {"root": "/state/pushed", "version": 4} and save.arguments(1) is None


def test_replies_combine_as_the_verb_says() -> None:
    assert IsPaused().combine([False, True]) is True and IsPaused().combine([False, False]) is False
    assert AbortSamples().combine([2, 0, 3]) == 5
    assert Pause().combine([None, None]) is None and Resume().combine([]) is None
    assert AddHistory(rollouts=[RECORD]).combine([1, 1]) == 1 and AddHistory(rollouts=[]).combine([]) == 0
    assert ReloadWeights(checkpoint="/c", version=3).combine([3, 3]) == 3
    assert FinishWeightUpdate(version=4).combine([4]) == 4
    assert SaveWeightUpdate(root="/r", version=4).combine(["/r/v4"]) == "/r/v4"
    for step in (InitWeightTransfer(init_info={}), StartWeightUpdate(), UpdateWeights(update_info=UPDATE),
                 AbortWeightUpdate(), ShutdownWeightTransfer()):
        assert step.combine([None, None]) is None


def test_combining_a_combination_gives_the_same_answer() -> None:
    """An engine actor combines its engines' replies, the coordinator the actors': grouped or not, one answer."""
    for message, replies in [(IsPaused(), [False, True, False]), (AbortSamples(), [1, 2, 3]),
                             (AddHistory(rollouts=[]), [2, 2, 2]),
                             (ReloadWeights(checkpoint="/c", version=2), [2, 2, 2])]:
        grouped = message.combine([message.combine(replies[:2]), message.combine(replies[2:])])
        assert grouped == message.combine(replies)


def test_no_reply_leaves_a_reload_at_its_version() -> None:
    """The Ray service's engines lost during a reload catch up when they restart: the reload still stands."""
    assert ReloadWeights(checkpoint="/c", version=3).combine([]) == 3


@pytest.mark.parametrize("message, replies, says", [
    (ReloadWeights(checkpoint="/c", version=3), [3, 2],
     "reload_weights: every engine must serve policy version 3, but some serve [2]"),
    (ReloadWeights(checkpoint="/c", version=3), [4], "but some serve [4]"),
    (FinishWeightUpdate(version=5), [5, 4, 6],
     "finish_weight_update: every engine must serve policy version 5, but some serve [4, 6]"),
    (SaveWeightUpdate(root="/r", version=5), ["/r/v5", "/s/v5"], "one engine saves the push, but 2 checkpoint"),
    (SaveWeightUpdate(root="/r", version=5), [], "but 0 checkpoint paths"),
])
def test_engines_that_disagree_fail_with_what_each_serves(message, replies, says) -> None:
    with pytest.raises(EnginesDisagree) as disagreement:
        message.combine(replies)
    assert says in str(disagreement.value)
