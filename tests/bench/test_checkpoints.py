"""Drifted checkpoints (`das models perturb`): noise of the asked relative size, reproducible by seed, a complete
model directory, nothing written on refusal."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from das.bench.checkpoints import perturb_checkpoint
from das.service.cli import program
from das.service.engine.vllm.models import prepare_model
from tests.tiny_models import build_tiny_model

app = program()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", prepare_model("smollm2", progress=False),
                            vocab_size=64, seed=0)


def test_noise_is_relative_per_tensor_and_reproducible(tiny: Path, tmp_path: Path) -> None:
    report = perturb_checkpoint(tiny, tmp_path / "a", scale=0.1, seed=7)
    before, after = load_file(tiny / "model.safetensors"), load_file(tmp_path / "a" / "model.safetensors")
    assert report.tensors == len(before) and report.parameters == sum(t.numel() for t in before.values())
    assert report.relative_change == pytest.approx(0.1, rel=0.05)
    for name, w in before.items():
        change = (after[name] - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt()
        assert after[name].dtype == w.dtype and float(change) == pytest.approx(0.1, rel=0.2), name
    # a servable directory: config and tokenizer beside the weights
    assert {p.name for p in tiny.iterdir()} == {p.name for p in (tmp_path / "a").iterdir()}
    perturb_checkpoint(tiny, tmp_path / "b", scale=0.1, seed=7)
    perturb_checkpoint(tiny, tmp_path / "c", scale=0.1, seed=8)
    same, other = load_file(tmp_path / "b" / "model.safetensors"), load_file(tmp_path / "c" / "model.safetensors")
    assert all(torch.equal(after[n], same[n]) for n in after)
    assert not any(torch.equal(after[n], other[n]) for n in after)


def test_refusals_write_nothing(tiny: Path, tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("mine")
    with pytest.raises(ValueError, match="not an empty directory"):
        perturb_checkpoint(tiny, tmp_path / "taken", scale=0.01, seed=0)
    with pytest.raises(ValueError, match="safetensors"):
        perturb_checkpoint(tmp_path / "taken", tmp_path / "new", scale=0.01, seed=0)
    with pytest.raises(ValueError, match="scale"):
        perturb_checkpoint(tiny, tmp_path / "new", scale=-1, seed=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_cli_prints_the_new_directory(tiny: Path, tmp_path: Path) -> None:
    out = CliRunner().invoke(app, ["models", "perturb", str(tiny), str(tmp_path / "v1"), "--scale", "0.02",
                                   "--seed", "3"])
    assert out.exit_code == 0, out.output
    assert out.stdout.strip().splitlines()[-1] == str(tmp_path / "v1")
    assert (tmp_path / "v1" / "model.safetensors").exists()
    again = CliRunner().invoke(app, ["models", "perturb", str(tiny), str(tmp_path / "v1")])
    assert again.exit_code == 2 and "not an empty directory" in again.output
