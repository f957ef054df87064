"""Pause as promised on either vLLM behaviour (service/engine/pause_gate.py): a batch sent while paused (abort, wait,
keep) is held by the service and completes after /resume, whether the engine queues new requests while paused (vLLM
0.32) or rejects them (`StubEngineConfig.pause_behavior="reject"`): through the gateway over one engine, through a
NodeEngine that a pause reaches while a group is on its way, and through the Ray coordinator."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import httpx
import pytest

from das.service.engine.stub_engine import StubEngine, StubEngineConfig
from das.service.cluster.coordinator import RayBackend
from das.service.config import ServiceConfig
from das.service.cluster.node_engine import NodeEngine
from das.service.cluster.rollout_backend import EngineBackend
from das.service.wire.api import GroupRequest, PauseMode, SampleResult
from das.service.wire.engine_control import Pause, Resume
from tests.service.cluster.flaky_shard import FlakyShard
from tests.service.http.rl_batches import against, batch, group, summary

Behaviour = Literal["queue", "reject"]
MODES: tuple[PauseMode, ...] = ("abort", "wait", "keep")


async def _collect(engine: StubEngine, request: GroupRequest) -> list[SampleResult]:
    return [sample async for sample in engine.generate(request)]


@pytest.mark.parametrize("mode", MODES)
def test_the_stub_engine_emulates_both_vllm_behaviours_for_a_group_sent_while_paused(mode: PauseMode) -> None:
    """The emulation the service tests below rely on: a rejecting engine ends a group it gets during an abort or
    wait pause at once with errors (a keep pause queues it); a queueing one holds it until resume."""
    request = GroupRequest(**group("p", 2))

    async def scenario(behaviour: Behaviour) -> tuple[bool, list[SampleResult]]:
        engine = StubEngine(StubEngineConfig(tokens=4, pause_behavior=behaviour))
        await engine.pause(mode)
        task = asyncio.create_task(_collect(engine, request))
        await asyncio.sleep(0.1)
        ended_while_paused = task.done()
        await engine.resume()
        return ended_while_paused, await asyncio.wait_for(task, 5)

    held, samples = asyncio.run(scenario("queue"))
    assert not held and [s.finish_reason for s in samples] == ["stop", "stop"]
    ended, samples = asyncio.run(scenario("reject"))
    if mode == "keep":
        assert not ended and [s.finish_reason for s in samples] == ["stop", "stop"]
    else:
        assert ended and [s.finish_reason for s in samples] == ["error", "error"]
        assert all(s.error and "rejects new requests" in s.error and not s.token_ids for s in samples)


@pytest.mark.parametrize("behaviour", ["queue", "reject"])
def test_a_batch_sent_while_paused_through_the_gateway_completes_after_resume(behaviour: Behaviour) -> None:
    engine = StubEngine(StubEngineConfig(tokens=8, token_s=0.005, pause_behavior=behaviour))
    backend = EngineBackend(engine)  # type: ignore[arg-type]  # the stub has the Engine interface it needs

    async def scenario(http: httpx.AsyncClient) -> None:
        for mode in MODES:
            assert (await http.post("/pause", params={"mode": mode})).status_code == 200
            held = asyncio.create_task(batch(http, f"held-{mode}", [group("a", 2), group("b", 1)]))
            await asyncio.sleep(0.3)  # 8 tokens at 5 ms: long done, were it not held
            assert not held.done() and (await summary(http, f"held-{mode}"))["samples"] == 0, mode
            assert engine._groups == 0  # held by the service: nothing reached the engine
            assert (await http.post("/resume")).status_code == 200
            records, end = await held
            assert end["status"] == "done" and end["samples"] == end["samples_expected"] == 3, (mode, end)
            assert [r["finish_reason"] for r in records] == ["stop"] * 3, (mode, records)

    asyncio.run(against(scenario, backend))


@pytest.mark.parametrize("behaviour", ["queue", "reject"])
def test_a_group_that_reaches_a_node_engine_after_its_pause_is_held_there(tmp_path: Any, behaviour: Behaviour
                                                                          ) -> None:
    """The coordinator's dispatch and its pause travel separately: a group that reaches the engine actor after the
    pause (keep, then abort: both reach the engine) waits in the actor until resume."""
    node = NodeEngine("n0", StubEngineConfig(tokens=4, pause_behavior=behaviour), [FlakyShard(tmp_path)])
    request = GroupRequest(**group("p", 2))

    async def run_group() -> list[SampleResult]:
        return [sample async for items in node.run([(0, [(0, request)])]) for _, sample in items
                if isinstance(sample, SampleResult)]  # progress reports of a slow step come between

    async def scenario() -> list[list[SampleResult]]:
        await node.start()
        results = []
        for mode in MODES:
            await node.control(Pause(mode=mode))
            task = asyncio.create_task(run_group())
            await asyncio.sleep(0.2)
            assert not task.done(), mode
            await node.control(Resume())
            results.append(await asyncio.wait_for(task, 10))
        await node.close()
        return results

    for samples in asyncio.run(scenario()):
        assert sorted((s.sample_index, s.finish_reason) for s in samples) == [(0, "stop"), (1, "stop")]


def test_the_ray_coordinator_holds_a_batch_sent_while_paused_on_rejecting_engines() -> None:
    """RayBackend -> NodeEngine -> StubEngine that rejects new requests while paused, two engines: per mode, a batch
    generated while paused reaches no engine before resume and then completes whole."""
    async def main() -> dict[str, tuple[bool, list[SampleResult]]]:
        backend = await RayBackend.start(ServiceConfig(
            engine=StubEngineConfig(tokens=6, token_s=0.01, pause_behavior="reject"), engines_per_node=2))
        outcome = {}
        try:
            await backend.wait_ready()

            async def collect() -> list[SampleResult]:
                requests = [GroupRequest(**group(f"p{i}", 2)) for i in range(3)]
                return [sample async for _, sample in backend.generate(requests)]

            for mode in MODES:
                await backend.control(Pause(mode=mode))
                held = asyncio.create_task(collect())
                await asyncio.sleep(1.0)
                ended_while_paused = held.done()
                await backend.control(Resume())
                outcome[mode] = (ended_while_paused, await asyncio.wait_for(held, 60))
        finally:
            await backend.close()
        return outcome

    for mode, (ended_while_paused, samples) in asyncio.run(main()).items():
        assert not ended_while_paused, mode
        assert len(samples) == 6 and {s.finish_reason for s in samples} == {"stop"}, (mode, samples)
