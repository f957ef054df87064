"""The drafter's settings as a service validates them (drafter/config.py): the fields of DrafterConfig, its checks."""

from __future__ import annotations

from dataclasses import fields

import pytest
from pydantic import ValidationError

from das.drafter.config import MATCH_CONTEXT, DrafterConfig, DrafterSettings


def test_the_settings_have_every_field_of_the_config_and_no_other():
    assert set(DrafterSettings.model_fields) == {f.name for f in fields(DrafterConfig)}


def test_unset_fields_take_the_configs_defaults_and_the_depth_follows_the_draft_length():
    config = DrafterSettings(window=2).config(16)
    assert config == DrafterConfig(max_depth=16 + MATCH_CONTEXT, window=2)


@pytest.mark.parametrize("settings, field", [({"window": 0}, "window"), ({"min_prob": 2.0}, "min_prob"),
                                             ({"max_depth": 300}, "max_depth"), ({"windw": 2}, "windw")])
def test_bad_settings_fail_when_validated_naming_the_field(settings, field):
    with pytest.raises(ValidationError, match=field):
        DrafterSettings.model_validate(settings)
