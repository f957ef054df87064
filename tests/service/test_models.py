"""Model preparation: names, paths and errors (the GGUF conversion itself runs in the fixture recorder)."""

from __future__ import annotations

import pytest

from das.service.models import known_models, prepare_model


def test_unknown_names_list_the_known_ones(tmp_path):
    with pytest.raises(ValueError) as err:
        prepare_model("no-such-model", data_dir=tmp_path, progress=False)
    assert "smollm2" in str(err.value) and "smollm2" in known_models()


def test_a_model_directory_is_used_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert prepare_model(str(tmp_path), progress=False) == tmp_path


def test_a_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        prepare_model(str(tmp_path), progress=False)


def test_cli_models_list_and_prepare_errors(tmp_path):
    from typer.testing import CliRunner

    from das.service.cli import app

    listed = CliRunner().invoke(app, ["models", "list"])
    assert listed.exit_code == 0 and "smollm2" in listed.stdout.split()
    (tmp_path / "config.json").write_text("{}")
    ok = CliRunner().invoke(app, ["models", "prepare", str(tmp_path)])
    assert ok.exit_code == 0 and ok.stdout.strip() == str(tmp_path)
    bad = CliRunner().invoke(app, ["models", "prepare", "no-such-model"])
    assert bad.exit_code == 2 and "smollm2" in bad.output
