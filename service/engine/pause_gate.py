"""vLLM's pause states (POST /pause, /resume: docs/design.md "vLLM's RL control plane") in one state machine, used by
the stand-in engine (`StubEngine`) that plays an engine's pause, and by the service's
holders of new work: the gateway (new batches), the coordinator (every dispatch to an engine actor, re-dispatches
after a death included) and each engine actor (what reached it while a pause was on its way). Each holder is paused
before the engines it feeds and resumed after they resume.

`mode` is None while serving, else the pause's mode: work that starts while paused is held until `resume`; under
"keep" work in flight is frozen in place; "abort" (and `abort`) bumps `abort_epoch`, so work that started before it
ends its unfinished samples with finish_reason "abort". Waiters wake on every state change.

Two waits for new work: an engine's (`admit`) lets work held through an abort go at once, to end "abort", as vLLM's
engine does; the service's holders (`resumed`) keep it until resume whatever aborts pass. Why the service holds work
and not vLLM's queue: vLLM 0.32 (CPU and GPU wheels alike) queues a request added while paused until resume, but a
vLLM that rejects new requests while paused (the audit of issue 45 read vLLM 0.33 so: `reject_new_requests` under
"abort" and "wait") ends such a request at once with finish_reason "error". Work the service holds reaches an engine
only once its engines have resumed, so the README's promise (held until /resume) holds on either behaviour, and for
an engine re-paused after a restart."""

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

    @property
    def paused(self) -> bool:
        return self.mode is not None

    async def resumed(self) -> None:
        """Returns once not paused (at once while serving), whatever aborts pass: the service's holders' wait."""
        while self.mode is not None:
            await self._changed.wait()

    async def unfrozen(self, epoch: int) -> None:
        """Returns once work of `epoch` may make progress: not under a "keep" pause, or aborted."""
        while self.mode == "keep" and self.abort_epoch == epoch:
            await self._changed.wait()

    async def until(self, done: Callable[[], bool]) -> None:
        """Returns once `done()` holds, checked on every `notify`."""
        while not done():
            await self._changed.wait()
