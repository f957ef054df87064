"""`das bench serve`: the quick start's own run as the benchmark.

What a new user does, measured: start `das serve` (as the README says, plus `--speculation` for the arm), run
`das rollout`'s epochs against it, stop it; once per arm and repeat, arms alternating (das, none, none, das, ...)
so that a drift of the machine's load falls on both. Each repeat starts a fresh server, so epoch 1 always meets
an empty history. Reports, per arm and epoch, the median over repeats of the makespan, tokens/s and seconds per
token of the longest sample (at T > 0 a makespan follows the longest sample drawn), and each arm's ratios to the
first arm measured in the same run. Every arm of repeat r runs `das rollout --seed derive(seed, r)`: under keyed
sampling the arms draw the same samples (speculation changes none), so their makespans differ by speed alone,
while the repeats draw different ones.

An arm written `ARM@2` runs ARM's server a second time in each repeat (e.g. `none,das,none@2`): identical samples
on identical servers, so its paired ratio to ARM is the machine's own run-to-run noise, the floor a difference
between arms must clear. Paired ratios (`paired`) divide each repeat's figure by the baseline's of the same repeat:
the same samples, so only speed differs; their median, min and max are reported beside the ratio of medians.

`oracle` / `oracle-k` arms (after `none`, which every repeat then runs first): `das serve --speculation das
--oracle-file F` (with `--budget uniform` for oracle-k), F holding every sample's output from that repeat's `none`
run by sample key, so each sample drafts its own exact future (`OracleDrafts`). Their outputs must equal
none's (`oracle_identical`); `bound_s` per epoch (`oracle_bound`): the critical path at K + 1 tokens a step
for none's lengths on one engine, priced by the oracle server's live step-cost fit (its /metrics).
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
from das.bench.oracle_bound import StepPrice, engine_bound
from das.bench.server_profile import engine_steps
from das.drafter.oracle import write_continuations
from das.service.client.rollout_run import EpochFigures, run_rollouts
from das.service.wire.api import SamplingSpec
from das.service.wire.sample_keys import derive

# `das serve` flags of the oracle arms; oracle-k's --budget is the budget name `e2e.ARM_BUDGETS` gives it
ORACLE_ARMS = {"oracle": ("--speculation", "das"), "oracle-k": ("--speculation", "das", "--budget", "uniform")}
BASELINE = "none"
AGAIN = "@"  # `none@2`: none's server again, the noise floor


def served_arm(arm: str) -> str:
    """The `das serve --speculation` value of an arm: `none@2` serves as `none`."""
    return arm.split(AGAIN, 1)[0]


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
    k: int = 8  # the servers' --k (num_speculative_tokens), for the bound
    profile: bool = False  # every server with --profile-steps: each arm's host and forward-pass time a step

    def __post_init__(self) -> None:
        if len(set(self.arms)) != len(self.arms):
            raise ValueError(f"an arm is named twice in {','.join(self.arms)}: run one again as ARM{AGAIN}2")
        for arm in self.arms:
            if AGAIN in arm:
                base, again = arm.split(AGAIN, 1)
                if base not in self.arms or not again.isdigit() or int(again) < 2 or base in ORACLE_ARMS:
                    raise ValueError(f"arm {arm!r}: a second run is written ARM{AGAIN}N (N >= 2) of a plain arm "
                                     f"also in the arms (e.g. none,das,none{AGAIN}2)")
        oracles = [a for a in self.arms if a in ORACLE_ARMS]
        if oracles and BASELINE not in self.arms:
            raise ValueError(f"the {', '.join(oracles)} arm(s) draft what {BASELINE} generated: add {BASELINE} to "
                             f"the arms")

    def order(self, repeat: int) -> tuple[str, ...]:
        """Repeat `repeat`'s arm order: the others alternating (das, none, then none, das, ...) so that a drift of
        the machine's load falls on both; with oracle arms, none first and the oracle arms last."""
        plain = [a for a in self.arms if a not in ORACLE_ARMS]
        oracles = [a for a in self.arms if a in ORACLE_ARMS]
        if oracles:
            plain.remove(BASELINE)
            return (BASELINE, *(plain if repeat % 2 == 0 else reversed(plain)), *oracles)
        return tuple(plain if repeat % 2 == 0 else reversed(plain))


