"""What a running `das serve` says about its engines' steps, read from its /metrics text: the runner each engine
runs (das_engine_runner_info) and, with `das serve --profile-steps`, where its steps' time went
(das_engine_step_part_seconds_total, das_engine_profiled_steps_total; parts as the engine's step profile names them).

`host_ms_per_step` is a step's time less its forward pass: what an engine without async scheduling adds to the
device's work every step, and the price `das bench simulate --host-ms` charges for it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from das.service.engine.contract import STEP_PARTS, StepPartTotals


@dataclass(frozen=True)
class EngineSteps:
    """One engine: its runner's labels (empty when the server did not report them) and its profiled steps'
    summed seconds by part (empty without --profile-steps)."""

    engine: str
    runner: dict[str, str] = field(default_factory=dict)
    steps: int = 0
    seconds: dict[str, float] = field(default_factory=dict)

    def ms_per_step(self, part: str) -> float | None:
        return self.seconds.get(part, 0.0) / self.steps * 1e3 if self.steps else None

    @property
    def host_ms_per_step(self) -> float | None:
        """Mean step time less its forward pass, ms (None: no profiled step): the engine's own sums' figure."""
        return StepPartTotals(self.steps, tuple(self.seconds.items())).host_ms_per_step()

    def summary(self) -> dict[str, Any]:
        """The figures a report carries: runner, steps, ms a step by part, host and forward-pass ms a step."""
        parts = {p.removesuffix("_s") + "_ms": _round(self.ms_per_step(p))
                 for p in (*STEP_PARTS, "model_s", "budget_s")} if self.steps else {}
        return {"engine": self.engine, "runner": self.runner.get("model_runner"),
                "async_scheduling": _flag(self.runner.get("async_scheduling")),
                "keyed": _flag(self.runner.get("keyed")), "platform": self.runner.get("platform"),
                "profiled_steps": self.steps, "host_ms_per_step": _round(self.host_ms_per_step),
                "model_ms_per_step": _round(self.ms_per_step("model_s")), "parts_ms_per_step": parts}


def engine_steps(metrics: str) -> list[EngineSteps]:
    """Every engine the /metrics text reports, in name order."""
    runners: dict[str, dict[str, str]] = {}
    steps: dict[str, int] = {}
    seconds: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            engine = sample.labels.get("engine")
            if engine is None:
                continue
            if family.name == "das_engine_runner_info":
                runners[engine] = {k: v for k, v in sample.labels.items() if k != "engine"}
            elif sample.name == "das_engine_profiled_steps_total":
                steps[engine] = int(sample.value)
            elif sample.name == "das_engine_step_part_seconds_total":
                seconds.setdefault(engine, {})[sample.labels["part"]] = sample.value
    names = sorted(set(runners) | set(steps))
    return [EngineSteps(e, runners.get(e, {}), steps.get(e, 0), seconds.get(e, {})) for e in names]


def _flag(value: str | None) -> bool | None:
    return None if value is None else value == "true"


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def host_ms_from(value: str, arm: str = "das") -> float:
    """Host ms a step from `value`: a number, or a JSON report whose `arms` list (`das bench gpu-check --json`,
    `das bench serve --profile --json`) carries `host_ms_per_step` for `arm`. ValueError names what is missing."""
    try:
        return _non_negative(float(value), value)
    except ValueError:
        pass
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"--host-ms: {value!r} is neither a number of milliseconds nor a report file")
    report = json.loads(path.read_text())
    for row in report.get("arms", []) if isinstance(report, dict) else []:
        if isinstance(row, dict) and row.get("arm") == arm and row.get("host_ms_per_step") is not None:
            return _non_negative(float(row["host_ms_per_step"]), value)
    raise ValueError(f"--host-ms: {path} has no measured host_ms_per_step for the {arm} arm (run the report with "
                     f"step profiling: das bench gpu-check, or das bench serve --profile)")


def _non_negative(ms: float, given: str) -> float:
    if not (ms >= 0 and ms != float("inf")):
        raise ValueError(f"--host-ms: {given!r} must be a finite number of milliseconds >= 0")
    return ms
