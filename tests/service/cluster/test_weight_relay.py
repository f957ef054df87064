"""Which error a push that fails on several engines answers with (service/cluster/weight_relay.py `WeightRelay`):
over stand-in actor handles and a stand-in supervisor, no Ray actors. An engine that dies mid-push breaks the
receives of the others too (gloo's "Connection closed by peer" once the trainer leaves the group): the answer must
name the dead engine wherever it sits in the group, and a refusal, which says what to change, wins over both."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import ray.exceptions

from das.service.cluster.engine_failure import RestartWindow
from das.service.cluster.engine_supervisor import ActorRecord, ServedPolicy
from das.service.cluster.weight_relay import WeightRelay
from das.service.config import ServiceConfig
from das.service.engine.contract import EngineInputError
from das.service.wire.engine_control import InitWeightTransfer, StartWeightUpdate, UpdateWeights

BROKEN = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:913")


class _Control:
    """`NodeEngine.control` of a stand-in actor: every message answered, but `UpdateWeights`, which ends with
    `update` (None: received)."""

    def __init__(self, update: BaseException | None) -> None:
        self.update = update

    def remote(self, message: Any) -> Any:
        async def reply() -> None:
            if isinstance(message, UpdateWeights) and self.update is not None:
                raise self.update
        return reply()


class Handle:
    """A NodeEngine actor's handle whose /update_weights ends with `update` (None: received)."""

    def __init__(self, update: BaseException | None) -> None:
        self.control = _Control(update)


class Supervisor:
    """The engines, one per actor, all serving; records the deaths reported."""

    def __init__(self, actors: list[ActorRecord]) -> None:
        self.actors = actors
        self.deaths: list[list[str]] = []

    def serving(self) -> list[tuple[ActorRecord, int, str]]:
        return [(actor, 0, actor.names[0]) for actor in self.actors if actor.state == "serving"]

    def serving_actors(self) -> list[ActorRecord]:
        return [actor for actor, _, _ in self.serving()]

    def engine_died(self, actor: ActorRecord, incarnation: int, error: BaseException) -> None:
        self.deaths.append(actor.names)
        actor.state = "recovering"


def failed_push(updates: list[BaseException | None]) -> tuple[BaseException, Supervisor]:
    """A push to engines n/0, n/1, ... whose receives end with `updates`: the error it raised, the supervisor."""
    config = ServiceConfig(engine={"kind": "stub"})
    actors = [ActorRecord(Handle(update), RestartWindow(config.failure), names=[f"n/{i}"], state="serving")
              for i, update in enumerate(updates)]
    supervisor = Supervisor(actors)
    relay = WeightRelay(config, supervisor, ServedPolicy(), gpu_nodes=False)  # type: ignore[arg-type]

    async def push() -> BaseException:
        await relay.control(InitWeightTransfer(init_info={"rank_offset": 1, "world_size": 1 + len(updates)}))
        await relay.control(StartWeightUpdate())
        with pytest.raises(Exception) as raised:
            await relay.control(UpdateWeights(update_info={"names": []}))
        return raised.value

    return asyncio.run(push()), supervisor


@pytest.mark.parametrize("dead", [0, 1, 2])
def test_the_answer_names_the_engine_that_died_wherever_it_sits_in_the_group(dead: int) -> None:
    updates: list[BaseException | None] = [BROKEN, BROKEN, BROKEN]
    updates[dead] = ray.exceptions.ActorDiedError()
    error, supervisor = failed_push(updates)
    assert str(error) == f"engine n/{dead} died during the weight transfer"
    assert supervisor.deaths == [[f"n/{dead}"]]


def test_a_refusal_wins_over_a_death_and_a_broken_receive() -> None:
    error, supervisor = failed_push([BROKEN, ray.exceptions.ActorDiedError(), EngineInputError("update_info: no")])
    assert isinstance(error, EngineInputError) and str(error) == "update_info: no"
    assert supervisor.deaths == [["n/1"]]
