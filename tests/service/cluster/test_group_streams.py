"""`merge_groups` (service/cluster/group_streams.py), the in-process backend's per-sample path: group aborts between
two samples and before the batch, closing the merged stream early, an engine error, finishing order; and that no
layer (the stub engine, the merge) keeps a delivered sample alive while its group waits for its next one."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import weakref
from collections.abc import AsyncIterator

import pytest

from das.service.cluster.group_aborts import GroupAborts
from das.service.cluster.group_streams import merge_groups
from das.service.cluster.rollout_backend import EngineBackend
from das.service.engine.stub_engine import StubEngine, StubEngineConfig
from das.service.wire.api import GroupRequest, SampleResult


def group(name: str, n: int) -> GroupRequest:
    return GroupRequest(problem_id=name, n=n, prompt_token_ids=[1])


def made(g: GroupRequest, index: int) -> SampleResult:
    return SampleResult(problem_id=g.problem_id, sample_index=index, token_ids=[7, 8], logprobs=[-1.0, -1.0],
                        finish_reason="stop", policy_version=3)


class Streams:
    """Engine streams under a test's control: group i's stream yields sample k once `go(i)` was called for it (k+1
    times in all), and records its opening and its end (`opened`, `closed`: group indices)."""

    def __init__(self, groups: list[GroupRequest], fail: dict[int, int] | None = None) -> None:
        self.groups = groups
        self.opened: list[int] = []
        self.closed: list[int] = []
        self._fail = fail or {}  # group index -> the sample index whose turn raises ValueError instead
        self._allowed = [asyncio.Semaphore(0) for _ in groups]

    def go(self, index: int, samples: int = 1) -> None:
        for _ in range(samples):
            self._allowed[index].release()

    async def open(self, index: int, g: GroupRequest) -> AsyncIterator[SampleResult]:
        self.opened.append(index)
        try:
            for k in range(g.n):
                await self._allowed[index].acquire()
                if self._fail.get(index) == k:
                    raise ValueError(f"group {index} failed")
                yield made(g, k)
        finally:
            self.closed.append(index)


def merged(streams: Streams, aborts: GroupAborts | None = None) -> AsyncIterator[tuple[int, SampleResult]]:
    return merge_groups(streams.groups, streams.open, "e0", aborts, lambda: 5)


def test_samples_come_in_the_order_the_streams_make_them_each_named_by_the_engine() -> None:
    async def scenario() -> list[tuple[int, int]]:
        streams = Streams([group("a", 2), group("b", 2)])
        out = []
        async with contextlib.aclosing(merged(streams)) as samples:
            for g in (1, 0, 0, 1):
                streams.go(g)
                index, sample = await anext(samples)
                assert sample.engine == "e0"
                out.append((index, sample.sample_index))
            assert [item async for item in samples] == []
        assert sorted(streams.closed) == [0, 1]
        return out

    assert asyncio.run(scenario()) == [(1, 0), (0, 0), (0, 1), (1, 1)]


def test_an_abort_between_two_samples_closes_the_groups_stream_and_ends_the_rest_as_aborted() -> None:
    async def scenario() -> None:
        streams = Streams([group("a", 3), group("b", 2)])
        aborts = GroupAborts()
        async with contextlib.aclosing(merged(streams, aborts)) as samples:
            streams.go(0)
            assert (await anext(samples))[0] == 0  # sample 0 of group 0; its stream now waits for sample 1
            aborts.abort(0)
            aborts.abort(0)  # again: nothing more
            streams.go(0, 2)  # what the engine would have made next is not delivered: the stream is closed
            rest = []
            for _ in range(2):
                rest.append(await anext(samples))
            assert streams.closed == [0]
            assert [(i, s.sample_index, s.finish_reason, s.token_ids, s.policy_version, s.engine) for i, s in rest] \
                == [(0, 1, "abort", [], 5, "e0"), (0, 2, "abort", [], 5, "e0")]
            streams.go(1, 2)  # the other group runs on
            assert [(i, s.finish_reason) async for i, s in samples] == [(1, "stop"), (1, "stop")]

    asyncio.run(scenario())


def test_a_sample_made_but_not_yet_delivered_when_its_group_is_aborted_comes_as_aborted() -> None:
    """The engine has made sample 1 (the reader is due to run) when the abort lands: the reader does not run on, and
    the sample is owed as aborted; the stream is closed without making sample 2."""
    async def scenario() -> None:
        streams = Streams([group("a", 3)])
        aborts = GroupAborts()
        async with contextlib.aclosing(merged(streams, aborts)) as samples:
            streams.go(0)
            await anext(samples)
            streams.go(0)  # sample 1 made: the reader's wait is over, but it has not run yet
            aborts.abort(0)
            assert [(s.sample_index, s.finish_reason) async for _, s in samples] == [(1, "abort"), (2, "abort")]
        assert streams.closed == [0]

    asyncio.run(scenario())


def test_an_abort_before_the_batch_starts_opens_no_stream_for_the_group() -> None:
    async def scenario() -> None:
        streams = Streams([group("a", 1), group("b", 2)])
        aborts = GroupAborts()
        aborts.abort(1)
        aborts.abort(7)  # no such group in the batch: nothing
        streams.go(0)
        out = [(i, s.sample_index, s.finish_reason) async for i, s in merged(streams, aborts)]
        assert sorted(out) == [(0, 0, "stop"), (1, 0, "abort"), (1, 1, "abort")]
        assert streams.opened == [0]

    asyncio.run(scenario())


def test_an_abort_after_the_group_ended_changes_nothing() -> None:
    async def scenario() -> None:
        streams = Streams([group("a", 1), group("b", 1)])
        aborts = GroupAborts()
        async with contextlib.aclosing(merged(streams, aborts)) as samples:
            streams.go(0)
            assert (await anext(samples))[0] == 0
            await asyncio.sleep(0)  # group 0's reader ends
            aborts.abort(0)
            streams.go(1)
            assert [(i, s.finish_reason) async for i, s in samples] == [(1, "stop")]

    asyncio.run(scenario())


@pytest.mark.parametrize("how", ["aclose", "cancel"])
def test_closing_the_merged_stream_early_closes_every_engine_stream(how: str) -> None:
    async def scenario() -> None:
        streams = Streams([group("a", 2), group("b", 2), group("c", 2)])
        samples = merged(streams)
        streams.go(1)
        await anext(samples)
        await asyncio.sleep(0)  # every stream opened; each waits for its next sample
        if how == "aclose":
            await samples.aclose()
        else:  # the consumer's task cancelled while it waits for the next sample
            waiting = asyncio.ensure_future(anext(samples))
            await asyncio.sleep(0)
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
        assert sorted(streams.opened) == sorted(streams.closed) == [0, 1, 2]

    asyncio.run(scenario())


def test_an_engine_error_ends_the_merge_and_closes_the_other_streams() -> None:
    async def scenario() -> None:
        streams = Streams([group("a", 2), group("b", 2)], fail={1: 1})
        samples = merged(streams)
        streams.go(1, 2)
        assert (await anext(samples))[0] == 1
        with pytest.raises(ValueError, match="group 1 failed"):
            await anext(samples)
        assert sorted(streams.closed) == [0, 1]

    asyncio.run(scenario())


def test_a_delivered_sample_is_not_kept_while_its_group_waits_for_its_turn() -> None:
    """Under per-sample pacing a group waits a whole round for its next sample: neither the stub engine nor the merge
    may keep its previous one referenced meanwhile (held, every group's latest sample outlives the garbage
    collector's young generation, and its collections scan them all: milliseconds in the gateway's event loop)."""
    backend = EngineBackend(StubEngine(StubEngineConfig(tokens=8, sample_s=0.02)))  # type: ignore[arg-type]

    async def scenario() -> None:
        gc.disable()  # freed by reference counts alone, not by a collection that happened to run
        try:
            async with contextlib.aclosing(backend.generate([group("a", 2), group("b", 2)], None,
                                                            GroupAborts())) as samples:
                index, first = await anext(samples)
                assert (index, first.sample_index) == (0, 0)
                freed = weakref.ref(first)
                del first
                index, second = await anext(samples)  # group 1's turn: group 0 now waits for its next
                assert (index, second.sample_index) == (1, 0)
                assert freed() is None
                assert [(i, s.sample_index) async for i, s in samples] == [(0, 1), (1, 1)]
        finally:
            gc.enable()

    asyncio.run(scenario())
