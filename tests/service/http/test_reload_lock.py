"""The gateway's reload lock (service/http/reload_lock.py): batches share it, a weight change holds it alone, waits
for the running batches unless told not to drain, and is not starved by batches that keep coming."""

from __future__ import annotations

import asyncio

from das.service.http.reload_lock import ReloadLock


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_reload_waits_for_the_running_batches_and_holds_new_ones_until_it_ends() -> None:
    async def main() -> list[str]:
        lock, events = ReloadLock(), []
        first_ends = asyncio.Event()

        async def batch(name: str, until: asyncio.Event | None = None) -> None:
            async with lock.batch():
                events.append(f"{name} runs")
                if until is not None:
                    await until.wait()
            events.append(f"{name} ends")

        async def reload() -> None:
            async with lock.reload():
                events.append("reload runs")
                await _settle()
            events.append("reload ends")

        first = asyncio.create_task(batch("first", first_ends))
        await _settle()
        reloading = asyncio.create_task(reload())
        await _settle()
        later = asyncio.create_task(batch("later"))  # arrives while the reload waits: not before it
        await _settle()
        first_ends.set()
        await asyncio.gather(first, reloading, later)
        return events

    assert asyncio.run(main()) == ["first runs", "first ends", "reload runs", "reload ends", "later runs",
                                   "later ends"]


def test_batches_share_the_lock_and_a_reload_without_drain_does_not_wait_for_them() -> None:
    async def main() -> tuple[int, bool]:
        lock, running, held = ReloadLock(), 0, asyncio.Event()

        async def batch() -> None:
            nonlocal running
            async with lock.batch():
                running += 1
                await held.wait()

        batches = [asyncio.create_task(batch()) for _ in range(3)]
        await _settle()
        together = running
        async with asyncio.timeout(1):
            async with lock.reload(drain=False):  # the engines are paused: their samples wait under the pause
                reloaded = True
        held.set()
        await asyncio.gather(*batches)
        return together, reloaded

    assert asyncio.run(main()) == (3, True)
