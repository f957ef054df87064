"""Aborting one group of a running batch while its other groups run on (vLLM-free, Ray-free).

A batch's groups are independent trajectories: `DELETE /v1/sessions/{id}` ends one session whose turn is a group of
a batch that also carries other groups (other sessions' turns, plain groups). Aborting the whole batch would cut the
others off, and letting the turn run on would leave its engine generating tokens nobody reads. So the gateway hands
each batch's `GroupAborts` to `RolloutBackend.generate`, and a backend ends an aborted group's samples as follows:
every sample of the group not yet delivered is delivered once, with finish_reason "abort" and no tokens, and the
engine stops generating it (the group's engine stream is closed, which aborts its samples in vLLM: `abortable` on an
engine actor, service/cluster/group_streams.py `merge_groups` in the in-process backend). The batch's contract is
kept: every sample of every group exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator

from das.service.wire.api import GroupRequest, SampleResult


class GroupAborts:
    """The groups of one batch (by their index in it) that its caller aborted. Set on the event loop; backends
    wait on `event(i)` or read `aborted(i)`; `on_abort` callbacks hear each new abort at once (the Ray coordinator
    forwards it to the engine actor running the group)."""

    def __init__(self) -> None:
        self._events: dict[int, asyncio.Event] = {}
        self._listeners: list[Callable[[int], None]] = []

    def event(self, group_index: int) -> asyncio.Event:
        """Set once group `group_index` is aborted."""
        return self._events.setdefault(group_index, asyncio.Event())

    def aborted(self, group_index: int) -> bool:
        event = self._events.get(group_index)
        return event is not None and event.is_set()

    def abort(self, group_index: int) -> None:
        """Aborts group `group_index` (again: nothing changes)."""
        if self.aborted(group_index):
            return
        self.event(group_index).set()
        for listener in list(self._listeners):
            listener(group_index)

    @contextlib.contextmanager
    def listening(self, listener: Callable[[int], None]) -> Iterator[None]:
        """`listener(group_index)` is called for every abort while the block runs."""
        self._listeners.append(listener)
        try:
            yield
        finally:
            self._listeners.remove(listener)


def aborted_sample(group: GroupRequest, index: int, policy_version: int) -> SampleResult:
    """Sample `index` of `group`, ended by its group's abort before it was delivered."""
    return SampleResult(problem_id=group.problem_id, sample_index=index, token_ids=[], logprobs=[],
                        finish_reason="abort", policy_version=policy_version)


async def abortable(samples: AsyncIterator[SampleResult], group: GroupRequest, abort: asyncio.Event | None,
                    policy_version: Callable[[], int]) -> AsyncIterator[SampleResult]:
    """`samples` (an engine's stream of `group`) until `abort` is set; then the stream is closed (the engine stops
    generating the group's samples still running: `Engine.generate` aborts them in vLLM) and each sample of the
    group not delivered yet is delivered as `aborted_sample`. Sample indices are the group's (0 .. n-1).

    The stream is read by a task of its own into a queue, and the abort puts its mark in the same queue: a sample
    costs a queue hop, not a race of two tasks. (The in-process backend does without the hop: `merge_groups`.)"""
    if abort is None:
        async for sample in samples:
            yield sample
        return
    ready: asyncio.Queue[SampleResult | BaseException | None] = asyncio.Queue()  # None: the stream ended or aborted

    async def read() -> None:
        try:
            async for sample in samples:
                ready.put_nowait(sample)
        except Exception as exc:  # handed to the reader below, which owns the error
            ready.put_nowait(exc)
        ready.put_nowait(None)

    async def watch() -> None:
        await abort.wait()
        ready.put_nowait(None)

    reading, watching = asyncio.create_task(read()), asyncio.create_task(watch())
    delivered: set[int] = set()
    try:
        while (item := await ready.get()) is not None and not abort.is_set():
            if isinstance(item, BaseException):
                raise item
            delivered.add(item.sample_index)
            yield item
        if not abort.is_set():
            return
    finally:
        # Aborted, or this stream was cancelled or closed: cancelling the reader at its await ends the engine's
        # stream there and runs its finally, which aborts what it still runs.
        watching.cancel()
        reading.cancel()
        await asyncio.gather(reading, watching, return_exceptions=True)
        aclose = getattr(samples, "aclose", None)
        if aclose is not None:
            await aclose()
    for index in range(group.n):
        if index not in delivered:
            yield aborted_sample(group, index, policy_version())
