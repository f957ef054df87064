"""Our vLLM general plugin (the `vllm.general_plugins` entry point in pyproject.toml): vLLM calls `register()` in
every engine process of this environment, so every arm (none, ours, `ngram`, `suffix`) samples and verifies the
same way. It refuses a vLLM release the service is not tested with (vllm_version.py) and applies the vLLM patches
declared in patches.py for the engine's platform: on the CPU the CPU fixes (cpu_fixes/plugin.py), then keyed
sampling (keyed_sampler.py), which builds on them; on a CUDA GPU keyed sampling's CUDA install; everywhere, the
vLLM warnings our configuration triggers knowingly are dropped from its log (known_warnings.py). It also registers
our gloo weight-transfer backend in vLLM's factories (weight_transfer.py), and in the processes vLLM starts (the engine
core, its workers) skips the garbage collector's passes of the interpreter's exit (`skip_collection_at_exit`)."""

from __future__ import annotations

import atexit
import gc
import multiprocessing

_EXIT_HOOK: list[bool] = []


def register() -> None:
    """vLLM general-plugin hook; idempotent (vLLM may load plugins more than once in a process)."""
    from vllm.platforms import current_platform

    from das.service.engine.vllm.patches import apply_patches, platform_name
    from das.service.engine.vllm_version import check_vllm_version
    from das.service.engine.vllm.weight_transfer import register_backends

    register_backends()  # the gloo weight transfer, in vLLM's two factories (weight_transfer.py)
    platform = platform_name(current_platform.is_cpu(), current_platform.device_type, current_platform.is_rocm())
    apply_patches(platform, check_vllm_version())
    skip_collection_at_exit()


def skip_collection_at_exit() -> None:
    """In a process vLLM started (a multiprocessing child: the engine core, its workers), `gc.freeze()` at exit, so
    that the interpreter's finalization does not walk every object the process holds again and again: an engine
    core on SmolLM2 holds ~700,000 (torch, vLLM, the tokenizer), and on a 2-core machine its exit after vLLM's
    teardown took 3-4 s, so a SIGTERMed core was still exiting when vLLM's process manager SIGKILLed it 5 s later;
    every engine's close and `das serve`'s stop waited those 5 s (with the freeze, ~2 s). The exit handlers still
    run and objects still go as their references do; only garbage in reference cycles is left to the process's end.
    Not in the process that runs the engine (a trainer's, `das serve`'s engine actor): its own objects are not
    ours to leave uncollected. Once per process."""
    if _EXIT_HOOK or multiprocessing.parent_process() is None:
        return
    atexit.register(gc.freeze)
    _EXIT_HOOK.append(True)
