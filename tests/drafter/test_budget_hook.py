from __future__ import annotations

import numpy as np
import pytest

from das.drafter.budget_hook import RequestView, budget_hook_from_config


def views(*remaining: int, max_tokens: int = 1000) -> list[RequestView]:
    return [RequestView(generated=0, predicted_tokens=float(r), max_tokens=max_tokens, room=64) for r in remaining]


def test_default_is_uniform_k_max():
    hook = budget_hook_from_config({}, k_max=6)
    assert hook.name == "uniform-6"
    assert hook.draft_lengths(views(10, 500)).tolist() == [6, 6]


def test_classes_give_long_predicted_samples_more_drafts():
    hook = budget_hook_from_config({"policy": "classes", "long": 12, "medium": 6, "short": 0}, k_max=16)
    assert hook.draft_lengths(views(900, 50, 400)).tolist() == [12, 0, 6]


def test_das_policy_drafts_the_long_tail():
    hook = budget_hook_from_config({"policy": "das", "c_base_s": 6e-3, "c_tok_s": 3e-5}, k_max=16)
    lengths = hook.draft_lengths(views(*([20] * 15), 900))
    assert lengths[-1] > 0 and lengths[-1] >= lengths[:-1].max()


def test_remaining_uses_the_prediction_capped_by_max_tokens_and_at_least_one():
    assert RequestView(100, 400.0, 300, 8).remaining == 200
    assert RequestView(100, None, 300, 8).remaining == 200
    assert RequestView(500, 400.0, 600, 8).remaining == 1


@pytest.mark.parametrize("config, message", [
    ({"policy": "fastest"}, "unknown budget policy"),
    ({"policy": "uniform", "K": 3}, "unknown budget settings"),
    ({"policy": "uniform", "k": -1}, "integer >= 0"),
])
def test_bad_settings_are_named(config, message):
    with pytest.raises(ValueError, match=message):
        budget_hook_from_config(config, k_max=8)


def test_empty_batch():
    assert budget_hook_from_config({"policy": "das"}, k_max=8).draft_lengths([]).shape == (0,)
    assert np.asarray(budget_hook_from_config({}, k_max=8).draft_lengths([])).dtype == np.int32
