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
