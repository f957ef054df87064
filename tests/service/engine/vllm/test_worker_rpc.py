"""Per-worker replies of `collective_rpc` (service/engine/vllm/worker_rpc.py), and a tensor-parallel engine over stub
workers: an `VllmEngine` with `tensor_parallel_size=2` over a stand-in for AsyncLLM whose two workers each answer every
RPC, so the engine's own code reloads weights, pauses, imports history and reads stats and profiles per worker."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from das.service.engine.vllm.engine import VllmEngine, EngineConfig
from das.service.engine.vllm.step_profile import FIELDS
from das.service.engine.vllm.worker_rpc import RULES, WorkerRepliesDiffer, one_reply
from das.service.wire.api import GroupRequest, SampleResult
from tests.service.engine.vllm.vllm_frontend import PassThroughFrontend

VOCAB = 32


def test_replies_that_must_agree_are_one_or_a_clear_error() -> None:
    assert one_reply("das_add_rollouts", [3, 3]) == 3
    with pytest.raises(WorkerRepliesDiffer, match=r"das_add_rollouts: .* 2 model workers replied differently.*"
                                                  r"worker 0: 3; worker 1: 2"):
        one_reply("das_add_rollouts", [3, 2])


def test_draft_statistics_are_the_output_ranks_and_profiles_the_slowest_worker() -> None:
    assert one_reply("das_stats", [{"steps": 4}, {"steps": 5}]) == {"steps": 4}  # worker 0: its drafts are served
    slowest = one_reply("das_profile_take", [{"forward_s": [1.0, 5.0], "tokens": [3, 4]},
                                             {"forward_s": [2.0, 4.0], "tokens": [3, 4]}])
    assert slowest == {"forward_s": [2.0, 5.0], "tokens": [3, 4]}
    with pytest.raises(WorkerRepliesDiffer, match="timed different steps"):
        one_reply("das_profile_take", [{"forward_s": [1.0]}, {"forward_s": [1.0, 2.0]}])


def test_an_rpc_without_a_rule_or_without_replies_is_refused() -> None:
    with pytest.raises(ValueError, match="das_new_thing: no rule"):
        one_reply("das_new_thing", [1])
    with pytest.raises(ValueError, match="no worker replied"):
        one_reply("das_stats", [])


def test_every_worker_method_the_engine_calls_has_a_rule() -> None:
    """A new worker RPC cannot slip in without deciding how its per-worker replies become one."""
    source = (Path(__file__).resolve().parents[4] / "service" / "engine" / "vllm" / "engine.py").read_text()
    import re

    called = set(re.findall(r'worker_rpc\([^,]+, "(\w+)"', source))
    assert called and called <= RULES.keys(), called - RULES.keys()


class StubWorker:
    """One model worker: the proposer's state as the DAS worker extension reports it, and step timings of its own
    (`slow`: how much longer its steps take)."""

    def __init__(self, rank: int, slow: float) -> None:
        self.rank, self.slow = rank, slow
        self.version = 0
        self.rollouts = 0
        self.weights: list[str] = []
        self.profiling = False

    def das_attach(self) -> bool:
        return True

    def das_set_policy_version(self, version: int) -> int:
        self.version = version
        return version

    def das_add_rollouts(self, rollouts: list[dict[str, Any]]) -> int:
        self.rollouts += len(rollouts)
        return len(rollouts)

    def das_output_counts(self) -> dict[str, int]:
        return {}

    def reload_weights(self, weights_path: str) -> None:
        self.weights.append(weights_path)

    def das_refresh_tied_head(self) -> bool:
        self.weights.append("tied head refreshed")
        return True

    # vLLM's weight-transfer methods of its worker, and ours to give an update up
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.transfer = ["init"]

    def start_weight_update(self) -> None:
        self.transfer.append("start")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        if update_info.get("names") == ["bad"]:
            raise Exception("Call to collective_rpc method failed: update_info.names: 'bad' is not a tensor of "
                            "the served checkpoint")
        self.transfer.append("update")

    def finish_weight_update(self) -> None:
        self.transfer.append("finish")

    def das_abort_weight_update(self) -> bool:
        self.transfer.append("abort")
        return True

    def das_keep_weight_update(self) -> bool:
        self.transfer.append("keep")
        return True

    def das_save_weight_update(self, root: str, version: int) -> str:
        self.transfer.append("save")
        return f"{root}/v{version}"

    def das_pop_counts(self, keys: list[str]) -> dict[str, dict[str, int]]:
        return {key: {"proposed": 4 + self.rank, "accepted": 2, "steps": 3} for key in keys}

    def das_stats(self) -> dict[str, Any]:
        return {"history_records": self.rollouts, "rank": self.rank}

    def das_profile_start(self) -> bool:
        self.profiling = True
        return True

    def das_profile_take(self) -> dict[str, list[float]]:
        return {name: [0.01 + self.slow if name == "forward_s" else 1.0] * 3 for name in FIELDS}


class TensorParallelLLM(PassThroughFrontend):
    """Stands in for AsyncLLM over `workers` model workers: every collective RPC runs on each of them and answers
    one reply per worker, as vLLM's does; pause and resume as vLLM's flags."""

    errored = False

    def __init__(self, workers: int) -> None:
        self.workers = [StubWorker(rank, slow=0.005 * rank) for rank in range(workers)]
        self.paused = False
        self.pauses: list[str] = []

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple[Any, ...] = (),
                             kwargs: dict[str, Any] | None = None) -> list[Any]:
        return [getattr(worker, method)(*args, **(kwargs or {})) for worker in self.workers]

    async def generate(self, prompt: Any, params: Any, request_id: str, trace_headers: Any = None) -> Any:
        yield SimpleNamespace(outputs=[SimpleNamespace(
            token_ids=[3, 4], logprobs=[{3: SimpleNamespace(logprob=-0.1)}, {4: SimpleNamespace(logprob=-0.2)}],
            text="", finish_reason="stop")])

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        self.paused = True
        self.pauses.append(mode)

    async def resume_generation(self) -> None:
        self.paused = False

    async def is_paused(self) -> bool:
        return self.paused

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        return None


def test_a_tensor_parallel_engine_reloads_pauses_and_reads_every_worker(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    llm = TensorParallelLLM(workers=2)
    engine = VllmEngine(EngineConfig(model="unused", tensor_parallel_size=2), llm, SimpleNamespace(), VOCAB)
    rollout = {"problem_id": "p", "policy_version": 0, "sample_index": 0, "prompt_token_ids": [1, 2], "output_token_ids": [3, 4],
               "finish_reason": "stop"}

    async def scenario() -> tuple[list[SampleResult], int, dict[str, Any], Any, bool]:
        await engine.pause("keep")
        paused = await engine.is_paused()
        version = await engine.reload_weights(tmp_path)  # while paused: reads every worker's output counts
        await engine.resume()
        samples = [s async for s in engine.generate(GroupRequest(problem_id="p", prompt_token_ids=[1, 2], n=2))]
        assert await engine.add_history([rollout]) == 1
        await engine.start_step_profile()
        return samples, version, await engine.drafter_stats(), await engine.take_step_profile(), paused

    samples, version, stats, profile, paused = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert paused and llm.pauses == ["keep"] and not llm.paused
    assert version == 1 and all(w.weights == [str(tmp_path), "tied head refreshed"] and w.version == 1
                                for w in llm.workers)
    assert all(w.rollouts == 1 and w.profiling for w in llm.workers)
    assert stats == {"history_records": 1, "rank": 0}
    # worker 0's drafts are the ones vLLM schedules: its counts
    assert [(s.draft_tokens, s.accepted_tokens, s.finish_reason) for s in samples] == [(4, 2, "stop")] * 2
    assert profile.forward_ms == pytest.approx(15.0)  # the slower worker's 0.015 s steps


def test_a_tensor_parallel_engine_pushes_through_every_worker_and_a_refusal_gives_the_push_up() -> None:
    from das.service.engine.contract import EngineInputError

    llm = TensorParallelLLM(workers=2)
    for method in ("init_weight_transfer_engine", "start_weight_update"):  # AsyncLLM's, over collective_rpc
        setattr(llm, method, lambda *a, _m=method, **k: llm.collective_rpc(_m, args=a, kwargs=k))
    llm.update_weights = lambda request: llm.collective_rpc("update_weights", args=(request.update_info,))
    engine = VllmEngine(EngineConfig(model="unused", tensor_parallel_size=2), llm, SimpleNamespace(), VOCAB)

    async def scenario() -> tuple[int, int]:
        await engine.init_weight_transfer({"world_size": 3})
        await engine.start_weight_update()
        await engine.update_weights({"names": ["w"]})
        pushed = await engine.finish_weight_update()
        await engine.start_weight_update()
        with pytest.raises(EngineInputError, match="'bad' is not a tensor"):
            await engine.update_weights({"names": ["bad"]})
        with pytest.raises(EngineInputError, match="no weight update is open"):
            await engine.finish_weight_update()
        return pushed, engine.policy_version

    assert asyncio.run(asyncio.wait_for(scenario(), 60)) == (1, 1)  # the refused push moved nothing
    assert all(w.transfer == ["init", "start", "update", "finish", "start", "abort"] for w in llm.workers)
    assert all(w.version == 1 for w in llm.workers)  # the drafter's window moved with the push, once


def test_a_kept_push_is_kept_then_saved_by_every_worker_of_the_engine() -> None:
    llm = TensorParallelLLM(workers=2)
    for method in ("init_weight_transfer_engine", "start_weight_update"):  # AsyncLLM's, over collective_rpc
        setattr(llm, method, lambda *a, _m=method, **k: llm.collective_rpc(_m, args=a, kwargs=k))
    engine = VllmEngine(EngineConfig(model="unused", tensor_parallel_size=2), llm, SimpleNamespace(), VOCAB)

    async def scenario() -> tuple[int, str]:
        await engine.init_weight_transfer({"world_size": 3})
        await engine.start_weight_update()
        pushed = await engine.finish_weight_update(3, keep=True)
        return pushed, await engine.save_weight_update("/state/pushed-weights", 3)

    assert asyncio.run(asyncio.wait_for(scenario(), 60)) == (3, "/state/pushed-weights/v3")
    assert all(w.transfer == ["init", "start", "keep", "finish", "save"] for w in llm.workers)


def test_workers_out_of_step_fail_the_call_with_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    llm = TensorParallelLLM(workers=2)
    llm.workers[1].das_add_rollouts = lambda rollouts: 0  # type: ignore[method-assign]
    engine = VllmEngine(EngineConfig(model="unused", tensor_parallel_size=2), llm, SimpleNamespace(), VOCAB)
    rollout = {"problem_id": "p", "policy_version": 0, "sample_index": 0, "prompt_token_ids": [1, 2], "output_token_ids": [3, 4],
               "finish_reason": "stop"}
    with pytest.raises(WorkerRepliesDiffer, match="das_add_rollouts: the engine's 2 model workers"):
        asyncio.run(engine.add_history([rollout]))