@dataclass
class UserRunResult:
    config: UserRunConfig
    problems: str
    runs: dict[str, list[list[EpochFigures]]] = field(default_factory=dict)  # arm -> repeat -> epochs
    # with oracle arms: per repeat and epoch the bound (bound_s, steps, price); whether each oracle arm's outputs
    # equalled none's in every repeat and epoch
    bounds: list[list[dict[str, Any]]] = field(default_factory=list)
    oracle_identical: dict[str, bool] = field(default_factory=dict)
    # with config.profile: arm -> one EngineSteps.summary() of its engine per repeat (all epochs together)
    profiles: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def step_profiles(self) -> list[dict[str, Any]]:
        """Per profiled arm, the medians over repeats of its ms a step: host (all but the forward pass), forward
        pass, and each part (`server_profile`), with its runner."""
        rows = []
        for arm, runs in self.profiles.items():
            measured = [r for r in runs if r.get("host_ms_per_step") is not None]
            if not measured:
                continue
            parts = {part: _median_of([r["parts_ms_per_step"].get(part) for r in measured])
                     for part in measured[0]["parts_ms_per_step"]}
            rows.append({"arm": arm, "runner": measured[0]["runner"],
                         "async_scheduling": measured[0]["async_scheduling"], "repeats": len(measured),
                         "profiled_steps": _median_of([r["profiled_steps"] for r in measured]),
                         "host_ms_per_step": _median_of([r["host_ms_per_step"] for r in measured]),
                         "model_ms_per_step": _median_of([r["model_ms_per_step"] for r in measured]),
                         "parts_ms_per_step": parts})
        return rows

    def oracle_table(self) -> list[dict[str, Any]]:
        """Per epoch (medians over repeats, seconds): none, das, oracle, oracle-k and bound_s (the arms run), das's
        saving as a share of the oracle's and oracle / bound (`e2e.oracle_ratios`)."""
        from das.bench.e2e import oracle_ratios

        rows = []
        medians = {arm: self.medians(arm) for arm in self.runs if self.runs[arm]}
        for e in range(self.config.epochs):
            row: dict[str, Any] = {"epoch": e + 1}
            for arm in (BASELINE, "das", *ORACLE_ARMS):
                if arm in medians:
                    row[arm] = round(medians[arm][e]["makespan_s"], 3)
            bounds = [b[e]["bound_s"] for b in self.bounds if e < len(b) and b[e]["bound_s"] is not None]
            row["bound_s"] = round(statistics.median(bounds), 3) if bounds else None
            row.update(oracle_ratios(row.get(BASELINE), row.get("das"), row.get("oracle"), row["bound_s"]))
            rows.append(row)
        return rows

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

    def paired(self, arm: str) -> list[dict[str, Any]]:
        """Per epoch, `arm`'s makespan and tokens/s over the baseline's of the same repeat (the same samples): each
        repeat's ratio, their median, min and max. Repeats where either arm lacks the epoch are left out."""
        base = self.config.arms[0]
        out = []
        for e in range(self.config.epochs):
            pairs = [(mine[e], theirs[e]) for mine, theirs in zip(self.runs[arm], self.runs[base])
                     if len(mine) > e and len(theirs) > e]
            row: dict[str, Any] = {"epoch": e + 1}
            for key, ratio in (("makespan", lambda m, b: m.makespan_s / b.makespan_s),
                               ("tokens_per_s", lambda m, b: m.tokens_per_s / b.tokens_per_s)):
                values = [round(ratio(m, b), 4) for m, b in pairs if b.makespan_s > 0 and m.makespan_s > 0]
                row[key] = {"each": values, "median": round(statistics.median(values), 4) if values else None,
                            "min": min(values, default=None), "max": max(values, default=None)}
            out.append(row)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"config": asdict(self.config), "problems": self.problems,
                "runs": {arm: [[asdict(e) | {"tokens_per_s": e.tokens_per_s,
                                             "seconds_per_longest_token": e.seconds_per_longest_token,
                                             "seconds_per_critical_step": e.seconds_per_critical_step}
                                for e in run] for run in runs] for arm, runs in self.runs.items()},
                "medians": {arm: self.medians(arm) for arm in self.runs},
                "ratios": {arm: self.ratios(arm) for arm in self.runs},
                "paired": {arm: self.paired(arm) for arm in self.runs if arm != self.config.arms[0]},
                **({"oracle": self.oracle_table(), "oracle_identical": self.oracle_identical,
                    "bounds": [{"repeat": r + 1, "epochs": b} for r, b in enumerate(self.bounds)]}
                   if self.bounds else {}),
                **({"arms": self.step_profiles(), "profiles": self.profiles} if self.profiles else {})}

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
        lines += ["", f"Paired by repeat (the same samples), each arm over {base}: median (min-max) of the "
                      f"{self.config.repeats} repeats", "",
                  "| arm | epoch | makespan ratio | tokens/s ratio |", "|---|---:|---|---|"]
        for arm in self.runs:
            if arm != base:
                lines += [f"| {arm} | {row['epoch']} | {_spread(row['makespan'])} | {_spread(row['tokens_per_s'])} |"
                          for row in self.paired(arm)]
        if self.bounds:
            lines += ["", f"Oracle (outputs identical to none's: {self.oracle_identical}); bound: critical path at "
                          f"K + 1 tokens a step on one engine, priced by the oracle server's step-cost fit", "",
                      "| epoch | none s | das s | oracle s | oracle-k s | bound s | das saving / oracle saving "
                      "| oracle / bound |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
            lines += ["| " + " | ".join(_cell(row.get(c)) for c in (
                "epoch", BASELINE, "das", "oracle", "oracle-k", "bound_s", "das_share_of_oracle_saving",
                "oracle_over_bound")) + " |" for row in self.oracle_table()]
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
        paired = Table(title=f"paired by repeat (the same samples), each arm over {base}: median (min-max)")
        for column in ("arm", "epoch", "makespan ratio", "tokens/s ratio"):
            paired.add_column(column, justify="right")
        for arm in self.runs:
            if arm != base:
                for row in self.paired(arm):
                    paired.add_row(arm, str(row["epoch"]), _spread(row["makespan"]), _spread(row["tokens_per_s"]))
        console.print(paired)
        if self.bounds:
            oracle = Table(title="the limit: oracle drafts (the exact future) and the bound (critical path at K + 1 "
                                 "tokens a step, priced by the oracle server's step-cost fit)")
            columns = ("epoch", BASELINE, "das", "oracle", "oracle-k", "bound_s", "das_share_of_oracle_saving",
                       "oracle_over_bound")
            for column in columns:
                oracle.add_column(column, justify="right")
            for row in self.oracle_table():
                oracle.add_row(*(_cell(row.get(c)) for c in columns))
            console.print(oracle)
            console.print(f"oracle outputs identical to {BASELINE}'s: {self.oracle_identical}")
        if self.profiles:
            steps = Table(title="where a step's time goes (ms a step, medians over repeats; host = all but the "
                                "forward pass)")
            parts = ("prepare", "sample", "propose", "budget", "rest", "gap")
            for column in ("arm", "runner", "steps", "forward pass", "host", *parts):
                steps.add_column(column, justify="right")
            for row in self.step_profiles():
                ms = row["parts_ms_per_step"]
                prepare = (ms["forward_ms"] - ms["model_ms"]) if ms.get("forward_ms") is not None else None
                steps.add_row(row["arm"], str(row["runner"]), _cell(row["profiled_steps"]),
                              _cell(row["model_ms_per_step"]), _cell(row["host_ms_per_step"]), _cell(prepare),
                              *(_cell(ms.get(f"{p}_ms")) for p in parts[1:]))
            console.print(steps)


def _median_of(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(float(statistics.median(present)), 3) if present else None


def _spread(ratios: dict[str, Any]) -> str:
    if ratios["median"] is None:
        return "-"
    return f"{ratios['median']:.3f} ({ratios['min']:.3f}-{ratios['max']:.3f})"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def step_price_from_metrics(text: str) -> tuple[StepPrice | None, int]:
    """The step-cost fit of a server's engines from its /metrics text (das_engine_step_*_seconds gauges, one per
    engine), and the number of engines reporting one. The price is the first engine's; None where none reports."""
    from prometheus_client.parser import text_string_to_metric_families

    names = {"das_engine_step_base_seconds": "c_base_s", "das_engine_step_token_seconds": "c_tok_s",
             "das_engine_step_spec_seconds": "c_spec_s", "das_engine_step_spec_request_seconds": "c_spec_req_s"}
    fits: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name in names:
            for sample in family.samples:
                fits.setdefault(sample.labels.get("engine", ""), {})[names[family.name]] = sample.value
    complete = [fit for _, fit in sorted(fits.items()) if "c_base_s" in fit and "c_tok_s" in fit]
    return (StepPrice.from_fit(complete[0], "server cost fit") if complete else None), len(complete)


def _das_program() -> list[str]:
    """The installed `das` next to this interpreter, as a user runs it."""
    exe = Path(sys.executable).parent / "das"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "das.service.cli"]


class ServeProcess:
    """`das serve` in a process group of its own; `stop()` sends SIGINT (what a user's Ctrl-C does) and waits."""

    def __init__(self, flags: tuple[str, ...], config: UserRunConfig, log_path: Path) -> None:
        """`flags`: the arm's `das serve` flags (e.g. ("--speculation", "none"))."""
        self.url = f"http://127.0.0.1:{config.port}"
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            [*_das_program(), "serve", "--port", str(config.port), *flags, *config.serve_args],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

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


def epoch_bounds(recorded: list[dict[int, list[int]]], k: int, metrics: str) -> list[dict[str, Any]]:
    """Per epoch, the bound for none's outputs (`recorded`, by key) at K = `k` on one engine, priced by the step-cost
    fit in `metrics` (a server's /metrics text); bound_s None without a fit or with more than one engine (the
    batch's split between engines is not known here)."""
    price, engines = step_price_from_metrics(metrics)
    out = []
    for epoch in recorded:
        if price is None or engines != 1:
            out.append({"bound_s": None, "steps": None, "price": None, "engines": engines})
            continue
        bound = engine_bound([len(v) for v in epoch.values()], k, price)
        out.append({"bound_s": round(bound.seconds, 3), "steps": bound.steps, "price": asdict(price),
                    "engines": engines})
    return out


def run_user_bench(config: UserRunConfig, problems: list[Problem], problems_spec: str, log_dir: Path,
                   progress: Callable[[str], None]) -> UserRunResult:
    """Every repeat runs every arm once (order alternating); see the module docstring."""
    result = UserRunResult(config, problems_spec, {arm: [] for arm in config.arms})
    sampling = SamplingSpec(max_tokens=config.max_tokens, temperature=config.temperature)
    log_dir.mkdir(parents=True, exist_ok=True)
    quiet = Console(stderr=True, quiet=True)
    oracles = [a for a in config.arms if a in ORACLE_ARMS]
    for repeat in range(config.repeats):
        recorded: list[dict[int, list[int]]] = []  # none's outputs by sample key, per epoch
        oracle_file = log_dir / f"oracle-{repeat + 1}.json"
        for arm in config.order(repeat):
            flags: tuple[str, ...] = ("--speculation", served_arm(arm))
            if arm in ORACLE_ARMS:
                write_continuations(oracle_file, {k: v for epoch in recorded for k, v in epoch.items()})
                flags = (*ORACLE_ARMS[arm], "--oracle-file", str(oracle_file))
            if config.profile:
                flags = (*flags, "--profile-steps")
            progress(f"repeat {repeat + 1}/{config.repeats}, arm {arm}: starting das serve {' '.join(flags)}")
            server = ServeProcess(flags, config, log_dir / f"serve-{arm}-{repeat + 1}.log")
            outputs: list[dict[int, list[int]]] | None = [] if oracles and arm in (BASELINE, *oracles) else None
            metrics = ""
            try:
                server.wait_ready(config.ready_timeout_s, progress)
                with RolloutClient(server.url, None) as client:
                    run = run_rollouts(client, problems, config.samples, config.epochs, sampling, None, quiet,
                                       derive(config.seed, repeat), outputs)
                if arm in ORACLE_ARMS or config.profile:
                    metrics = httpx.get(f"{server.url}/metrics", timeout=10.0).text
            finally:
                server.stop()
            if config.profile:
                (log_dir / f"metrics-{arm}-{repeat + 1}.txt").write_text(metrics)  # the engines' own figures, kept
                engines = engine_steps(metrics)
                result.profiles.setdefault(arm, []).append(engines[0].summary() if engines else {})
            result.runs[arm].append(run.epochs)
            if arm == BASELINE and outputs is not None:
                recorded = outputs
            elif arm in ORACLE_ARMS and outputs is not None:
                same = outputs == recorded
                result.oracle_identical[arm] = result.oracle_identical.get(arm, True) and same
                if not same:
                    progress(f"WARNING: {arm}'s outputs differ from {BASELINE}'s in repeat {repeat + 1}")
                if arm == oracles[0]:
                    result.bounds.append(epoch_bounds(recorded, config.k, metrics))
            progress(f"repeat {repeat + 1}, arm {arm}: makespans "
                     + ", ".join(f"{e.makespan_s:.1f} s" for e in run.epochs))
    return result
