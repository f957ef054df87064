"""Two service backends in one process on the Ray the first one starts (what `das bench e2e` does with its
`none-service` and `das-service` arms): closing the one that started Ray leaves the other serving, and Ray stops
with the last of them."""

from __future__ import annotations

import asyncio

import ray

from das.service.cluster.coordinator import RayBackend
from das.service.config import ServiceConfig
from das.service.wire.api import GroupRequest


def test_ray_stops_with_the_last_backend_not_the_one_that_started_it() -> None:
    assert not ray.is_initialized(), "another test left Ray running in this process"
    config = ServiceConfig(engine={"kind": "stub", "tokens": 4, "token_s": 0.001}, address="local")
    batch = [GroupRequest(problem_id="p", prompt_token_ids=[5, 6, 7], n=2, sampling={"max_tokens": 4})]

    async def scenario() -> tuple[int, bool]:
        first = await RayBackend.start(config)  # starts Ray
        second = await RayBackend.start(config)  # joins it
        await asyncio.gather(first.wait_ready(), second.wait_ready())
        await first.close()
        assert ray.is_initialized()
        samples = [s async for s in second.generate(batch)]  # its actors outlived the first backend
        await second.close()
        return len(samples), ray.is_initialized()

    loop = asyncio.new_event_loop()
    try:
        served, ray_up = loop.run_until_complete(scenario())
    finally:
        loop.close()
        if ray.is_initialized():
            ray.shutdown()
    assert served == 2
    assert not ray_up
