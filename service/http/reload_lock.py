"""`ReloadLock`: the gateway's batches against a weight change (a checkpoint reload, or a push from
/start_weight_update to its finish), as a readers-writer lock: batches share it, a weight change holds it alone.

A lock, not a pause (service/engine/pause_gate.py `PauseGate`, which the gateway's hold of new batches is): a pause
is a state that /pause and /resume set from outside, with a mode and abort epochs, that no one holds and that counts
nothing; this lock is taken and released by its holders, and a weight change waits for the batches holding it to
end. The two compose: a new batch passes the pause hold (`resumed`), then takes this lock shared. A weight change
under a pause does not wait for the running batches (`drain` False): their samples are held by the pause, and go on
under the new weights once resumed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class ReloadLock:
    """Batches run concurrently; a weight change runs alone. A change first stops new batches from starting, then
    waits for the running ones to end, so it is never starved and no batch sees two policy versions."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._running = 0
        self._reloading = False

    @contextlib.asynccontextmanager
    async def batch(self) -> AsyncIterator[None]:
        """Held shared for a batch's run: waits while a weight change holds the lock."""
        async with self._cond:
            await self._cond.wait_for(lambda: not self._reloading)
            self._running += 1
        try:
            yield
        finally:
            async with self._cond:
                self._running -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def reload(self, drain: bool = True) -> AsyncIterator[None]:
        """Held alone for a weight change. `drain` False: without waiting for the running batches (the engines are
        paused, docs/design.md "vLLM's RL control plane")."""
        async with self._cond:
            await self._cond.wait_for(lambda: not self._reloading)
            self._reloading = True
            try:
                if drain:
                    await self._cond.wait_for(lambda: self._running == 0)
            except BaseException:
                self._reloading = False
                self._cond.notify_all()
                raise
        try:
            yield
        finally:
            async with self._cond:
                self._reloading = False
                self._cond.notify_all()
