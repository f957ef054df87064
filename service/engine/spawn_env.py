"""Environment variables an engine core process inherits: set while it is configured and spawned, restored after.

vLLM reads several settings only from the environment of the process it spawns (the CPU KV cache size, the process
layout, the preloaded libraries), so the settings of one engine are set around its spawn and must not leak into the
next engine or the caller."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager


@contextmanager
def restored_environ(names: Iterable[str]) -> Iterator[None]:
    """Within: change the variables `names` freely; on exit each is back to its value on entry (unset if it was)."""
    saved = {name: os.environ.get(name) for name in names}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
