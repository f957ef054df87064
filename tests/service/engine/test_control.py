"""A control message applied to engines: the verb reaches every engine by its method, with the arguments it gives
that engine, and the replies combine (a disagreement fails); an error waits for every engine."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from das.service.engine.control import apply_control
from das.service.engine.stub_engine import StubEngine, StubEngineConfig
from das.service.wire.api import GroupRequest, SamplingSpec
from das.service.wire.engine_control import (
    AbortSamples,
    AddHistory,
    EnginesDisagree,
    FinishWeightUpdate,
    InitWeightTransfer,
    IsPaused,
    Pause,
    ReloadWeights,
    Resume,
    SaveWeightUpdate,
    UpdateWeights,
)


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


class Recorder:
    """An engine's control methods that record their arguments; `serves` is the version it says it serves after a
    weight change (a faulty engine says another than asked), `fails` what its update raises after `delay_s`."""

    def __init__(self, serves: int | None = None, fails: Exception | None = None, delay_s: float = 0.0) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.serves, self.fails, self.delay_s = serves, fails, delay_s
        self.done = False

    async def reload_weights(self, checkpoint: str, version: int) -> int:
        self.calls.append(("reload_weights", {"checkpoint": checkpoint, "version": version}))
        return version if self.serves is None else self.serves

    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        self.calls.append(("init_weight_transfer", init_info))

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        await asyncio.sleep(self.delay_s)
        if self.fails is not None:
            raise self.fails
        self.done = True

    async def finish_weight_update(self, version: int, keep: bool) -> int:
        self.calls.append(("finish_weight_update", {"version": version, "keep": keep}))
        return version

    async def save_weight_update(self, root: str, version: int) -> str:
        self.calls.append(("save_weight_update", {"root": root, "version": version}))
        return f"{root}/v{version}"


def test_each_engine_gets_its_own_arguments_and_the_first_alone_keeps_and_saves() -> None:
    engines = [Recorder() for _ in range(3)]

    async def main() -> tuple[int, str]:
        await apply_control(engines, InitWeightTransfer(init_info={"rank_offset": 1, "world_size": 7},
                                                        workers_per_engine=2))
        version = await apply_control(engines, FinishWeightUpdate(version=2, keep=True))
        return version, await apply_control(engines, SaveWeightUpdate(root="/state/pushed", version=2))

    version, path = asyncio.run(main())
    assert version == 2 and path == "/state/pushed/v2"
    assert [e.calls[0][1]["rank_offset"] for e in engines] == [1, 3, 5]
    assert [e.calls[1][1]["keep"] for e in engines] == [True, False, False]
    assert [len(e.calls) for e in engines] == [3, 2, 2]  # only the first engine saved


def test_engines_that_serve_other_versions_after_a_reload_fail_it_clearly() -> None:
    engines = [Recorder(), Recorder(serves=2)]
    with pytest.raises(EnginesDisagree, match=r"every engine must serve policy version 3, but some serve \[2\]"):
        asyncio.run(apply_control(engines, ReloadWeights(checkpoint="/ckpt/3", version=3)))
    assert all(e.calls == [("reload_weights", {"checkpoint": "/ckpt/3", "version": 3})] for e in engines)


def test_an_engines_error_is_raised_once_every_engine_has_answered() -> None:
    """A step that fails on one engine is given up everywhere next: no other engine may still be running it."""
    slow, failing = Recorder(delay_s=0.2), Recorder(fails=RuntimeError("peer gone"))
    with pytest.raises(RuntimeError, match="peer gone"):
        asyncio.run(apply_control([slow, failing], UpdateWeights(update_info={"names": []})))
    assert slow.done


def test_a_history_import_reaches_every_engine_and_counts_what_one_kept() -> None:
    record = {"problem_id": "p", "policy_version": 0, "sample_index": 0, "prompt_token_ids": [1],
              "output_token_ids": [2, 3]}

    async def main() -> tuple[int, list[int]]:
        engines = [await StubEngine.create(StubEngineConfig()) for _ in range(2)]
        added = await apply_control(engines, AddHistory(rollouts=[record, record]))
        return added, [engine.history_records for engine in engines]

    assert asyncio.run(main()) == (2, [2, 2])
