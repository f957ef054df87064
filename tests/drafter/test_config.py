"""The drafter's configuration (drafter/config.py): defaults, the depth fitted to the draft length, its checks."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from das.drafter.config import MATCH_CONTEXT, DrafterConfig


def test_unset_fields_take_the_defaults_and_the_depth_follows_the_draft_length():
    config = DrafterConfig(window=2).sized_for(16)
    assert config == DrafterConfig(max_depth=16 + MATCH_CONTEXT, window=2)
    assert DrafterConfig(max_depth=40).sized_for(16).max_depth == 40


def test_the_fields_set_cross_to_an_engine_as_plain_data_and_come_back_equal():
    sent = DrafterConfig(window=2, min_prob=0.05)
    assert sent.given() == {"window": 2, "min_prob": 0.05}
    assert DrafterConfig.model_validate(sent.given()).sized_for(8) == sent.sized_for(8)


@pytest.mark.parametrize("settings, field", [({"window": 0}, "window"), ({"min_prob": 2.0}, "min_prob"),
                                             ({"max_depth": 300}, "max_depth"), ({"windw": 2}, "windw"),
                                             ({"token_budget": 10, "global_tokens": 11}, "global_tokens")])
def test_bad_settings_fail_when_validated_naming_the_field(settings, field):
    with pytest.raises(ValidationError, match=field):
        DrafterConfig.model_validate(settings)
