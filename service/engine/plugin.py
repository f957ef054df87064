"""Our vLLM general plugin (the `vllm.general_plugins` entry point in pyproject.toml): vLLM calls `register()` in
every engine process of this environment, so every arm (none, ours, `ngram`, `suffix`) samples and verifies the
same way: the CPU fixes (cpu_fixes/plugin.py) first, then keyed sampling (keyed_sampler.py), which builds on them.
Off the CPU, keyed sampling on vLLM's CUDA paths (keyed_cuda.py; no CPU fixes there); elsewhere vLLM runs as
shipped. Everywhere, the vLLM warnings our configuration triggers knowingly are dropped from its log
(known_warnings.py)."""

from __future__ import annotations


def register() -> None:
    """vLLM general-plugin hook; idempotent (vLLM may load plugins more than once in a process)."""
    from vllm.platforms import current_platform

    from das.service.engine import known_warnings

    known_warnings.install(cpu=current_platform.is_cpu())
    if not current_platform.is_cpu():
        install_keyed_off_cpu(current_platform)
        return
    from das.service.engine import keyed_sampler
    from das.service.engine.cpu_fixes import plugin as cpu_fixes

    cpu_fixes.install()
    keyed_sampler.install()


def install_keyed_off_cpu(platform: object) -> bool:
    """Keyed sampling on a non-CPU platform (CUDA: keyed_cuda.install_cuda); True if installed."""
    from das.service.engine import keyed_cuda

    return keyed_cuda.install_off_cpu(platform)
