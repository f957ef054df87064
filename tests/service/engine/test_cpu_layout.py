"""Where a CPU engine's model worker runs (a real engine's process tree: vllm/test_engine.py)."""

from __future__ import annotations

import logging
import os

import pytest

from das.service.engine.cpu_layout import IN_PROCESS_MAX_CPUS, cpu_worker_layout, worker_in_process


def test_auto_runs_the_worker_in_process_on_a_small_machine_only():
    assert worker_in_process("auto", 2) and worker_in_process("auto", IN_PROCESS_MAX_CPUS)
    assert not worker_in_process("auto", IN_PROCESS_MAX_CPUS + 1)
    assert worker_in_process("in_process", 64) and not worker_in_process("separate", 2)


@pytest.mark.parametrize("in_process", [True, False])
def test_the_layout_sets_the_spawn_environment_and_restores_it(monkeypatch, in_process):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what Ray gives a num_cpus=0 actor
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    with cpu_worker_layout(in_process):
        assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == ("0" if in_process else "1")
        assert os.environ.get("OMP_NUM_THREADS") == (None if in_process else "1")
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ and os.environ["OMP_NUM_THREADS"] == "1"


def test_the_layout_restores_the_environment_when_the_start_fails(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    with pytest.raises(RuntimeError, match="no engine"):
        with cpu_worker_layout(True):
            raise RuntimeError("no engine")
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1" and os.environ["OMP_NUM_THREADS"] == "3"


def test_vllms_warning_about_the_callers_random_state_is_dropped_only_within(caplog):
    arg_log = logging.getLogger("vllm.engine.arg_utils")
    message = "Since VLLM_ENABLE_V1_MULTIPROCESSING is set to False, this may affect the random state"
    with caplog.at_level(logging.WARNING, logger="vllm.engine.arg_utils"):
        with cpu_worker_layout(True):
            arg_log.warning(message)
            arg_log.warning("another warning")
        arg_log.warning(message)
    assert [r.getMessage() for r in caplog.records] == ["another warning", message]
