"""`merge_batches`, how an engine actor's stream is cut into Ray objects: with a minimum interval the items that
arrive in between travel together, a full list does not wait, and the last items go as soon as every stream ended."""

import asyncio
import time
from collections.abc import AsyncIterator

from das.service.cluster.rollout_backend import merge_batches


async def ticks(count: int, every_s: float, tag: str) -> AsyncIterator[str]:
    for i in range(count):
        await asyncio.sleep(every_s)
        yield f"{tag}{i}"


async def lists(min_interval_s: float, max_items: int = 64, count: int = 20) -> tuple[list[list[str]], float]:
    started = time.monotonic()
    out = [items async for items in merge_batches([ticks(count, 0.01, "a"), ticks(count, 0.01, "b")], max_items,
                                                  min_interval_s)]
    return out, time.monotonic() - started


def test_an_interval_makes_fewer_fuller_lists_and_the_last_items_do_not_wait() -> None:
    plain, _ = asyncio.run(lists(0.0))
    paced, took = asyncio.run(lists(0.15))
    assert sorted(i for items in paced for i in items) == sorted(i for items in plain for i in items)
    assert len(plain) >= 15  # about one list per tick
    assert len(paced) <= 3  # 0.2 s of ticks in lists 0.15 s after the start and apart, the last at the end
    # the streams end at ~0.2 s (later on a loaded machine); the last list does not wait out its interval
    assert took < 0.2 + 0.15 + 0.5
    assert [i for i in paced[-1]][-1] in ("a19", "b19")


def test_a_full_list_does_not_wait_for_the_interval() -> None:
    async def run() -> tuple[list[list[str]], float]:
        started = time.monotonic()
        out: list[list[str]] = []
        # 40 items at once, beside a stream that stays open for 2 s: full lists of 4 go without their 5 s interval
        # (the partial list at the end waits)
        async for items in merge_batches([ticks(40, 0.0, "a"), ticks(1, 2.0, "z")], 4, 5.0):
            out.append(items)
            if len([i for items_ in out for i in items_]) >= 36:
                return out, time.monotonic() - started
        raise AssertionError("the full lists never came")

    lists_, took = asyncio.run(run())
    assert all(len(items) <= 4 for items in lists_) and len(lists_) == 9
    assert took < 1.5


def test_a_run_shorter_than_the_interval_is_one_list() -> None:
    paced, took = asyncio.run(lists(5.0, count=5))
    assert len(paced) == 1 and len(paced[0]) == 10
    assert took < 2.0  # sent when the streams ended, not after the interval
