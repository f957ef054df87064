"""`PauseHold`: where the service keeps new work while generation is paused (vLLM's RL control plane, POST /pause).

Why the service holds it and not vLLM's queue: vLLM 0.32 (CPU and GPU wheels alike) queues a request added while
paused until resume, but a vLLM that rejects new requests while paused (the audit of issue 45 read vLLM 0.33 so:
`reject_new_requests` under "abort" and "wait") ends such a request at once with finish_reason "error". Work held
here reaches an engine only once its engines have resumed, so the README's promise (held until /resume) holds on
either behaviour, and for an engine re-paused after a restart. The gateway holds new batches, the coordinator every
dispatch to an engine actor (re-dispatches after a death included), and each engine actor what reached it while a
pause was on its way. Each holder is paused before the engines it feeds and released after they resume.
"""

from __future__ import annotations

import asyncio


class PauseHold:
    """A gate for new work: open unless paused. Created open; `pause` closes it, `release` opens it; `wait`
    returns at once while open, else when it opens. Not thread-safe: one event loop."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    def pause(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    async def wait(self) -> None:
        """Returns once the gate is open (at once if it is)."""
        await self._open.wait()
