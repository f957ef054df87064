"""The vLLM GPU wheel of the pinned release, read as source: fetched once with `pip download --no-deps` into a
cache (DAS_VLLM_GPU_CACHE, default ~/.cache/das-vllm-gpu), never installed (its CUDA build cannot sit beside the
CPU build). `Sources` reads its .py files from the zip; `Sources.mutated` is a copy with one file's text changed,
which the contract tests use to show that each check fails when the vLLM behaviour it checks changes."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Callable

from das.service.engine.vllm_version import TESTED_VLLM

PINNED = TESTED_VLLM[0]
CACHE_ENV = "DAS_VLLM_GPU_CACHE"
DOWNLOAD_TIMEOUT_S = 1800


class WheelUnavailable(RuntimeError):
    """The GPU wheel could not be fetched (the message says why and how to fetch it by hand)."""


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "das-vllm-gpu")


@cache
def gpu_wheel(version: str = PINNED) -> Path:
    """The path of vllm-<version>'s x86-64 Linux wheel, downloaded into cache_dir() on first use."""
    folder = cache_dir()
    pattern = f"vllm-{version}-*manylinux*x86_64.whl"
    found = sorted(folder.glob(pattern))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--platform", "manylinux_2_28_x86_64", "--python-version", "3.11", f"vllm=={version}", "-d",
               str(folder)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise WheelUnavailable(f"`{' '.join(command)}` took over {DOWNLOAD_TIMEOUT_S} s") from exc
    found = sorted(folder.glob(pattern))
    if done.returncode != 0 or not found:
        raise WheelUnavailable(f"could not fetch the vLLM {version} GPU wheel the contract tests read: "
                               f"`{' '.join(command)}` exited {done.returncode}: {done.stderr.strip()[-2000:]} "
                               f"(put the wheel in {folder} or point {CACHE_ENV} at a folder holding it)")
    return found[0]


@dataclass(frozen=True)
class Sources:
    """vLLM's Python sources from a wheel; paths relative to the `vllm` package ("v1/worker/gpu_worker.py")."""

    wheel: Path
    changed: dict[str, str] = field(default_factory=dict)

    def text(self, path: str) -> str:
        if path in self.changed:
            return self.changed[path]
        return _read(self.wheel, path)

    def tree(self, path: str) -> ast.Module:
        return ast.parse(self.text(path), filename=f"vllm/{path}")

    def mutated(self, path: str, change: Callable[[str], str]) -> Sources:
        """A copy with `path`'s text replaced by change(text); the change must change something."""
        before = self.text(path)
        after = change(before)
        assert after != before, f"the mutation of {path} changed nothing"
        return Sources(self.wheel, {**self.changed, path: after})


@cache
def _read(wheel: Path, path: str) -> str:
    with zipfile.ZipFile(wheel) as archive:
        return archive.read(f"vllm/{path}").decode()
