"""Reading a server's engines from its /metrics text (bench/server_profile.py)."""

from __future__ import annotations

import pytest

from das.bench.server_profile import engine_steps

METRICS = """# HELP das_engine_runner_info What vLLM runs.
# TYPE das_engine_runner_info gauge
das_engine_runner_info{engine="node0/0",platform="cuda",model_runner="V1",async_scheduling="false",keyed="true"} 1.0
# HELP das_engine_step_part_seconds Seconds by part.
# TYPE das_engine_step_part_seconds counter
das_engine_step_part_seconds_total{engine="node0/0",part="forward_s"} 0.8
das_engine_step_part_seconds_total{engine="node0/0",part="model_s"} 0.7
das_engine_step_part_seconds_total{engine="node0/0",part="sample_s"} 0.1
das_engine_step_part_seconds_total{engine="node0/0",part="propose_s"} 0.05
das_engine_step_part_seconds_total{engine="node0/0",part="budget_s"} 0.01
das_engine_step_part_seconds_total{engine="node0/0",part="rest_s"} 0.02
das_engine_step_part_seconds_total{engine="node0/0",part="gap_s"} 0.03
# HELP das_engine_profiled_steps With --profile-steps.
# TYPE das_engine_profiled_steps counter
das_engine_profiled_steps_total{engine="node0/0"} 100.0
das_engine_runner_info{engine="node1/0",platform="cuda",model_runner="V2",async_scheduling="true",keyed="false"} 1.0
"""


def test_runner_and_step_parts_per_engine() -> None:
    first, second = engine_steps(METRICS)
    assert first.engine == "node0/0" and first.steps == 100
    # a step: 0.8 + 0.1 + 0.05 + 0.02 + 0.03 = 1.0 s over 100 steps = 10 ms, of which 7 ms the forward pass
    assert first.host_ms_per_step == pytest.approx(3.0)
    summary = first.summary()
    assert (summary["runner"], summary["async_scheduling"], summary["keyed"]) == ("V1", False, True)
    assert summary["model_ms_per_step"] == 7.0 and summary["parts_ms_per_step"]["budget_ms"] == 0.1
    # not profiled (V2 with async scheduling): the runner is known, the host time is not
    assert second.steps == 0 and second.host_ms_per_step is None
    assert second.summary()["runner"] == "V2" and second.summary()["async_scheduling"] is True


def test_a_server_without_the_figures_reports_no_engine() -> None:
    assert engine_steps("# nothing here\n") == []
