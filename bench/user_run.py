"""`das bench serve`: the quick start's own run as the benchmark.

What a new user does, measured: start `das serve` (as the README says, plus `--speculation` for the arm), run
`das rollout`'s epochs against it, stop it; once per arm and repeat, arms alternating (das, none, none, das, ...)
so that a drift of the machine's load falls on both. Each repeat starts a fresh server, so epoch 1 always meets
an empty history. Reports, per arm and epoch, the median over repeats of the makespan, tokens/s and seconds per
token of the longest sample (at T > 0 a makespan follows the longest sample drawn), and each arm's ratios to the
first arm measured in the same run. Every arm of repeat r runs `das rollout --seed derive(seed, r)`: under keyed
sampling the arms draw the same samples (speculation changes none), so their makespans differ by speed alone,
while the repeats draw different ones.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from das.service.client import RolloutClient
from das.service.client.prompt_sets import Problem
from das.service.client.rollout_run import EpochFigures, run_rollouts
from das.service.wire.api import SamplingSpec
from das.service.wire.sample_keys import derive


@dataclass(frozen=True)
class UserRunConfig:
    """One benchmark. `arms`: `das serve --speculation` values, the first is the baseline of the ratios;
    `serve_args`: more `das serve` flags for every arm (e.g. `--eager`)."""

    arms: tuple[str, ...] = ("none", "das")
    repeats: int = 3
    seed: int = 0
    samples: int = 8
    epochs: int = 3
    max_tokens: int = 512
    temperature: float = 0.8
    port: int = 8123
    serve_args: tuple[str, ...] = ()
    ready_timeout_s: float = 900.0


@dataclass
class UserRunResult:
    config: UserRunConfig
    problems: str
    runs: dict[str, list[list[EpochFigures]]] = field(default_factory=dict)  # arm -> repeat -> epochs

    def medians(self, arm: str) -> list[dict[str, float]]:
        """Per epoch, the median over repeats of makespan, tokens/s, seconds per longest-sample token and seconds per
        critical-path step (rollout_run.EpochFigures)."""
        out = []
        for e in range(self.config.epochs):
            figures = [run[e] for run in self.runs[arm] if len(run) > e]
            out.append({"makespan_s": statistics.median(f.makespan_s for f in figures),
                        "tokens_per_s": statistics.median(f.tokens_per_s for f in figures),
                        "s_per_longest_token": statistics.median(f.seconds_per_longest_token for f in figures),
                        "s_per_critical_step": statistics.median(f.seconds_per_critical_step for f in figures),
                        "draft_tokens": statistics.median(f.draft_tokens for f in figures),
                        "accepted_tokens": statistics.median(f.accepted_tokens for f in figures)})
        return out

    def ratios(self, arm: str) -> list[dict[str, float]]:
        """Per epoch, `arm`'s medians over the baseline's (the first arm)."""
        base = self.medians(self.config.arms[0])
        mine = self.medians(arm)
        keys = ("makespan_s", "tokens_per_s", "s_per_longest_token", "s_per_critical_step")
        return [{key: m[key] / b[key] for key in keys if b[key]} for m, b in zip(mine, base)]

    def to_dict(self) -> dict[str, Any]:
        return {"config": asdict(self.config), "problems": self.problems,
                "runs": {arm: [[asdict(e) | {"tokens_per_s": e.tokens_per_s,
                                             "seconds_per_longest_token": e.seconds_per_longest_token,
                                             "seconds_per_critical_step": e.seconds_per_critical_step}
                                for e in run] for run in runs] for arm, runs in self.runs.items()},
                "medians": {arm: self.medians(arm) for arm in self.runs},
                "ratios": {arm: self.ratios(arm) for arm in self.runs}}

    def markdown(self) -> str:
        base = self.config.arms[0]
        lines = [f"{self.problems} x {self.config.samples} samples, {self.config.max_tokens} tokens, "
                 f"T={self.config.temperature}; medians of {self.config.repeats} repeats; ratios to {base}", "",
                 "| arm | epoch | makespan s | tokens/s | ms / longest token | ms / critical step | makespan ratio "
                 "| tokens/s ratio | per-longest-token ratio | per-critical-step ratio |",
                 "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for arm in self.runs:
            for e, (m, r) in enumerate(zip(self.medians(arm), self.ratios(arm)), start=1):
                lines.append(f"| {arm} | {e} | {m['makespan_s']:.1f} | {m['tokens_per_s']:.0f} | "
                             f"{m['s_per_longest_token'] * 1e3:.1f} | {m['s_per_critical_step'] * 1e3:.1f} | "
                             f"{r.get('makespan_s', 0):.3f} | {r.get('tokens_per_s', 0):.3f} | "
                             f"{r.get('s_per_longest_token', 0):.3f} | {r.get('s_per_critical_step', 0):.3f} |")
        return "\n".join(lines) + "\n"

    def print(self, console: Console) -> None:
        base = self.config.arms[0]
        table = Table(title=f"das serve, the user's run: {self.problems} x {self.config.samples} samples, "
                            f"{self.config.max_tokens} tokens, T={self.config.temperature}; medians of "
                            f"{self.config.repeats} repeats; ratios to {base}")
        for column in ("arm", "epoch", "makespan s", "tokens/s", "ms / longest token", "ms / critical step",
                       "drafted", "accepted", "makespan ratio", "tokens/s ratio", "per-longest-token ratio",
                       "per-critical-step ratio"):
            table.add_column(column, justify="right")
        for arm in self.runs:
            for e, (m, r) in enumerate(zip(self.medians(arm), self.ratios(arm)), start=1):
                table.add_row(arm, str(e), f"{m['makespan_s']:.1f}", f"{m['tokens_per_s']:.0f}",
                              f"{m['s_per_longest_token'] * 1e3:.1f}", f"{m['s_per_critical_step'] * 1e3:.1f}",
                              f"{m['draft_tokens']:.0f}", f"{m['accepted_tokens']:.0f}",
                              f"{r.get('makespan_s', 0):.3f}", f"{r.get('tokens_per_s', 0):.3f}",
                              f"{r.get('s_per_longest_token', 0):.3f}", f"{r.get('s_per_critical_step', 0):.3f}")
        console.print(table)


def _das_program() -> list[str]:
    """The installed `das` next to this interpreter, as a user runs it."""
    exe = Path(sys.executable).parent / "das"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "das.bench.cli"]


class ServeProcess:
    """`das serve` in a process group of its own; `stop()` sends SIGINT (what a user's Ctrl-C does) and waits."""

    def __init__(self, speculation: str, config: UserRunConfig, log_path: Path) -> None:
        self.url = f"http://127.0.0.1:{config.port}"
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            [*_das_program(), "serve", "--port", str(config.port), "--speculation", speculation,
             *config.serve_args], stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float, progress: Callable[[str], None]) -> None:
        deadline = time.monotonic() + timeout_s
        announced = time.monotonic()
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"das serve exited with {self.proc.returncode} before it was ready "
                                   f"(log: {self._log.name})")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() - announced > 30:
                progress(f"waiting for {self.url}/readyz ({time.monotonic() - deadline + timeout_s:.0f} s)")
                announced = time.monotonic()
            time.sleep(1.0)
        raise TimeoutError(f"das serve not ready after {timeout_s:.0f} s (log: {self._log.name})")

    def stop(self, timeout_s: float = 120.0) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def run_user_bench(config: UserRunConfig, problems: list[Problem], problems_spec: str, log_dir: Path,
                   progress: Callable[[str], None]) -> UserRunResult:
    """Every repeat runs every arm once (order alternating); see the module docstring."""
    result = UserRunResult(config, problems_spec, {arm: [] for arm in config.arms})
    sampling = SamplingSpec(max_tokens=config.max_tokens, temperature=config.temperature)
    log_dir.mkdir(parents=True, exist_ok=True)
    quiet = Console(stderr=True, quiet=True)
    for repeat in range(config.repeats):
        order = config.arms if repeat % 2 == 0 else tuple(reversed(config.arms))
        for arm in order:
            progress(f"repeat {repeat + 1}/{config.repeats}, arm {arm}: starting das serve --speculation {arm}")
            server = ServeProcess(arm, config, log_dir / f"serve-{arm}-{repeat + 1}.log")
            try:
                server.wait_ready(config.ready_timeout_s, progress)
                with RolloutClient(server.url, None) as client:
                    run = run_rollouts(client, problems, config.samples, config.epochs, sampling, None, quiet,
                                       derive(config.seed, repeat))
            finally:
                server.stop()
            result.runs[arm].append(run.epochs)
            progress(f"repeat {repeat + 1}, arm {arm}: makespans "
                     + ", ".join(f"{e.makespan_s:.1f} s" for e in run.epochs))
    return result
