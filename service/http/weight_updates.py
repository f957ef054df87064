"""A weight push through the gateway (vLLM's weight transfer; routes in rl_control.py): `WeightUpdates` holds the
one push that may be open, from /start_weight_update to /finish_weight_update, as a checkpoint reload holds the
gateway's reload lock (reload_lock.py) for its one call: new batches wait, running ones finish first unless the
service is paused (then their held samples go on under the new weights and carry `policy_spans`), and the policy
version moves once, on every engine, at the finish.

A push that fails (a refused name or shape, a peer of the group dead, the trainer gone) is given up on every engine
and the lock released: every engine serves the version it served before. A trainer that opens a push and then
neither updates nor finishes it within `idle_s` (it died between calls) has its push given up the same way, so
batches are not held forever. Each step reaches the engines as a control message (service/wire/engine_control.py)
through the backend's `control`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

from das.service.cluster.rollout_backend import RolloutBackend, WeightUpdateConflict
from das.service.engine.contract import EngineInputError
from das.service.wire.engine_control import (
    AbortWeightUpdate,
    FinishWeightUpdate,
    InitWeightTransfer,
    ShutdownWeightTransfer,
    StartWeightUpdate,
    UpdateWeights,
)
from das.service.wire.weight_transfer import update_bytes

log = logging.getLogger(__name__)


@dataclass
class _Push:
    lock: contextlib.AsyncExitStack  # the reload lock, held alone until the push ends
    start_s: float = field(default_factory=time.perf_counter)
    bytes: int = 0
    idle: asyncio.TimerHandle | None = None


@dataclass(frozen=True)
class PushResult:
    """A finished push: the version served, seconds from its start (the wait for running batches included), the
    bytes of its tensors."""

    policy_version: int
    seconds: float
    bytes: int


class WeightUpdates:
    """The gateway's side of pushes. `lock()` takes the reload lock alone (service/http/reload_lock.py `ReloadLock`,
    drained unless paused); `on_finish(result)` records a finished push (metrics)."""

    def __init__(self, backend: RolloutBackend, lock: Callable[[], AbstractAsyncContextManager[None]],
                 on_finish: Callable[[PushResult], None], idle_s: float) -> None:
        self._backend = backend
        self._lock = lock
        self._on_finish = on_finish
        self._idle_s = idle_s
        self._push: _Push | None = None
        self._turn = asyncio.Lock()  # one call at a time changes the push's state

    @property
    def open(self) -> bool:
        return self._push is not None

    async def init(self, init_info: dict[str, Any]) -> None:
        async with self._turn:
            if self._push is not None:
                raise WeightUpdateConflict("a weight update is open: finish it before joining a new group")
            await self._backend.control(InitWeightTransfer(init_info=init_info))

    async def start(self) -> None:
        async with self._turn:
            if self._push is not None:
                raise WeightUpdateConflict("a weight update is already open: call /finish_weight_update first")
            lock = contextlib.AsyncExitStack()
            await lock.enter_async_context(self._lock())
            try:
                await self._backend.control(StartWeightUpdate())
            except BaseException:
                await lock.aclose()
                raise
            self._push = _Push(lock)
            self._arm()

    async def update(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        async with self._turn:
            push = self._open()
            try:
                size = update_bytes(update_info)
            except ValueError as exc:
                await self._give_up()
                raise EngineInputError(str(exc)) from None
            try:
                await self._backend.control(UpdateWeights(update_info=update_info))
            except BaseException:
                await self._give_up()
                raise
            push.bytes += size
            self._arm()

    async def finish(self, weight_version: str | None) -> PushResult:
        """Ends the push: every engine loads what it received and serves `weight_version` (an integer newer than
        the served version; None: served + 1). A refused version gives the push up (nothing loaded)."""
        async with self._turn:
            push = self._open()
            served = self._backend.policy_version
            try:
                version = _version(weight_version, served)
                version = await self._backend.control(FinishWeightUpdate(version=version))
            except BaseException:
                await self._give_up()
                raise
            await self._close()
            result = PushResult(version, time.perf_counter() - push.start_s, push.bytes)
            self._on_finish(result)
            return result

    async def shutdown(self) -> None:
        async with self._turn:
            await self._give_up()
            await self._backend.control(ShutdownWeightTransfer())

    def _open(self) -> _Push:
        if self._push is None:
            raise WeightUpdateConflict("no weight update is open: call /start_weight_update first")
        if self._push.idle is not None:
            self._push.idle.cancel()
        return self._push

    def _arm(self) -> None:
        """(Re)starts the idle timer of the open push."""
        push = self._push
        assert push is not None
        if push.idle is not None:
            push.idle.cancel()
        push.idle = asyncio.get_running_loop().call_later(self._idle_s, lambda: asyncio.ensure_future(
            self._expire(push)))

    async def _expire(self, push: _Push) -> None:
        async with self._turn:
            if self._push is push:
                log.error("weight update given up: no call for %g s since the last one (the trainer is gone?); every "
                          "engine serves version %d", self._idle_s, self._backend.policy_version)
                await self._give_up()

    async def _give_up(self) -> None:
        """The open push, if any, given up on every engine; the lock released."""
        if self._push is None:
            return
        try:
            await self._backend.control(AbortWeightUpdate())
        finally:
            await self._close()

    async def _close(self) -> None:
        push, self._push = self._push, None
        if push is not None:
            if push.idle is not None:
                push.idle.cancel()
            await push.lock.aclose()


def _version(weight_version: str | None, served: int) -> int:
    """The policy version a push is served as: vLLM's `weight_version` label read as an integer newer than `served`
    (None: served + 1). EngineInputError for a label that is not an integer, WeightUpdateConflict for one not
    newer."""
    if weight_version is None:
        return served + 1
    try:
        version = int(weight_version)
    except ValueError:
        raise EngineInputError(f"weight_version: the policy version, an integer, here; got {weight_version!r}") \
            from None
    if version <= served:
        raise WeightUpdateConflict(f"weight_version: {version} is not newer than the served {served}")
    return version
