"""One batch's groups on one in-process engine, merged into one stream: `merge_groups`, the per-sample path of
`EngineBackend` (service/cluster/rollout_backend.py), with group aborts (service/cluster/group_aborts.py).

Each group's engine stream is read by a task of its own, which puts (group index, sample) straight into one queue
for the whole batch; the merged stream takes them from there. A sample costs one put and one get, and no task,
queue or generator of this module's own beyond that: the engine runs in the gateway's process here (a load test's
stub engine, thousands of samples a second), so every layer a sample crosses is time the gateway does not have.

A group's abort cancels its reader task where it waits for the engine's next sample: the engine's stream is closed
there (`Engine.generate` aborts its samples still running, in vLLM), and each sample of the group not put in the
queue yet is put as `aborted_sample` once the reader has ended. What went into the queue before the abort is
delivered as made.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence

from das.service.cluster.group_aborts import GroupAborts, aborted_sample
from das.service.wire.api import GroupRequest, SampleResult

GroupStream = Callable[[int, GroupRequest], AsyncIterator[SampleResult]]
"""Opens the engine's stream of a group: (index of the group in the batch, the group) -> its samples, each once,
sample indices the group's (0 .. n-1)."""


async def merge_groups(groups: Sequence[GroupRequest], open_stream: GroupStream, engine: str,
                       aborts: GroupAborts | None, policy_version: Callable[[], int]
                       ) -> AsyncGenerator[tuple[int, SampleResult], None]:
    """Every sample of every group exactly once, as (index of its group in `groups`, sample), in the order the
    streams `open_stream(i, groups[i])` make them, each sample's `engine` set to `engine` (SampleResult.engine).
    A group aborted through `aborts` (before or while it runs) stops on its engine, and its samples not delivered
    yet come as `aborted_sample` (policy version `policy_version()` at the abort); the others run on. The first
    stream to raise ends the merge with its exception; closing the merge (or an error) cancels every reader still
    running, which closes its engine stream, and waits for them."""
    # (group index, sample), a reader's error, or None: a reader's end mark (its group has no more samples)
    ready: asyncio.Queue[tuple[int, SampleResult] | BaseException | None] = asyncio.Queue()
    delivered: list[set[int]] = [set() for _ in groups]  # per group, the sample indices put in `ready`
    closing = False  # set once the merge ends: a reader cancelled from then on owes nothing

    async def read(index: int, group: GroupRequest) -> None:
        put = delivered[index]
        stream = open_stream(index, group)
        try:
            async for sample in stream:
                put.add(sample.sample_index)
                sample.engine = engine
                ready.put_nowait((index, sample))
                # Not referenced while the next sample is awaited (a paced engine's group may wait a whole round
                # of the batch): a sample kept that long outlives the garbage collector's young generation, whose
                # collections then scan every such sample of the batch (milliseconds each, in the event loop).
                del sample
        finally:
            # Cancelled (an abort, the merge closed), the stream has ended at its await already; closed here on
            # any other way out.
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    def ended(index: int, group: GroupRequest, reader: asyncio.Task[None]) -> None:
        # Each reader's end puts its end mark (after its aborted samples, if aborted) or its error: the merge waits
        # for every end mark, so a reader that put neither would leave it waiting forever.
        if closing:
            return
        if not reader.cancelled():
            error = reader.exception()
            ready.put_nowait(error)
        elif aborts is not None and aborts.aborted(index):
            version = policy_version()
            for sample_index in range(group.n):
                if sample_index not in delivered[index]:
                    sample = aborted_sample(group, sample_index, version)
                    sample.engine = engine
                    ready.put_nowait((index, sample))
            ready.put_nowait(None)
        else:  # the engine's stream raised CancelledError itself: its samples are lost, which is an error
            ready.put_nowait(RuntimeError(f"the engine's stream of group {index} ({group.problem_id}) was "
                                          f"cancelled"))

    readers: list[asyncio.Task[None]] = []
    for index, group in enumerate(groups):
        reader = asyncio.create_task(read(index, group))
        reader.add_done_callback(functools.partial(ended, index, group))
        readers.append(reader)

    def abort(index: int) -> None:
        # an index outside the batch names no group of it; a reader that has ended has delivered every sample
        if 0 <= index < len(readers):
            readers[index].cancel()

    try:
        with aborts.listening(abort) if aborts is not None else contextlib.nullcontext():
            if aborts is not None:
                for index in range(len(groups)):
                    if aborts.aborted(index):  # aborted before the batch started: its engine makes nothing
                        abort(index)
            running = len(readers)
            while running:
                item = await ready.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
    finally:
        closing = True
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
