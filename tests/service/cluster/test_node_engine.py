"""`NodeEngine` on stub engines, as a plain object (no Ray): what its stats report of the history outbox, and its
end once an engine's core dies."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from das.service.engine.stub_engine import StubEngineConfig
from das.service.config import HistoryPushConfig
from das.service.cluster import node_engine
from das.service.cluster.node_engine import NodeEngine, NodeStats
from das.service.wire.api import GroupRequest, SampleResult
from tests.service.cluster.flaky_shard import FlakyShard


def test_stats_count_the_rollouts_the_outbox_holds_and_those_it_gave_up(tmp_path: Path) -> None:
    shard = FlakyShard(tmp_path)
    # 3 output tokens a rollout, an outbox of at most 7 tokens
    node = NodeEngine("n0", StubEngineConfig(tokens=3), [shard],
                      history_push=HistoryPushConfig(retry_s=0, max_pending_tokens=7))

    async def run_group(problem: str) -> int:
        group = GroupRequest(problem_id=problem, n=1, prompt_token_ids=[1, 2], sampling={"max_tokens": 3})
        samples = 0
        async for items in node.run([(0, [(0, group)])]):
            samples += sum(isinstance(sample, SampleResult) for _, sample in items)
        return samples

    async def scenario() -> list[NodeStats]:
        await node.start()
        seen = [await node.stats()]
        assert await run_group("up") == 1  # the shard takes it (stored, not yet in a snapshot: still held)
        seen.append(await node.stats())
        shard.shard.snapshot()
        shard.down = 1000
        for problem in ("down0", "down1", "down2"):
            assert await run_group(problem) == 1  # every sample still reaches the caller
        seen.append(await node.stats())
        await node.close()
        return seen

    start, after_one, after_outage = asyncio.run(scenario())
    assert (start.history_outbox_records, start.history_records_given_up) == (0, 0)
    assert (after_one.history_outbox_records, after_one.history_records_given_up) == (1, 0)
    # the engine learns of the snapshot only from a push's reply, and every push after it failed: "up" and the
    # three new rollouts (12 tokens) exceed the 7-token cap, so the two oldest are given up
    assert (after_outage.history_outbox_records, after_outage.history_records_given_up) == (2, 2)


def test_the_history_a_node_pushes_carries_each_samples_key(tmp_path: Path) -> None:
    shard = FlakyShard(tmp_path)
    node = NodeEngine("n0", StubEngineConfig(tokens=3), [shard], history_push=HistoryPushConfig(retry_s=0))
    seeded = GroupRequest(problem_id="k", n=2, prompt_token_ids=[1, 2], sampling={"max_tokens": 3, "seed": 11})
    unseeded = GroupRequest(problem_id="u", n=1, prompt_token_ids=[1, 2], sampling={"max_tokens": 3})

    async def scenario() -> None:
        await node.start()
        async for _ in node.run([(0, [(0, seeded), (1, unseeded)])]):
            pass
        await node.close()

    asyncio.run(scenario())
    keys = {(r["problem_id"], r["sample_index"]): r.get("sample_key")
            for records, _ in shard.shard.pull({"k": 0, "u": 0}, "x").values() for r in records}
    assert keys == {("k", 0): seeded.sample_key(0), ("k", 1): seeded.sample_key(1), ("u", 0): None}


def test_an_engine_core_that_dies_outside_a_batch_ends_the_actor_until_it_is_closed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM never answers a call that was in flight when its core died (a push's receive, a reload): the actor
    must end itself (Ray restarts it) without a batch seeing the death; a closed engine, which reads as dead, must
    not end it."""
    monkeypatch.setattr(node_engine, "ENGINE_WATCH_S", 0.01)
    ended: list[int] = []
    monkeypatch.setattr(NodeEngine, "_engine_died", lambda self, engine: ended.append(engine))
    node = NodeEngine("n0", StubEngineConfig(tokens=3), [FlakyShard(tmp_path)], engines=2)

    async def scenario() -> None:
        await node.start()
        await asyncio.sleep(0.1)
        assert ended == []  # live engines
        node.engines[1].dead = True
        await asyncio.sleep(0.1)
        assert ended and set(ended) == {1}
        ended.clear()
        node.engines[1].dead = False
        first = node.engines[0]
        closed = first.close

        async def close_as_vllm() -> None:  # dead from the start of its close, which takes a while
            first.dead = True
            await asyncio.sleep(0.1)
            await closed()

        monkeypatch.setattr(first, "close", close_as_vllm)
        await node.close()
        assert ended == []

    asyncio.run(scenario())
