"""vLLM's pause states as the stand-in engines play them (`StubEngine`, the cluster's `StubBackend`): one copy of the
state machine, so the two cannot drift apart (docs/design.md "vLLM's RL control plane").

`mode` is None while serving, else the pause's mode: work that starts while paused is held until `resume`; under
"keep" work in flight is frozen in place; "abort" (and `abort`) bumps `abort_epoch`, so work that started before it
ends its unfinished samples with finish_reason "abort". Waiters wake on every state change."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from das.service.wire.api import PauseMode


class PauseGate:
    """One engine's pause state and the events waiters wake on. Not thread-safe: the engine's event loop owns it."""

    def __init__(self) -> None:
        self.mode: PauseMode | None = None  # None: not paused
        self.abort_epoch = 0  # bumped by every abort
        self._changed = asyncio.Event()  # replaced on every change; waiters wait on the one they saw

    def notify(self) -> None:
        """Wakes every waiter (a state change, or work the engine's own waits depend on ended)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def pause(self, mode: PauseMode) -> None:
        self.mode = mode
        if mode == "abort":
            self.abort_epoch += 1
        self.notify()

    def resume(self) -> None:
        self.mode = None
        self.notify()

    def abort(self) -> None:
        """Ends the work in flight (held work included) without pausing."""
        self.abort_epoch += 1
        self.notify()

    async def admit(self) -> int:
        """Holds new work while paused, as vLLM queues it; returns the abort epoch the work runs under (work held
        through an abort is let go at once, to end "abort")."""
        epoch = self.abort_epoch
        while self.mode is not None and self.abort_epoch == epoch:
            await self._changed.wait()
        return epoch

    async def unfrozen(self, epoch: int) -> None:
        """Returns once work of `epoch` may make progress: not under a "keep" pause, or aborted."""
        while self.mode == "keep" and self.abort_epoch == epoch:
            await self._changed.wait()

    async def until(self, done: Callable[[], bool]) -> None:
        """Returns once `done()` holds, checked on every `notify`."""
        while not done():
            await self._changed.wait()
