"""What an engine reports about its model runner (service/engine/runner_choice.py)."""

from __future__ import annotations

from types import SimpleNamespace

from das.service.engine.runner_choice import RunnerChoice


def test_read_from_vllms_config() -> None:
    config = SimpleNamespace(use_v2_model_runner=True, scheduler_config=SimpleNamespace(async_scheduling=True))
    assert RunnerChoice.of(config, "cuda").describe() == "cuda model runner V2, async scheduling on"
    config = SimpleNamespace(use_v2_model_runner=False, scheduler_config=SimpleNamespace(async_scheduling=None))
    assert RunnerChoice.of(config, "cpu") == RunnerChoice("cpu", "V1", False)
