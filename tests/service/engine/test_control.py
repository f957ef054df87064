"""A control message applied to engines: the verb reaches every engine by its method, the replies combine."""

from __future__ import annotations

import asyncio

from das.service.engine.control import apply_control
from das.service.engine.stub_engine import StubEngine, StubEngineConfig
from das.service.wire.api import GroupRequest, SamplingSpec
from das.service.wire.engine_control import AbortSamples, IsPaused, Pause, Resume


def test_pause_reaches_every_engine_and_abort_counts_over_all_of_them() -> None:
    async def main() -> tuple[bool, bool, bool, int]:
        engines = [await StubEngine.create(StubEngineConfig(tokens=50, token_s=0.01)) for _ in range(2)]
        group = GroupRequest(problem_id="p", prompt="a b c", n=2, sampling=SamplingSpec(max_tokens=50, seed=1))
        streams = [asyncio.create_task(_drain(engine, group)) for engine in engines]
        await asyncio.sleep(0.05)
        await apply_control(engines, Pause(mode="keep"))
        both = all([await engine.is_paused() for engine in engines])
        paused = await apply_control(engines, IsPaused())
        await apply_control(engines, Resume())
        resumed = await apply_control(engines, IsPaused())
        aborted = await apply_control(engines, AbortSamples())
        await asyncio.gather(*streams)
        return both, paused, resumed, aborted

    both, paused, resumed, aborted = asyncio.run(main())
    assert both and paused and not resumed
    assert aborted == 4  # two samples of one group on each of two engines, none finished


async def _drain(engine: StubEngine, group: GroupRequest) -> None:
    async for _ in engine.generate(group):
        pass
