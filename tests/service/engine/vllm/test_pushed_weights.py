"""A finished push saved as a checkpoint directory (service/engine/vllm/pushed_weights.py): the safetensors it
writes read back bit for bit with safetensors' own reader (views of one buffer too, as a packed push stages them),
the served model's other files beside it, only the latest kept, and a half-written one never under a version's
name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from das.service.engine.vllm.gloo_transfer import checkpoint_manifest
from das.service.engine.vllm.pushed_weights import WEIGHTS_FILE, save_pushed, write_safetensors


def pairs() -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(0)
    return [("model.embed_tokens.weight", torch.randn(7, 5)), ("model.norm.weight", torch.randn(5).bfloat16()),
            ("lm_head.weight", torch.randn(3, 5).half()), ("model.scale", torch.randn(()).double())]


def served_model(tmp_path: Path) -> Path:
    model = tmp_path / "served"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (model / "tokenizer.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"the boot weights")
    (model / "model.safetensors.index.json").write_text("{}")
    return model


def test_the_file_reads_back_bit_for_bit_with_safetensors(tmp_path: Path):
    written = pairs()
    write_safetensors(written, tmp_path / "w.safetensors")
    read = load_file(tmp_path / "w.safetensors")
    assert list(read) == [name for name, _ in written]
    for name, tensor in written:
        assert read[name].dtype == tensor.dtype and torch.equal(read[name], tensor)


def test_views_of_one_buffer_are_written_as_separate_tensors(tmp_path: Path):
    chunk = torch.arange(32, dtype=torch.float32)
    views = [("a", chunk[:12].view(3, 4)), ("b", chunk[16:24]), ("c", chunk[28:].view(2, 2))]
    write_safetensors(views, tmp_path / "w.safetensors")
    read = load_file(tmp_path / "w.safetensors")
    assert all(torch.equal(read[name], tensor) for name, tensor in views)


def test_a_saved_push_is_a_checkpoint_with_the_served_models_other_files(tmp_path: Path):
    path = save_pushed(pairs(), served_model(tmp_path), tmp_path / "pushed", 3)
    assert path == tmp_path / "pushed" / "v3"
    assert sorted(p.name for p in path.iterdir()) == ["config.json", WEIGHTS_FILE, "tokenizer.json"]
    assert checkpoint_manifest(path) == {name: tuple(t.shape) for name, t in pairs()}
    assert json.loads((path / "config.json").read_text()) == {"architectures": ["LlamaForCausalLM"]}


def test_only_the_latest_push_is_kept_and_a_cut_off_write_is_swept(tmp_path: Path):
    model, root = served_model(tmp_path), tmp_path / "pushed"
    save_pushed(pairs(), model, root, 1)
    (root / ".v2.tmp").mkdir()  # a write cut off by a death
    (root / ".v2.tmp" / WEIGHTS_FILE).write_bytes(b"half")
    latest = save_pushed(pairs(), model, root, 4)
    assert [p.name for p in root.iterdir()] == ["v4"]
    assert torch.equal(load_file(latest / WEIGHTS_FILE)["model.norm.weight"], pairs()[1][1])


def test_a_failed_write_leaves_no_version_directory(tmp_path: Path):
    model, root = served_model(tmp_path), tmp_path / "pushed"
    kept = save_pushed(pairs(), model, root, 1)
    with pytest.raises(KeyError):  # an int tensor: not a dtype a push carries
        save_pushed([*pairs(), ("bad", torch.zeros(2, dtype=torch.int32))], model, root, 2)
    assert sorted(p.name for p in root.iterdir()) == [".v2.tmp", "v1"]  # the next save sweeps the .tmp
    assert checkpoint_manifest(kept) == {name: tuple(t.shape) for name, t in pairs()}
