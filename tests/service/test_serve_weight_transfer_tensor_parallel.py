"""vLLM's weight transfer into a tensor-parallel CPU engine through `das serve --tensor-parallel-size 2
--weight-transfer gloo`, on the tiny model: one engine of two model workers (processes), each joining the trainer's
gloo group at its own rank (1 + its tensor-parallel rank) and receiving every tensor, each loading its own shards.

The real path, served: `das serve` itself (the layout check, the engine actor, vLLM's multiprocess executor with
two workers), since what it adds over the in-process engine of tests/service/engine/vllm/test_tensor_parallel_cpu.py
is the rank layout the service hands the workers. vLLM's CPU backend binds each worker to a NUMA node of its own
unless VLLM_CPU_OMP_THREADS_BIND names their CPUs ("0|1"), which `das serve` requires on a node of one NUMA node
(service/cluster/engine_layout.py `cpu_engine_error`): the server gets this process's CPUs split in two.

As in the two-engine module (tests/service/test_serve_weight_transfer_two_engines.py), the server starts on the
checkpoint pushed, `other` is loaded by path, and the push must bring back the samples drawn at boot: a worker that
missed the push would compute with `other`'s shards."""

from __future__ import annotations

import os
from pathlib import Path

from tests.service.serve_process import Server
from tests.service.weight_pushes import draws, push, reload, tiny_checkpoints, transfer


def test_a_tensor_parallel_cpu_engine_takes_a_push_on_both_workers_and_draws_what_a_server_started_on_it_draws(
        tmp_path: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    assert len(cpus) >= 2, "two tensor-parallel workers need two CPUs"
    half = len(cpus) // 2
    bind = f"{','.join(map(str, cpus[:half]))}|{','.join(map(str, cpus[half:]))}"
    served, other = tiny_checkpoints(tmp_path / "weights")
    server = Server(served, tmp_path / "state", "--tensor-parallel-size", "2", "--weight-transfer", "gloo",
                    "--weights-root", str(tmp_path / "weights"), env={"VLLM_CPU_OMP_THREADS_BIND": bind})
    try:
        server.wait_ready()
        booted, version = draws(server.url, engines=1)
        info = transfer(server.url)
        assert (version, info.backend, info.world_size) == (0, "gloo", 2)  # one engine, two workers
        assert reload(server.url, other) == 1
        others, version = draws(server.url, engines=1)
        assert version == 1 and all(others[key] != booted[key] for key in booted)
        assert push(server.url, served) == 2
        assert draws(server.url, engines=1) == (booted, 2)
        assert transfer(server.url).policy_version == 2
    finally:
        server.stop()
