"""Synthetic policy drift: checkpoints made from a model by adding small Gaussian noise to its weights.

An RL run changes the policy a little every step; `das bench e2e --drift` reloads such checkpoints between epochs
so the drafters see a policy that moves. `perturb_checkpoint(src, dst, scale, seed)` writes a complete model
directory (the config and tokenizer files copied, every safetensors file rewritten) in which each floating-point
tensor w becomes w + scale * rms(w) * N(0, 1), elementwise, in float32 and cast back to w's dtype. The noise is
relative to each tensor's RMS so one `scale` means the same for embeddings (RMS ~0.02) and norms (RMS ~1); the
same seed gives the same checkpoint.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PerturbReport:
    """What perturb_checkpoint wrote. relative_change: RMS of (new - old) over RMS of old, over all perturbed
    parameters (about `scale`, less the rounding of low-precision dtypes)."""

    path: Path
    tensors: int
    parameters: int
    relative_change: float


def perturb_checkpoint(src: Path, dst: Path, scale: float, seed: int) -> PerturbReport:
    """Writes `dst` (must not exist, or be an empty directory) from the model directory `src`. ValueError for a
    source without safetensors or a negative scale."""
    import torch
    from safetensors.torch import load_file, save_file

    if scale < 0:
        raise ValueError(f"scale must be >= 0, got {scale}")
    weights = sorted(src.glob("*.safetensors"))
    if not src.is_dir() or not weights:
        raise ValueError(f"{src}: not a directory with *.safetensors weights")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"{dst}: exists and is not an empty directory")
    dst.parent.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = parameters = 0
    old_sq = diff_sq = 0.0
    # Written beside the target and renamed into place, so an interrupted run leaves no half checkpoint at dst.
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}-", dir=dst.parent))
    try:
        for item in src.iterdir():
            if item.suffix != ".safetensors" and item.is_file():
                shutil.copy2(item, tmp / item.name)
        for path in weights:
            state = load_file(path)
            for name, w in state.items():
                if not w.is_floating_point():
                    continue
                old = w.float()
                rms = float(old.pow(2).mean().sqrt())
                noise = torch.randn(old.shape, generator=generator) * (scale * rms)
                state[name] = (old + noise).to(w.dtype)
                tensors += 1
                parameters += old.numel()
                old_sq += float(old.pow(2).sum())
                diff_sq += float((state[name].float() - old).pow(2).sum())
            save_file(state, tmp / path.name, metadata={"format": "pt"})
        if dst.exists():
            dst.rmdir()
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PerturbReport(dst, tensors, parameters, (diff_sq / old_sq) ** 0.5 if old_sq else 0.0)
