"""What an engine that loads after the start (restarted, or on a node that joined) catches up to
(service/cluster/engine_supervisor.py `_catch_up`): the newer of the last checkpoint reload and the last push saved
(`ServedPolicy.pushed`, service/cluster/weight_relay.py); a saved push its node cannot read falls back to the
checkpoint with an error logged. Over a stand-in actor handle: no Ray."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from das.service.cluster.engine_failure import RestartWindow
from das.service.cluster.engine_supervisor import ActorRecord, EngineSupervisor, ServedPolicy
from das.service.config import ServiceConfig
from das.service.engine.contract import EngineInputError
from das.service.wire.engine_control import ReloadWeights


class _Call:
    def __init__(self, method: Any) -> None:
        self.method = method

    def remote(self, *args: Any) -> Any:
        return self.method(*args)


class Handle:
    """A NodeEngine actor's handle: serves `version`, can read the paths in `readable`."""

    def __init__(self, version: int, readable: set[str]) -> None:
        self.version, self.readable, self.loaded = version, readable, []
        self.policy_version = _Call(self._policy_version)
        self.control = _Call(self._control)

    async def _policy_version(self) -> int:
        return self.version

    async def _control(self, message: ReloadWeights) -> int:
        if message.checkpoint not in self.readable:
            raise EngineInputError(f"{message.checkpoint}: not a directory with *.safetensors weights")
        self.loaded.append(message.checkpoint)
        self.version = message.version
        return message.version


def catch_up(policy: ServedPolicy, handle: Handle) -> list[str]:
    config = ServiceConfig(engine={"kind": "stub"})
    supervisor = EngineSupervisor(config, [], [], gpu_nodes=False, policy=policy)
    asyncio.run(supervisor._catch_up(ActorRecord(handle, RestartWindow(config.failure), names=["n/0"])))
    return handle.loaded


def test_the_saved_push_is_loaded_when_it_is_newer_than_the_last_checkpoint():
    policy = ServedPolicy(version=5, weights=("/ckpt/3", 3), pushed=("/state/pushed-weights/v5", 5))
    assert catch_up(policy, Handle(0, {"/ckpt/3", "/state/pushed-weights/v5"})) == ["/state/pushed-weights/v5"]


def test_a_checkpoint_reloaded_after_the_push_wins():
    policy = ServedPolicy(version=6, weights=("/ckpt/6", 6), pushed=("/state/pushed-weights/v5", 5))
    assert catch_up(policy, Handle(0, {"/ckpt/6", "/state/pushed-weights/v5"})) == ["/ckpt/6"]


def test_an_engine_that_kept_its_weights_loads_nothing():
    policy = ServedPolicy(version=5, weights=("/ckpt/3", 3), pushed=("/state/pushed-weights/v5", 5))
    assert catch_up(policy, Handle(5, set())) == []


def test_a_saved_push_its_node_cannot_read_falls_back_to_the_checkpoint(caplog):
    policy = ServedPolicy(version=5, weights=("/ckpt/3", 3), pushed=("/state/pushed-weights/v5", 5))
    with caplog.at_level(logging.WARNING):
        assert catch_up(policy, Handle(0, {"/ckpt/3"})) == ["/ckpt/3"]
    assert "cannot load the saved push /state/pushed-weights/v5" in caplog.text
    assert "serves policy version 3, not the pushed 5" in caplog.text


def test_an_unreadable_checkpoint_still_fails_the_load():
    policy = ServedPolicy(version=3, weights=("/ckpt/3", 3))
    with pytest.raises(EngineInputError):
        catch_up(policy, Handle(0, set()))


def test_without_a_saved_push_the_engine_serves_its_checkpoint_and_says_how_to_save_pushes(caplog):
    with caplog.at_level(logging.WARNING):
        assert catch_up(ServedPolicy(version=2), Handle(0, set())) == []
    assert "serves policy version 0, not the pushed 2" in caplog.text and "--state-dir" in caplog.text
