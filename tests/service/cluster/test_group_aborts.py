"""Aborting one group of a batch (service/cluster/group_aborts.py) on the backends without Ray: `EngineBackend` and
`NodeEngine` over a paced `StubEngine` (a token at a time, or a sample at a time). The aborted group's engine stops generating it, its
samples come once each with finish_reason "abort", and the other group completes with every token."""

from __future__ import annotations

import asyncio
from pathlib import Path

from das.service.engine.stub_engine import StubEngine, StubEngineConfig
from das.service.cluster.group_aborts import GroupAborts
from das.service.cluster.node_engine import NodeEngine
from das.service.cluster.rollout_backend import EngineBackend
from das.service.wire.api import GroupRequest, SampleResult
from tests.service.cluster.flaky_shard import FlakyShard
from tests.service.stub_backend import stub_backend

TOKENS = 40


def two_groups() -> list[GroupRequest]:
    """A plain group of 2 samples and a session's turn (1 sample), both TOKENS tokens long."""
    return [GroupRequest(problem_id="other", n=2, prompt_token_ids=[1, 2], sampling={"max_tokens": TOKENS}),
            GroupRequest(problem_id="turn", session_id="s", n=1, prompt_token_ids=[3],
                         sampling={"max_tokens": TOKENS})]


async def wait_for(condition, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.005)


def test_engine_backend_stops_the_aborted_group_and_completes_the_other() -> None:
    engine = StubEngine(StubEngineConfig(tokens=TOKENS, token_s=0.02))
    backend = EngineBackend(engine)  # type: ignore[arg-type]  # StubEngine implements what EngineBackend uses

    async def scenario() -> tuple[list[tuple[int, SampleResult]], int, int]:
        aborts = GroupAborts()
        samples: list[tuple[int, SampleResult]] = []

        async def consume() -> None:
            async for item in backend.generate(two_groups(), None, aborts):
                samples.append(item)

        task = asyncio.create_task(consume())
        await wait_for(lambda: engine.tokens_made["turn"] >= 3)
        aborts.abort(1)
        aborts.abort(1)  # again: nothing more happens
        await asyncio.sleep(0.1)
        at_abort = engine.tokens_made["turn"]
        await task
        return samples, at_abort, engine.tally.running

    samples, at_abort, running = asyncio.run(scenario())
    other = sorted((s for g, s in samples if g == 0), key=lambda s: s.sample_index)
    turn = [s for g, s in samples if g == 1]
    assert [s.sample_index for s in other] == [0, 1]
    assert all(len(s.token_ids) == TOKENS and s.finish_reason == "length" for s in other)
    assert len(turn) == 1 and turn[0].finish_reason == "abort" and turn[0].token_ids == []
    assert at_abort < TOKENS
    # no token was made for the aborted sample after its abort, while the other group ran on for ~0.8 s
    assert engine.tokens_made["turn"] == at_abort and engine.tokens_made["other"] == 2 * TOKENS
    assert running == 0


def test_node_engine_aborts_one_group_of_a_run_by_its_run_id(tmp_path: Path) -> None:
    node = NodeEngine("n0", StubEngineConfig(tokens=TOKENS, token_s=0.02), [FlakyShard(tmp_path)])

    async def scenario() -> tuple[list[tuple[int, SampleResult]], int, int]:
        await node.start()
        engine = node.engines[0]
        assert isinstance(engine, StubEngine)
        await node.abort_group("unknown-run", [0])  # an abort for no run here changes nothing running
        samples: list[tuple[int, SampleResult]] = []

        async def consume() -> None:
            async for items in node.run([(0, list(enumerate(two_groups())))], run_id="r1"):
                samples.extend(item for item in items if isinstance(item[1], SampleResult))

        task = asyncio.create_task(consume())
        await wait_for(lambda: engine.tokens_made["turn"] >= 3)
        await node.abort_group("r1", [1])
        await asyncio.sleep(0.1)
        at_abort = engine.tokens_made["turn"]
        await task
        made = engine.tokens_made["turn"]
        await node.close()
        return samples, at_abort, made

    samples, at_abort, made = asyncio.run(scenario())
    assert sorted((g, s.sample_index, s.finish_reason, len(s.token_ids)) for g, s in samples) == [
        (0, 0, "length", TOKENS), (0, 1, "length", TOKENS), (1, 0, "abort", 0)]
    assert made == at_abort < TOKENS


def test_node_engine_applies_an_abort_that_came_before_its_run(tmp_path: Path) -> None:
    node = NodeEngine("n0", StubEngineConfig(tokens=TOKENS, token_s=0.02), [FlakyShard(tmp_path)])

    async def scenario() -> list[tuple[int, SampleResult]]:
        await node.start()
        await node.abort_group("r2", [1])
        out = [item async for items in node.run([(0, list(enumerate(two_groups())))], run_id="r2") for item in items
               if isinstance(item[1], SampleResult)]
        assert node.engines[0].tokens_made["turn"] == 0  # type: ignore[union-attr]
        await node.close()
        return out

    samples = asyncio.run(scenario())
    assert sorted((g, s.finish_reason) for g, s in samples) == [(0, "length"), (0, "length"), (1, "abort")]


def test_a_sample_paced_engine_ends_an_aborted_groups_unemitted_samples_with_abort_at_once() -> None:
    backend = stub_backend(tokens=4, sample_s=0.01)

    async def scenario() -> list[tuple[int, SampleResult]]:
        aborts = GroupAborts()
        groups = [GroupRequest(problem_id="a", n=3, prompt_token_ids=[1]),
                  GroupRequest(problem_id="b", n=3, prompt_token_ids=[1])]
        out = []
        async for group_index, sample in backend.generate(groups, None, aborts):
            out.append((group_index, sample))
            if len(out) == 2:  # sample 0 of each group has come
                aborts.abort(1)
        return out

    samples = asyncio.run(scenario())
    # the groups' samples take turns; the aborted group's come at once, not at their turns
    assert [(g, s.sample_index, s.finish_reason) for g, s in samples] == [
        (0, 0, "stop"), (1, 0, "stop"), (1, 1, "abort"), (1, 2, "abort"), (0, 1, "stop"), (0, 2, "stop")]
    assert all(len(s.token_ids) == 4 for g, s in samples if g == 0)


def test_closing_the_batch_still_stops_every_group_on_the_engine() -> None:
    """The abort watch must not keep a group's engine stream alive when the whole batch is aborted (closed)."""
    engine = StubEngine(StubEngineConfig(tokens=TOKENS, token_s=0.02))
    backend = EngineBackend(engine)  # type: ignore[arg-type]

    async def scenario() -> tuple[int, int]:
        stream = backend.generate(two_groups(), None, GroupAborts())
        task = asyncio.ensure_future(anext(stream))
        await wait_for(lambda: engine.tokens_made["turn"] >= 3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await stream.aclose()
        made = sum(engine.tokens_made.values())
        await asyncio.sleep(0.1)
        return made, sum(engine.tokens_made.values())

    at_close, later = asyncio.run(scenario())
    assert later == at_close and engine.tally.running == 0
