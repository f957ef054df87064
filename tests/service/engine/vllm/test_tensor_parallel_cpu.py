"""vLLM's CPU tensor parallelism with the tiny real model: an engine of two model workers (two processes) starts,
drafts with the DAS proposer on both, reloads weights while paused and resumes, through the same `VllmEngine` code as
one worker, every worker RPC answered per worker (service/engine/vllm/worker_rpc.py).

vLLM's CPU backend binds each worker's threads to a NUMA node of its own unless VLLM_CPU_OMP_THREADS_BIND names a
core list per worker ("0|1"): on a machine of one NUMA node it refuses to start two workers otherwise ("Not enough
allowed NUMA nodes to bind threads of 2 local CPUWorkers"), so the test splits this process's CPUs in two."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from das.service.engine.vllm.engine import VllmEngine, EngineConfig
from das.service.engine.vllm.models import prepare_model
from das.service.wire.api import GroupRequest
from tests.tiny_models import build_tiny_model


def test_a_cpu_engine_of_two_tensor_parallel_workers_generates_reloads_and_pauses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    assert len(cpus) >= 2, "two tensor-parallel workers need two CPUs"
    half = len(cpus) // 2
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{','.join(map(str, cpus[:half]))}|"
                                                    f"{','.join(map(str, cpus[half:]))}")
    smollm2 = prepare_model("smollm2", progress=False)
    first = build_tiny_model(tmp_path / "v0", smollm2, vocab_size=32, seed=0, sharpness=12.0)
    second = build_tiny_model(tmp_path / "v1", smollm2, vocab_size=32, seed=1, sharpness=12.0)
    group = GroupRequest(problem_id="p", prompt_token_ids=[3, 4, 5], n=2,
                         sampling={"max_tokens": 8, "temperature": 0.0, "ignore_eos": True})

    async def scenario() -> tuple[list[list[int]], bool, int, list[list[int]], dict[str, object]]:
        engine = await VllmEngine.create(EngineConfig(model=str(first), tensor_parallel_size=2, enforce_eager=True,
                                                  cost_warmup_requests=0, max_model_len=256, max_num_seqs=8,
                                                  kv_cache_gib=1))
        try:
            before = [s.token_ids async for s in engine.generate(group)]
            await engine.pause("keep")
            paused = await engine.is_paused()
            version = await engine.reload_weights(second)
            await engine.resume()
            after = [s.token_ids async for s in engine.generate(group)]
            return before, paused, version, after, await engine.drafter_stats()
        finally:
            await engine.close()

    before, paused, version, after, stats = asyncio.run(scenario())
    assert paused and version == 1
    assert len(before) == len(after) == 2 and all(len(t) == 8 for t in before + after)
    assert before != after  # the second checkpoint's weights serve
    assert stats["steps"] > 0 and stats["stored_tokens"] > 0  # the proposer drafted on the output rank
