"""A weight push through the gateway (service/http/weight_updates.py, routes in rl_control.py), in process over a
stub backend that records the engines' side: the routes' shapes, the reload lock held from start to finish, one
version move, a failure or a silent trainer giving the push up everywhere, calls out of turn refused."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from das.service.cluster.rollout_backend import WeightUpdateConflict
from das.service.engine.stub_engine import StubEngine, StubEngineConfig
from das.service.engine.contract import EngineInputError
from das.service.http.gateway import create_app
from das.service.config import GatewayConfig
from das.service.http.rl_control import WEIGHT_TRANSFER_UNAVAILABLE
from das.service.wire.engine_control import (
    EngineControl,
    FinishWeightUpdate,
    InitWeightTransfer,
    WeightTransferStep,
)
from tests.service.serve_process import metric
from tests.service.stub_backend import RecordingBackend, stub_backend

TOKEN = "push-token"
UPDATE = {"names": ["w", "b"], "dtype_names": ["float32", "bfloat16"], "shapes": [[4, 8], [8]]}
UPDATE_BYTES = 4 * 8 * 4 + 8 * 2


class PushBackend(RecordingBackend):
    """A stub whose engines take pushes: records every transfer step it is sent (its other control messages reach
    the stub engine); `fail` makes the step with that verb raise."""

    weight_transfer = "gloo"

    def __init__(self, fail: dict[str, Exception] | None = None) -> None:
        super().__init__(StubEngine(StubEngineConfig(tokens=4)))
        self.calls: list[str] = []
        self.fail = fail or {}

    def transfer_world_size(self) -> int:
        return 3

    async def control(self, message: EngineControl) -> Any:
        if not isinstance(message, WeightTransferStep):
            return await super().control(message)
        self.calls.append(message.verb)
        if message.verb in self.fail:
            raise self.fail[message.verb]
        if isinstance(message, InitWeightTransfer):
            self.calls[-1] += f" {message.init_info['world_size']}"
        if isinstance(message, FinishWeightUpdate):
            self.calls[-1] += f" {message.version}"
            self.engine.policy_version = message.version
            return message.version
        return None


async def against(scenario: Callable[[httpx.AsyncClient], Awaitable[Any]], backend: Any, **settings: Any) -> Any:
    app = create_app(backend, GatewayConfig(token=TOKEN, **settings))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway",
                                 headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as http:
        return await asyncio.wait_for(scenario(http), 30)


GROUP = {"problem_id": "p", "prompt_token_ids": [5, 6], "n": 2, "sampling": {"max_tokens": 4}}


async def versions_of_a_batch(http: httpx.AsyncClient) -> set[int]:
    response = await http.post("/v1/rollouts", json={"groups": [GROUP]})
    return {json.loads(line)["policy_version"] for line in response.text.splitlines()[:-1]}


def test_a_push_holds_new_batches_from_start_to_finish_and_moves_the_version_once():
    backend = PushBackend()

    async def scenario(http: httpx.AsyncClient) -> None:
        assert (await http.get("/get_world_size")).json() == {"world_size": 3}
        assert (await http.get("/v1/weights/transfer")).json() == {"backend": "gloo", "world_size": 3,
                                                                   "policy_version": 0}
        init = await http.post("/init_weight_transfer_engine", json={"init_info": {"world_size": 4}})
        assert init.json() == {"message": "Weight transfer initialized"}
        assert (await http.post("/start_weight_update")).json() == {"message": "Weight update started"}
        held = asyncio.create_task(versions_of_a_batch(http))
        await asyncio.sleep(0.1)
        assert not held.done()  # held behind the push, as behind a checkpoint reload
        assert (await http.post("/update_weights", json={"update_info": UPDATE})).json() == {
            "message": "Weights updated"}
        finished = (await http.post("/finish_weight_update", json={})).json()
        assert finished["policy_version"] == 1 and finished["transfer_bytes"] == UPDATE_BYTES
        assert await held == {1}
        text = (await http.get("/metrics")).text
        assert metric(text, "das_weight_transfers") == 1
        assert metric(text, "das_weight_transfer_bytes") == UPDATE_BYTES
        assert metric(text, "das_policy_version") == 1
        assert backend.calls == ["init_weight_transfer 4", "start_weight_update", "update_weights",
                                 "finish_weight_update 1"]

    asyncio.run(against(scenario, backend))


@pytest.mark.parametrize("failure, status, says", [
    (EngineInputError("update_info.names: 'x' is not a tensor of the served checkpoint"), 400, "'x' is not a tensor"),
    (RuntimeError("Connection closed by peer"), 500, "given up on every engine, which serve policy version 0"),
])
def test_a_failed_update_gives_the_push_up_everywhere_and_lets_batches_run(failure, status, says):
    backend = PushBackend(fail={"update_weights": failure})

    async def scenario(http: httpx.AsyncClient) -> None:
        await http.post("/start_weight_update")
        response = await http.post("/update_weights", json={"update_info": UPDATE})
        assert response.status_code == status and says in response.json()["error"]["message"]
        assert backend.calls == ["start_weight_update", "update_weights", "abort_weight_update"]
        assert backend.policy_version == 0
        assert await versions_of_a_batch(http) == {0}  # the lock is free again
        late = await http.post("/finish_weight_update", json={})
        assert late.status_code == 409 and "no weight update is open" in late.json()["error"]["message"]

    asyncio.run(against(scenario, backend))


@pytest.mark.parametrize("weight_version, status, says", [("abc", 400, "an integer"), ("0", 409, "not newer")])
def test_a_refused_weight_version_gives_the_push_up(weight_version, status, says):
    backend = PushBackend()

    async def scenario(http: httpx.AsyncClient) -> None:
        await http.post("/start_weight_update")
        await http.post("/update_weights", json={"update_info": UPDATE})
        response = await http.post("/finish_weight_update", json={"weight_version": weight_version})
        assert response.status_code == status and says in response.json()["error"]["message"]
        assert backend.calls[-1] == "abort_weight_update" and backend.policy_version == 0
        text = (await http.get("/metrics")).text
        assert metric(text, "das_weight_transfers") == 0

    asyncio.run(against(scenario, backend))


def test_calls_out_of_turn_are_409_and_change_nothing():
    backend = PushBackend()

    async def scenario(http: httpx.AsyncClient) -> None:
        for path, body in [("/update_weights", {"update_info": UPDATE}), ("/finish_weight_update", {})]:
            response = await http.post(path, json=body)
            assert response.status_code == 409 and response.json()["error"]["code"] == "weight_update_conflict"
        await http.post("/start_weight_update")
        again = await http.post("/start_weight_update")
        assert again.status_code == 409 and "already open" in again.json()["error"]["message"]
        joining = await http.post("/init_weight_transfer_engine", json={"init_info": {"world_size": 4}})
        assert joining.status_code == 409
        assert backend.calls == ["start_weight_update"]

    asyncio.run(against(scenario, backend))


def test_a_trainer_silent_past_the_idle_limit_has_its_push_given_up():
    backend = PushBackend()

    async def scenario(http: httpx.AsyncClient) -> None:
        await http.post("/start_weight_update")
        await asyncio.sleep(0.5)
        assert backend.calls == ["start_weight_update", "abort_weight_update"]
        assert await versions_of_a_batch(http) == {0}
        assert (await http.post("/update_weights", json={"update_info": UPDATE})).status_code == 409

    asyncio.run(against(scenario, backend, weight_update_idle_s=0.2))


def test_without_weight_transfer_the_routes_answer_501_naming_the_flag():
    async def scenario(http: httpx.AsyncClient) -> None:
        response = await http.post("/start_weight_update")
        assert response.status_code == 501 and response.json()["error"]["message"] == WEIGHT_TRANSFER_UNAVAILABLE
        assert (await http.get("/v1/weights/transfer")).json()["backend"] is None
        draft = await http.post("/start_draft_weight_update")
        assert draft.status_code == 501 and "no draft model" in draft.json()["error"]["message"]

    assert "--weight-transfer none" in WEIGHT_TRANSFER_UNAVAILABLE
    asyncio.run(against(scenario, stub_backend()))


def test_a_conflict_from_the_engines_is_409():
    backend = PushBackend(fail={"start_weight_update": WeightUpdateConflict(
        "the engines changed since /init_weight_transfer_engine")})

    async def scenario(http: httpx.AsyncClient) -> None:
        response = await http.post("/start_weight_update")
        assert response.status_code == 409 and "engines changed" in response.json()["error"]["message"]
        assert await versions_of_a_batch(http) == {0}  # the lock was released

    asyncio.run(against(scenario, backend))
