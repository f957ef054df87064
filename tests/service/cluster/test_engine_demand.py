"""With `target_engines` the service asks Ray's autoscaler for room for its engines (request_resources: one bundle
of an engine's GPUs each) and starts engines on GPU nodes only, up to the target: the demand an autoscaler sees is
the bundles no node can hold, by the autoscaler's own bin packing. It appears while engines are wanted and no node
can hold them, goes once they run, and the request is withdrawn at close. A node beyond the target gets no engine
(it stays idle, for an autoscaler to remove); an engine whose node left drops out of the service's figures, and a
node that joins in its place gets an engine. A cluster of our own on this machine (`ray.cluster_utils.Cluster`,
nodes with a logical GPU), stub engines."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import ray
from ray.autoscaler._private.constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
from ray.autoscaler._private.resource_demand_scheduler import get_bin_pack_residual
from ray.cluster_utils import Cluster
from ray.experimental.internal_kv import _internal_kv_get

from das.service.cluster.coordinator import RayBackend
from das.service.config import ServiceConfig


def requested() -> list[dict[str, float]]:
    """The bundles the service asked the autoscaler for (v1's channel, where a cluster without autoscaler v2 keeps
    it)."""
    raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return json.loads(raw) if raw else []


def pending() -> list[dict[str, float]]:
    """The requested bundles that the live nodes' resources cannot hold: what makes an autoscaler add nodes."""
    nodes = [dict(n["Resources"]) for n in ray.nodes() if n["Alive"]]
    unfulfilled, _ = get_bin_pack_residual(nodes, requested())
    return unfulfilled


def test_engines_wanted_are_demand_until_they_run_and_nodes_beyond_them_stay_idle() -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 100 << 20,
                                                            "include_dashboard": False})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    loop = asyncio.new_event_loop()

    def run(coro):  # noqa: ANN001, ANN202 - a test helper
        return loop.run_until_complete(coro)

    def wait_for(condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 90
        while not condition():
            assert time.monotonic() < deadline, what
            run(asyncio.sleep(0.2))

    def gpu_node():  # noqa: ANN202 - a test helper
        return cluster.add_node(num_cpus=1, num_gpus=1, object_store_memory=100 << 20)

    backend = run(RayBackend.start(ServiceConfig(engine={"kind": "stub", "tokens": 4}, target_engines=2,
                                                 adopt_nodes_interval_s=0.3)))
    try:
        # No GPU node yet: no engine on the head, two engines' GPUs asked for and pending; alive, not ready.
        assert backend.engine_names == []
        assert requested() == [{"GPU": 1.0}, {"GPU": 1.0}] and len(pending()) == 2
        assert run(backend.live()) and not run(backend.ready())

        first = gpu_node()
        wait_for(lambda: len(backend.serving_engines) == 1, "the first GPU node got no engine")
        assert len(pending()) == 1
        second = gpu_node()
        wait_for(lambda: len(backend.serving_engines) == 2, "the second GPU node got no engine")
        assert pending() == [] and run(backend.ready())

        # Beyond the target: the node gets no engine, so nothing holds it and an autoscaler may remove it.
        spare = gpu_node()
        run(asyncio.sleep(1.5))
        assert len(backend.engine_names) == 2 and not any(spare.node_id[:6] in n for n in backend.engine_names)

        # An engine's node leaves: the engine leaves the figures, and the spare node gets an engine in its place.
        gone = next(n for n in backend.engine_names if first.node_id[:6] in n)
        cluster.remove_node(first)
        wait_for(lambda: gone not in backend.engine_names, "the engine of the node that left is still listed")
        stats = backend.stats()
        assert gone not in stats.engines_failed and gone not in stats.engine_placed_tokens
        wait_for(lambda: any(spare.node_id[:6] in n for n in backend.serving_engines),
                 "the spare node got no engine after an engine's node left")
        assert len(backend.serving_engines) == 2 and pending() == []
        assert any(second.node_id[:6] in n for n in backend.serving_engines)
    finally:
        run(backend.close())
        loop.close()
    try:
        assert requested() == []  # no longer wanted: nothing holds the nodes up
    finally:
        ray.shutdown()
        cluster.shutdown()
