"""A finished push saved as a checkpoint directory, so that an engine restarted (or joining) later loads the weights
the others serve (docs/design.md "Weight transfer: weights without the disk"). Torch only: the gloo worker that kept
the push's staged tensors writes them (service/engine/vllm/weight_transfer.py).

Layout: `<root>/v<version>/` holds `model.safetensors` (the pushed tensors, in the served checkpoint's names and the
dtypes they were pushed in) beside the served model directory's other files (config.json, the tokenizer's), so it
loads by path as any checkpoint does. It is written as `<root>/.v<version>.tmp` and renamed once complete, and
everything else under `<root>` is removed after: only the latest push is kept, and a directory named `v<N>` is
always whole (a write cut off by a death leaves only a `.tmp` that the next save removes).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

WEIGHTS_FILE = "model.safetensors"
# torch dtype -> safetensors' name; the dtypes a gloo push may carry (gloo_transfer._DTYPES)
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}
# files of the served model directory that are weights (never copied: the pushed tensors replace them)
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".pt", ".pth", ".gguf")


def save_pushed(pairs: Sequence[tuple[str, torch.Tensor]], served_model: str | Path, root: str | Path,
                version: int) -> Path:
    """Writes `pairs` (the whole push) as the checkpoint `<root>/v<version>` (module docstring) and returns its
    path; removes every other entry under `root` once it is in place."""
    root = Path(root)
    final, tmp = root / f"v{version}", root / f".v{version}.tmp"
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for source in Path(served_model).iterdir():
        if source.is_file() and not source.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy(source, tmp / source.name)
    write_safetensors(pairs, tmp / WEIGHTS_FILE)
    shutil.rmtree(final, ignore_errors=True)  # the same version saved before (a restarted service's)
    os.replace(tmp, final)
    for entry in root.iterdir():
        if entry == final:
            continue
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    return final


def write_safetensors(pairs: Sequence[tuple[str, torch.Tensor]], path: Path) -> None:
    """The safetensors format (8-byte little-endian header length, JSON header, the tensors' bytes in order),
    written a tensor at a time from the tensors' own memory: no copy of the weights, and views of one buffer (a
    packed push stages tensors as views of its chunks, which safetensors' `save_file` refuses) are fine. Fsynced
    before it returns."""
    header: dict[str, object] = {}
    offset = 0
    for name, tensor in pairs:
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the tensors' data starts 8-byte aligned, as safetensors writes it
    with path.open("wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for _, tensor in pairs:
            f.write(memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())
