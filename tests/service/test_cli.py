"""`das serve --engine-options`: engine settings no flag sets, merged into the flags' settings; a clash with a flag,
bad JSON or a bad value is refused before anything starts."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from das.service.cli import app, merge_engine_options

FLAGS = {"model": "smollm2", "num_speculative_tokens": 8, "budget": {"policy": "das"}}


def test_options_merge_into_nested_settings_and_add_new_ones():
    merged = merge_engine_options(FLAGS, '{"budget": {"per_token": true}, "drafter": {"min_prob": 0.05}}')
    assert merged == {**FLAGS, "budget": {"policy": "das", "per_token": True}, "drafter": {"min_prob": 0.05}}
    assert FLAGS["budget"] == {"policy": "das"}  # the flags' dict is not changed


@pytest.mark.parametrize(("options", "message"), [
    ('{"budget": {"policy": "uniform"}}', "budget.policy is set by a flag"),
    ('{"num_speculative_tokens": 4}', "num_speculative_tokens is set by a flag"),
    ('{"budget": ', "not JSON"),
    ("[1, 2]", "must be a JSON object"),
])
def test_a_clash_with_a_flag_or_bad_json_is_refused(options, message):
    with pytest.raises(ValueError, match=message):
        merge_engine_options(FLAGS, options)


@pytest.mark.parametrize(("args", "message"), [
    (["--engine-options", '{"k": 3'], "not JSON"),
    (["--engine-options", '{"drafter": {"min_prob": 7}}'], "min_prob"),
    (["--engine-options", '{"budget": {"policy": "uniform"}}'], "use the flag"),
    (["--stub-engine", "--engine-options", "{}"], "the stub engine takes none"),
])
def test_das_serve_refuses_bad_engine_options_before_starting(args, message):
    result = CliRunner().invoke(app, ["serve", "--port", "1", *args])
    assert result.exit_code != 0
    assert message in " ".join(result.output.split())
