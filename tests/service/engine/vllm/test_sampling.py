"""What vLLM would refuse is refused before anything is scheduled, and a sample's task that fails anyway ends its
group (and the gateway's batch) instead of leaving it waiting forever. vLLM's real `SamplingParams`, with an
`VllmEngine` over a stand-in for AsyncLLM (no engine process); test_engine.py runs the real engine."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from das.service.cluster.rollout_backend import EngineBackend
from das.service.engine.vllm.engine import VllmEngine, EngineConfig, EngineInputError
from das.service.engine.vllm.sampling import sampling_params
from das.service.http.gateway import create_app
from das.service.config import GatewayConfig
from das.service.wire.api import GroupRequest, SampleResult, SamplingSpec
from tests.service.engine.vllm.vllm_frontend import PassThroughFrontend

VOCAB = 32


def unchecked(**sampling: Any) -> SamplingSpec:
    """A SamplingSpec that skipped the API's validation: what reaches the engine if the API's bounds ever fall
    behind vLLM's."""
    return SamplingSpec.model_construct(**{**SamplingSpec().model_dump(), **sampling})


@pytest.mark.parametrize("sampling, message", [
    ({"temperature": 3.0}, "sampling.temperature: temperature must be in"),
    ({"stop": ("",)}, "sampling: stop cannot contain an empty string"),
    ({"top_k": -2}, "sampling: top_k must be 0"),
    ({"stop_token_ids": (VOCAB,)}, "sampling.stop_token_ids: 32 is outside the vocabulary"),
])
def test_what_vllm_refuses_is_an_engine_input_error_naming_the_field(sampling, message):
    with pytest.raises(EngineInputError, match=message):
        sampling_params(unchecked(**sampling), VOCAB)


def test_extra_args_vllm_cannot_carry_are_refused():
    with pytest.raises(EngineInputError, match="sampling.extra_args"):
        sampling_params(SamplingSpec(), VOCAB, {"das": {"x": 2**70}})


def test_the_apis_bounds_lie_within_vllms():
    """Every edge SamplingSpec accepts builds: nothing admitted can be refused later."""
    spec = SamplingSpec(temperature=2.0, top_p=1e-9, top_k=-1, max_tokens=2**31 - 1, stop=["x"],
                        stop_token_ids=[VOCAB - 1], ignore_eos=True)
    params = sampling_params(spec, VOCAB, {"das": {"sample_index": 2**63 - 1}})
    assert (params.temperature, params.top_k, params.max_tokens, params.stop) == (2.0, -1, 2**31 - 1, ["x"])
    assert params.n == 1 and params.logprobs == 0


class FakeLLM(PassThroughFrontend):
    """Stands in for AsyncLLM: each request yields its max_tokens tokens in one output."""

    errored = False

    async def generate(self, prompt: Any, params: Any, request_id: str, trace_headers: Any = None) -> Any:
        n = params.max_tokens
        yield SimpleNamespace(outputs=[SimpleNamespace(
            token_ids=[3] * n, logprobs=[{3: SimpleNamespace(logprob=-0.1)}] * n, text="", finish_reason="length")])

    async def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[None]:
        return [None]

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        return None

    async def is_paused(self) -> bool:
        return False


class SpaceTokenizer:
    """One token a word: a blank text has none."""

    def encode(self, text: str) -> list[int]:
        return [5] * len(text.split())


@pytest.fixture
def engine() -> VllmEngine:
    return VllmEngine(EngineConfig(model="unused", speculation="none"), FakeLLM(), SpaceTokenizer(), VOCAB)


def collect(engine: VllmEngine, group: GroupRequest) -> list[SampleResult]:
    async def run() -> list[SampleResult]:
        return [s async for s in engine.generate(group)]

    return asyncio.run(asyncio.wait_for(run(), 10))


def test_the_engine_refuses_at_admission_what_vllm_would_refuse(engine):
    hot = GroupRequest(problem_id="h", prompt_token_ids=[5], n=2).model_copy(
        update={"sampling": unchecked(temperature=3.0)})
    with pytest.raises(EngineInputError, match="sampling.temperature"):
        engine.prompt_token_ids(hot)  # what the service's admission calls
    with pytest.raises(EngineInputError, match="sampling.temperature"):
        collect(engine, hot)
    with pytest.raises(EngineInputError, match="prompt: no tokens"):
        engine.prompt_token_ids(GroupRequest(problem_id="b", prompt="  "))
    assert engine._inflight == 0
    assert [s.finish_reason for s in collect(engine, GroupRequest(problem_id="ok", prompt="a b", n=2))] == \
        ["length", "length"]


def test_a_sample_task_that_raises_fails_its_group_instead_of_hanging(engine, monkeypatch):
    async def broken(key: str) -> dict[str, int]:
        raise RuntimeError("counts exploded")

    monkeypatch.setattr(engine, "_draft_counts", broken)
    with pytest.raises(RuntimeError, match="a sample of problem f failed: RuntimeError: counts exploded"):
        collect(engine, GroupRequest(problem_id="f", prompt_token_ids=[5, 6], n=3))
    assert engine._inflight == 0


def test_through_the_gateway_the_batch_fails_and_a_reload_follows(engine, monkeypatch, tmp_path: Path, caplog):
    """The issue's hang end to end: a sample's task raising once left its batch running with 0 samples and every
    weights reload waiting on it."""
    async def broken(key: str) -> dict[str, int]:
        raise RuntimeError("counts exploded")

    monkeypatch.setattr(engine, "_draft_counts", broken)
    (tmp_path / "model.safetensors").write_bytes(b"")
    app = create_app(EngineBackend(engine), GatewayConfig(weights_root=tmp_path))

    async def scenario() -> tuple[list[str], httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
            batch = await http.post("/v1/rollouts", json={"batch_id": "b", "groups": [
                {"problem_id": "f", "prompt_token_ids": [5, 6], "n": 2, "sampling": {"max_tokens": 4}}]})
            reload = await http.post("/v1/weights", json={"path": str(tmp_path), "version": 1})
            return batch.text.splitlines(), reload

    with caplog.at_level("ERROR", logger="das.service.http.gateway"):
        lines, reload = asyncio.run(asyncio.wait_for(scenario(), 20))
    summary = json.loads(lines[-1])["summary"]
    assert summary["status"] == "failed" and "counts exploded" in summary["error"]
    assert any(r.getMessage() == "batch b failed" for r in caplog.records)
    assert reload.status_code == 200 and reload.json()["policy_version"] == 1
