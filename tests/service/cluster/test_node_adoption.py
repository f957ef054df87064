"""Nodes that join the Ray cluster after the service started (a worker pod replaced, which Ray sees as a new node,
or one added) get engine actors and serve: a cluster of our own on this machine (`ray.cluster_utils.Cluster`),
stub engines."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest
import ray
from ray.cluster_utils import Cluster

from das.service.cluster.coordinator import RayBackend
from das.service.config import ServiceConfig
from das.service.wire.api import GroupRequest


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 100 << 20,
                                                          "include_dashboard": False})
    nodes.wait_for_nodes()
    ray.init(address=nodes.address)
    yield nodes
    ray.shutdown()
    nodes.shutdown()


def batch(count: int) -> list[GroupRequest]:
    return [GroupRequest(problem_id=f"p{i}", prompt_token_ids=[5, 6, 7 + i], n=2, sampling={"max_tokens": 4})
            for i in range(count)]


def test_a_node_that_joins_later_gets_an_engine_and_a_replaced_one_too(cluster: Cluster) -> None:
    loop = asyncio.new_event_loop()

    def run(coro):  # noqa: ANN001, ANN202 - a test helper
        return loop.run_until_complete(coro)

    async def collect(backend: RayBackend) -> set[str]:
        """The engines that served a batch of 8 groups x 2, every sample of which arrives once."""
        samples = [(index, sample) async for index, sample in backend.generate(batch(8))]
        assert sorted((index, s.sample_index) for index, s in samples) == [(g, j) for g in range(8) for j in (0, 1)]
        assert all(s.finish_reason == "length" for _, s in samples)
        return {s.engine for _, s in samples}

    def wait_for(condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 90
        while not condition():
            assert time.monotonic() < deadline, what
            run(asyncio.sleep(0.2))

    backend = run(RayBackend.start(ServiceConfig(engine={"kind": "stub", "tokens": 4, "token_s": 0.1},
                                                 adopt_nodes_interval_s=0.5)))
    try:
        run(backend.wait_ready())
        (first,) = backend.serving_engines
        assert run(collect(backend)) == {first}

        joined = cluster.add_node(num_cpus=1, object_store_memory=100 << 20)
        wait_for(lambda: len(backend.serving_engines) == 2, "the node that joined got no serving engine")
        second = next(name for name in backend.serving_engines if name != first)
        assert run(collect(backend)) == {first, second}  # the batch is placed over both

        # A replaced worker pod: its node leaves for good, mid-batch, and a new one joins in its place. What the
        # engine there owed runs elsewhere: the batch ends complete.
        running = loop.create_task(collect(backend))
        run(asyncio.sleep(0.3))
        cluster.remove_node(joined)
        assert run(running) >= {first}
        replacement = cluster.add_node(num_cpus=1, object_store_memory=100 << 20)
        wait_for(lambda: any(name not in (first, second) for name in backend.serving_engines),
                 "the replacement node got no serving engine")
        third = next(name for name in backend.serving_engines if name not in (first, second))
        assert replacement.node_id[:6] in third
        wait_for(lambda: second not in backend.serving_engines, "the engine of the node that left still serves")
        # gone with its node: not listed as a failed engine (a replaced pod is not a failure)
        wait_for(lambda: second not in backend.engine_names, "the engine of the node that left is still listed")
        assert second not in backend.stats().engines_failed
        assert run(collect(backend)) == {first, third}
        assert run(backend.ready()) and run(backend.live())
    finally:
        run(backend.close())
        loop.close()
