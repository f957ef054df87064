"""Our vLLM general plugin (the `vllm.general_plugins` entry point in pyproject.toml): vLLM calls `register()` in
every engine process of this environment, so every arm (none, ours, `ngram`, `suffix`) samples and verifies the
same way. It refuses a vLLM release the service is not tested with (vllm_version.py) and applies the vLLM patches
declared in patches.py for the engine's platform: on the CPU the CPU fixes (cpu_fixes/plugin.py), then keyed
sampling (keyed_sampler.py), which builds on them; on a CUDA GPU keyed sampling's CUDA install; everywhere, the
vLLM warnings our configuration triggers knowingly are dropped from its log (known_warnings.py). It also registers
our gloo weight-transfer backend in vLLM's factories (weight_transfer.py)."""

from __future__ import annotations


def register() -> None:
    """vLLM general-plugin hook; idempotent (vLLM may load plugins more than once in a process)."""
    from vllm.platforms import current_platform

    from das.service.engine.vllm.patches import apply_patches, platform_name
    from das.service.engine.vllm_version import check_vllm_version
    from das.service.engine.vllm.weight_transfer import register_backends

    register_backends()  # the gloo weight transfer, in vLLM's two factories (weight_transfer.py)
    platform = platform_name(current_platform.is_cpu(), current_platform.device_type, current_platform.is_rocm())
    apply_patches(platform, check_vllm_version())
