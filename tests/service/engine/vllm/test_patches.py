"""The registry of our vLLM patches (service/engine/vllm/patches.py) and the plugin that applies it."""

from __future__ import annotations

import pytest

from das.service.engine.vllm import patches
from das.service.engine.vllm.patches import CPU, CUDA, PATCHES, PatchError, VllmPatch, apply_patches, patches_for
from das.service.engine.vllm_version import ALLOW_UNTESTED


def recording_patch(calls: list[str], platforms: frozenset[str] = frozenset({CPU})) -> VllmPatch:
    return VllmPatch("probe", ("vllm.x:y",), ("0.32.0",), platforms, calls.append, "test")


def test_apply_installs_once_and_refuses_twice() -> None:
    calls: list[str] = []
    patch = recording_patch(calls)
    patch.apply(CPU, "0.32.0+cpu")
    with pytest.raises(PatchError, match="'probe' is applied already"):
        patch.apply(CPU, "0.32.0")
    assert calls == [CPU] and patch.applied


def test_apply_refuses_another_platform_and_release(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_UNTESTED, raising=False)
    calls: list[str] = []
    patch = recording_patch(calls)
    with pytest.raises(PatchError, match="is for cpu, not cuda"):
        patch.apply(CUDA, "0.32.0")
    with pytest.raises(PatchError, match=r"written for vLLM 0\.32\.0, not 0\.33\.0"):
        patch.apply(CPU, "0.33.0")
    assert calls == [] and not patch.applied
    monkeypatch.setenv(ALLOW_UNTESTED, "1")
    patch.apply(CPU, "0.33.0")
    assert calls == [CPU]


def test_apply_patches_applies_a_platforms_patches_in_order_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    first, second = (VllmPatch(n, (), ("0.32.0",), frozenset({CPU, CUDA}), lambda p, n=n: calls.append(n), "t")
                     for n in ("a", "b"))
    gpu_only = VllmPatch("g", (), ("0.32.0",), frozenset({CUDA}), lambda p: calls.append("g"), "t")
    monkeypatch.setattr(patches, "PATCHES", (first, gpu_only, second))
    assert apply_patches(CPU, "0.32.0") == ["a", "b"]
    assert apply_patches(CPU, "0.32.0") == []  # vLLM loads plugins more than once
    assert calls == ["a", "b"]


def test_every_patch_is_declared_fully() -> None:
    names = [p.name for p in PATCHES]
    assert len(set(names)) == len(names)
    for patch in PATCHES:
        assert patch.vllm_versions and patch.platforms <= {CPU, CUDA} and patch.purpose
        assert all(t.startswith("vllm.") and ":" in t for t in patch.targets)
    assert [p.name for p in patches_for(CPU)] == ["known-warnings", "cpu-expand-kernel", "cpu-rejection-sampler",
                                                  "cpu-plain-sampler-without-drafts", "keyed-sampling-cpu"]
    assert [p.name for p in patches_for(CUDA)] == ["known-warnings", "keyed-sampling-cuda"]


def test_the_plugin_applied_the_cpu_patches_once() -> None:
    from vllm.plugins import load_general_plugins
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    load_general_plugins()
    load_general_plugins()
    assert all(p.applied for p in patches_for(CPU))
    assert not any(p.applied for p in PATCHES if CPU not in p.platforms)
    wrapped = rejection_sampler.rejection_sample.__wrapped__
    assert not hasattr(wrapped, "__wrapped__")  # wrapped once, not twice
    assert getattr(CPUModelRunner._sample, "_das_keyed", False)


def test_the_step_profiler_is_declared_here_and_installed_only_by_its_own_code(monkeypatch):
    from das.service.engine.vllm.patches import STEP_PROFILE

    assert STEP_PROFILE.name == "step-profile" and STEP_PROFILE.on_demand
    assert all(STEP_PROFILE not in patches_for(platform) for platform in (CPU, CUDA))  # not at plugin load
    assert "vllm.v1.worker.gpu_model_runner:GPUModelRunner._model_forward" in STEP_PROFILE.targets
    STEP_PROFILE.check(CPU, "0.32.0")
    monkeypatch.delenv("DAS_ALLOW_UNTESTED_VLLM", raising=False)
    with pytest.raises(PatchError, match="written for vLLM 0.32.0, not 0.33.0"):
        STEP_PROFILE.check(CUDA, "0.33.0")
    with pytest.raises(PatchError, match="not rocm"):
        STEP_PROFILE.check("rocm", "0.32.0")
    assert not STEP_PROFILE.applied


def test_rocm_is_named_apart_from_cuda_so_no_cuda_patch_reaches_its_samplers():
    from das.service.engine.vllm.patches import platform_name

    assert platform_name(True, "cpu") == CPU and platform_name(False, "cuda") == CUDA
    assert platform_name(False, "cuda", is_rocm=True) == "rocm" and platform_name(False, "xpu") == "xpu"
    assert patches_for("rocm") == [] and patches_for("xpu") == []
