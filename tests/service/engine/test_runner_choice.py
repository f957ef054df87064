"""What an engine reports about its model runner, and when it is forced onto V1 (service/engine/runner_choice.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from das.service.engine.runner_choice import RunnerChoice, forces_v1


def vllm_config(v2: bool, async_scheduling: bool | None) -> SimpleNamespace:
    return SimpleNamespace(use_v2_model_runner=v2, scheduler_config=SimpleNamespace(async_scheduling=async_scheduling))


def test_read_from_vllms_config() -> None:
    assert (RunnerChoice.of(vllm_config(True, True), "cuda").describe()
            == "cuda model runner V2, async scheduling on, unkeyed sampling")
    assert RunnerChoice.of(vllm_config(False, None), "cpu") == RunnerChoice("cpu", "V1", False, True)


@pytest.mark.parametrize(("platform", "v2", "keyed_sampling", "keyed"), [
    ("cpu", False, True, True), ("cuda", False, True, True),
    ("cuda", True, True, False),  # V2 samples with its own draw: our wrappers are not on its path
    ("rocm", False, True, False), ("xpu", False, True, False),  # samplers we do not wrap
    ("cuda", False, False, False)])  # keyed sampling turned off
def test_keyed_only_where_our_draw_wraps_the_sampler(platform: str, v2: bool, keyed_sampling: bool,
                                                    keyed: bool) -> None:
    assert RunnerChoice.of(vllm_config(v2, False), platform, keyed_sampling).keyed is keyed


def test_which_engines_are_forced_onto_v1() -> None:
    assert forces_v1("keyed", keyed_sampling=True, cpu=False)  # a GPU engine that must sample keyed
    assert not forces_v1("keyed", keyed_sampling=True, cpu=True)  # the CPU runs V1 anyway: vLLM's choice
    assert not forces_v1("keyed", keyed_sampling=False, cpu=False)  # nothing to keep: plain vLLM
    assert forces_v1("v1", keyed_sampling=False, cpu=True)
    assert not forces_v1("auto", keyed_sampling=True, cpu=False)  # plain vLLM as users run it
