"""A node's GPUs split into engines of `tensor_parallel_size` GPUs (service/cluster/engine_layout.py): the rule, and the
Ray placement over a cluster that declares 4 GPUs on this CPU machine (Ray hands GPUs out by count; nothing here uses
CUDA): two TP=2 engine actors holding 2 GPUs each, and a size that does not divide refused before any actor."""

from __future__ import annotations

import asyncio

import pytest
import ray

from das.service.cluster.coordinator import RayBackend
from das.service.config import ServiceConfig
from das.service.cluster.engine_layout import LayoutError, gpu_engines
from das.service.wire.api import GroupRequest


def test_engines_per_gpu_node_are_derived_from_the_tensor_parallel_size() -> None:
    assert [gpu_engines(8, tp) for tp in (1, 2, 4, 8)] == [8, 4, 2, 1]
    with pytest.raises(LayoutError, match=r"node n1 has 8 GPU\(s\), which --tensor-parallel-size 3 does not divide"):
        gpu_engines(8, 3, "node n1")
    with pytest.raises(LayoutError, match="does not divide"):
        gpu_engines(2, 4)


def test_a_gpu_node_runs_one_actor_per_tensor_parallel_engine_holding_its_gpus() -> None:
    assert not ray.is_initialized(), "another test left Ray running in this process"
    ray.init(address="local", num_cpus=2, num_gpus=4, include_dashboard=False, object_store_memory=128 << 20)
    batch = [GroupRequest(problem_id=f"p{i}", prompt_token_ids=[5, 6], n=2, sampling={"max_tokens": 4})
             for i in range(4)]

    async def scenario() -> tuple[list[str], float, int]:
        with pytest.raises(LayoutError, match="4 GPU.*--tensor-parallel-size 3 does not divide"):
            await RayBackend.start(ServiceConfig(engine={"kind": "stub", "tensor_parallel_size": 3}))
        backend = await RayBackend.start(ServiceConfig(engine={"kind": "stub", "tokens": 4, "tensor_parallel_size": 2}))
        try:
            await backend.wait_ready()
            free_gpus = ray.available_resources().get("GPU", 0.0)
            samples = [s async for _, s in backend.generate(batch)]
            return backend.engine_names, free_gpus, len(samples)
        finally:
            await backend.close()

    try:
        names, free_gpus, served = asyncio.run(scenario())
    finally:
        ray.shutdown()
    assert len(names) == 2 and names[0] != names[1]  # 4 GPUs / 2 per engine
    assert free_gpus == 0  # each engine actor holds its 2
    assert served == 8
