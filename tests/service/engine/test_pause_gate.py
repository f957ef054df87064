import asyncio

import pytest

from das.service.engine.pause_gate import PauseGate


async def _pending(coro):
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(0.01)
    return task


def test_new_work_is_held_while_paused_and_let_go_on_resume_or_abort():
    async def main():
        gate = PauseGate()
        assert await gate.admit() == 0  # serving: admitted at once
        gate.pause("keep")
        held = await _pending(gate.admit())
        assert not held.done()
        gate.resume()
        assert await asyncio.wait_for(held, 1) == 0
        gate.pause("wait")
        held = await _pending(gate.admit())
        gate.abort()  # held work is let go under the epoch it started in, so it ends "abort"
        assert await asyncio.wait_for(held, 1) == 0 and gate.abort_epoch == 1 and gate.mode == "wait"
        gate.resume()
        gate.pause("abort")
        assert gate.abort_epoch == 2 and gate.mode == "abort"
    asyncio.run(main())


def test_a_keep_pause_freezes_work_in_flight_until_resume_or_its_abort():
    async def main():
        gate = PauseGate()
        epoch = await gate.admit()
        await asyncio.wait_for(gate.unfrozen(epoch), 1)  # serving: never frozen
        gate.pause("wait")
        await asyncio.wait_for(gate.unfrozen(epoch), 1)  # only keep freezes work in flight
        gate.pause("keep")
        frozen = await _pending(gate.unfrozen(epoch))
        assert not frozen.done()
        gate.resume()
        await asyncio.wait_for(frozen, 1)
        gate.pause("keep")
        frozen = await _pending(gate.unfrozen(epoch))
        gate.abort()
        await asyncio.wait_for(frozen, 1)
        assert gate.abort_epoch != epoch and gate.mode == "keep"
    asyncio.run(main())


@pytest.mark.parametrize("wakes", ["notify", "state change"])
def test_until_rechecks_its_condition_on_every_wake(wakes):
    async def main():
        gate = PauseGate()
        running = [2]
        waiting = await _pending(gate.until(lambda: not running[0]))
        running[0] -= 1
        gate.notify() if wakes == "notify" else gate.pause("wait")
        await asyncio.sleep(0.01)
        assert not waiting.done()  # woken, one still running
        running[0] -= 1
        gate.notify() if wakes == "notify" else gate.resume()
        await asyncio.wait_for(waiting, 1)
    asyncio.run(main())


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
def test_the_services_holders_keep_new_work_until_resume_whatever_aborts_pass(mode):
    """`resumed`, the gateway's, coordinator's and engine actor's wait: unlike `admit`, an abort lets nothing go."""
    async def main():
        gate = PauseGate()
        await asyncio.wait_for(gate.resumed(), 1)  # serving: at once
        gate.pause(mode)
        held = await _pending(gate.resumed())
        gate.abort()
        gate.pause("abort")
        await asyncio.sleep(0.01)
        still_held, paused = not held.done(), gate.paused
        gate.resume()
        await asyncio.wait_for(held, 1)
        return still_held, paused, gate.paused

    assert asyncio.run(main()) == (True, True, False)
