"""`das bench gpu-check`: the acceptance run for one machine with one GPU (or, as a dry run, the CPU).

One command, as a user would run the service: `das serve --profile-steps` per arm (`--arms`, default none and das,
plus vLLM's `suffix` where arctic-inference is importable; fp32 by default, so that the arms' logits agree bit for
bit and keyed sampling draws the same tokens), the same seeded batch at T > 0 against each, then on the das server
the RL control plane and an engine kill. Every compared arm runs `--model-runner keyed` (on a GPU: model runner V1
without async scheduling, the runner our keyed draw and our proposer need), so their samples must be identical.
Beside them, `plain`: `das serve --speculation none --model-runner auto`, vLLM as users run it (on a GPU: model
runner V2 with async scheduling), compared with das on speed alone (its samples are not keyed). Checks:

- one runner: every compared arm runs the same model runner with async scheduling alike, and samples keyed;
- identical samples: every sample of every compared arm has the tokens the `none` arm drew (keyed sampling, T > 0);
- host time measured: every compared arm's steps were timed by part (the forward pass against the host's work);
- short e2e: each arm's batch completes without an error sample (makespan, tokens/s, drafts accepted reported;
  one batch, so no speed verdict);
- RL control plane: POST /pause?mode=keep, a batch sent while paused is held (nothing arrives), POST
  /update_weights with the served model's own directory, POST /resume, and the held batch then completes under
  the new policy version with no error sample;
- engine kill: SIGKILL to a vLLM engine-core process of the server; the next batch completes without an error
  sample (the service restarts the engine and re-dispatches).

Each arm's report names its runner, async scheduling and host time a step (`server_profile`, from the
server's /metrics). Prints rich tables and writes the report as JSON. The figures of a run on a shared CPU are not
speeds.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from das.service.client import RolloutClient
from das.service.client.prompt_sets import Problem
from das.service.wire.api import SampleRecord, SamplingSpec

COMPARED = ("none", "das", "suffix", "ngram")  # `das serve --speculation` values, all keyed
PLAIN = "plain"  # vLLM as users run it: no speculation, vLLM's choice of runner
BASELINE = "none"
ENGINE_CORE = "EngineCore"  # vLLM's engine-core process title (VLLM::EngineCore...)


def suffix_unavailable() -> str | None:
    """Why vLLM's suffix arm cannot run here (arctic-inference does not import; the preflight
    check `das serve` makes), or None."""
    from das.service.engine.preflight import MissingPackage, check_method_packages

    try:
        check_method_packages("suffix")
    except MissingPackage as exc:
        return str(exc)
    return None


def default_arms() -> tuple[tuple[str, ...], list[str]]:
    """none and das, plus suffix where arctic-inference imports; and why an arm was left out."""
    missing = suffix_unavailable()
    return (("none", "das") if missing else ("none", "das", "suffix")), ([f"suffix: {missing}"] if missing else [])


def arm_flags(arm: str) -> tuple[str, ...]:
    """The arm's `das serve` flags: every arm's steps timed; compared arms keyed (the default runner choice)."""
    if arm == PLAIN:
        return ("--speculation", "none", "--model-runner", "auto", "--profile-steps")
    return ("--speculation", arm, "--profile-steps")


@dataclass(frozen=True)
class GpuCheckConfig:
    """One acceptance run. `arms`: the compared (keyed) arms, `none` and `das` among them; `plain`: also run vLLM
    as users run it, for speed; `serve_args`: more `das serve` flags for every server (e.g. `--eager`)."""

    arms: tuple[str, ...] = ("none", "das")
    plain: bool = True
    model: str = "smollm2"
    problems: str = "code:4"
    samples: int = 2
    max_tokens: int = 128
    temperature: float = 0.8
    dtype: str = "float32"
    seed: int = 1
    port: int = 8124
    serve_args: tuple[str, ...] = ()
    ready_timeout_s: float = 900.0
    batch_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (the check is of random sampling), got {self.temperature}")
        if self.samples < 1 or self.max_tokens < 1:
            raise ValueError("samples and max_tokens must be >= 1")
        unknown = [a for a in self.arms if a not in COMPARED]
        if unknown or len(set(self.arms)) != len(self.arms):
            raise ValueError(f"arms: each of {', '.join(COMPARED)} at most once, got {', '.join(self.arms)}")
        if BASELINE not in self.arms or "das" not in self.arms:
            raise ValueError(f"arms must include {BASELINE} (the samples every arm must match) and das (the control "
                             f"plane and the kill run on it), got {', '.join(self.arms)}")
        if "suffix" in self.arms and (missing := suffix_unavailable()):
            raise ValueError(f"arms: {missing}")

    @property
    def order(self) -> tuple[str, ...]:
        """The servers in the order they run: the baseline first, das last (the kill ends its run)."""
        middle = [a for a in self.arms if a not in (BASELINE, "das")] + ([PLAIN] if self.plain else [])
        return (BASELINE, *middle, "das")


@dataclass(frozen=True)
class ArmBatch:
    """One arm's batch: seconds, tokens, drafts; `tokens_of` maps "problem/sample" to its output tokens."""

    arm: str
    makespan_s: float
    tokens: int
    draft_tokens: int
    accepted_tokens: int
    errors: int
    tokens_of: dict[str, list[int]] = field(repr=False)
    engine: dict[str, Any] = field(default_factory=dict)  # EngineSteps.summary() of the arm's engine

    @classmethod
    def of(cls, arm: str, samples: Iterable[SampleRecord], seconds: float,
           engine: dict[str, Any] | None = None) -> ArmBatch:
        got = list(samples)
        return cls(arm, round(seconds, 3), sum(len(s.output_token_ids) for s in got),
                   sum(s.draft_tokens for s in got), sum(s.accepted_tokens for s in got),
                   sum(s.finish_reason == "error" for s in got),
                   {f"{s.problem_id}/{s.sample_index}": list(s.output_token_ids) for s in got}, engine or {})

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.makespan_s if self.makespan_s > 0 else 0.0


@dataclass(frozen=True)
class Check:
    """One acceptance check: passed, and what was seen."""

    name: str
    passed: bool
    detail: str


def compared(batches: list[ArmBatch]) -> list[ArmBatch]:
    """The keyed arms' batches (the plain vLLM arm is compared on speed only)."""
    return [b for b in batches if b.arm != PLAIN]


def identity_check(batches: list[ArmBatch], expected_samples: int) -> Check:
    """Every compared arm drew exactly the baseline arm's tokens for every sample."""
    batches = compared(batches)
    base = next((b for b in batches if b.arm == BASELINE), None)
    if base is None:
        return Check("identical samples", False, f"no {BASELINE} batch to compare with")
    problems = []
    for batch in batches:
        if len(batch.tokens_of) != expected_samples:
            problems.append(f"{batch.arm}: {len(batch.tokens_of)} of {expected_samples} samples")
            continue
        differ = sorted(k for k, tokens in batch.tokens_of.items() if base.tokens_of.get(k) != tokens)
        if differ:
            problems.append(f"{batch.arm}: {len(differ)} samples differ from {BASELINE} (first {differ[0]})")
    others = ", ".join(b.arm for b in batches if b.arm != BASELINE) or "no other arm"
    if not problems and len(batches) < 2:
        return Check("identical samples", False, "only one arm ran")
    return Check("identical samples", not problems,
                 "; ".join(problems) or f"{others}: every one of {expected_samples} samples as {BASELINE}'s")


def runner_check(batches: list[ArmBatch]) -> Check:
    """Every compared arm on one runner (model runner and async scheduling alike) with keyed sampling, as each
    server reported it."""
    runs = {b.arm: (b.engine.get("runner"), b.engine.get("async_scheduling"), b.engine.get("keyed"))
            for b in compared(batches)}
    problems = [f"{arm}: no runner reported" for arm, run in runs.items() if run[0] is None]
    problems += [f"{arm}: samples not keyed" for arm, run in runs.items() if run[0] is not None and not run[2]]
    if len({run[:2] for run in runs.values()}) > 1:
        problems.append("runners differ: " + ", ".join(f"{arm} {run[0]} (async scheduling {run[1]})"
                                                       for arm, run in runs.items()))
    first = next(iter(runs.values()), (None, None, None))
    return Check("one runner for the compared arms", bool(runs) and not problems,
                 "; ".join(problems) or f"{', '.join(runs)}: model runner {first[0]}, async scheduling "
                                        f"{'on' if first[1] else 'off'}, keyed sampling")


def host_time_check(batches: list[ArmBatch]) -> Check:
    """Every compared arm's steps were timed by part, so its host time a step is measured."""
    missing = [b.arm for b in compared(batches) if b.engine.get("host_ms_per_step") is None]
    measured = ", ".join(f"{b.arm} {b.engine['host_ms_per_step']:.2f} ms" for b in compared(batches)
                         if b.engine.get("host_ms_per_step") is not None)
    return Check("host time a step measured", bool(compared(batches)) and not missing,
                 f"not measured for {', '.join(missing)}" if missing else f"host ms a step: {measured}")


def plain_comparison(batches: list[ArmBatch]) -> dict[str, Any] | None:
    """das against vLLM as users run it (speed only; one batch, so no verdict): makespan and tokens/s ratios."""
    das = next((b for b in batches if b.arm == "das"), None)
    plain = next((b for b in batches if b.arm == PLAIN), None)
    if das is None or plain is None or not plain.makespan_s or not plain.tokens_per_s:
        return None
    return {"das_over_plain_makespan": round(das.makespan_s / plain.makespan_s, 3),
            "das_over_plain_tokens_per_s": round(das.tokens_per_s / plain.tokens_per_s, 3),
            "plain_runner": plain.engine.get("runner"), "plain_async_scheduling": plain.engine.get("async_scheduling"),
            "identical_samples_expected": False}


def e2e_check(batches: list[ArmBatch], expected_samples: int, arms: tuple[str, ...]) -> Check:
    """Every arm ran its batch to the end without an error sample."""
    missing = [a for a in arms if a not in {b.arm for b in batches}]
    bad = [f"{b.arm}: {b.errors} error samples" for b in batches if b.errors] + [
        f"{b.arm}: {len(b.tokens_of)} of {expected_samples} samples" for b in batches
        if len(b.tokens_of) != expected_samples]
    problems = [f"{a}: did not run" for a in missing] + bad
    drafted = ", ".join(f"{b.arm} {b.accepted_tokens}/{b.draft_tokens} drafts accepted" for b in batches
                        if b.arm != BASELINE)
    return Check("short e2e " + " / ".join(arms), not problems, "; ".join(problems) or drafted)


def control_plane_check(held_before_resume: int, paused: bool, version: int | None, after: list[SampleRecord],
                        expected_samples: int, resumed_paused: bool) -> Check:
    """The RL control plane: pause (keep) held the batch, the weight update took a new version, resume let the
    held batch finish without errors."""
    problems = []
    if not paused:
        problems.append("/is_paused was false after /pause")
    if held_before_resume:
        problems.append(f"{held_before_resume} samples arrived while paused")
    if version is None or version < 1:
        problems.append(f"/update_weights answered version {version}")
    if resumed_paused:
        problems.append("/is_paused was still true after /resume")
    errors = sum(s.finish_reason == "error" for s in after)
    if len(after) != expected_samples or errors:
        problems.append(f"the held batch gave {len(after)} of {expected_samples} samples, {errors} errors")
    elif version is not None and any(s.policy_version != version for s in after):
        problems.append("held samples did not finish under the new policy version")
    return Check("RL control plane (pause keep, update_weights, resume)", not problems,
                 "; ".join(problems) or f"held batch completed after /resume under policy version {version}")


def kill_check(killed: list[int], after: list[SampleRecord], expected_samples: int) -> Check:
    """An engine-core process was killed and the next batch still completed without errors."""
    errors = sum(s.finish_reason == "error" for s in after)
    if not killed:
        return Check("engine kill", False, f"no {ENGINE_CORE} process found to kill")
    ok = len(after) == expected_samples and not errors
    return Check("engine kill", ok, f"killed pid {', '.join(map(str, killed))}; the next batch gave {len(after)} "
                                    f"of {expected_samples} samples, {errors} errors")


@dataclass
class GpuCheckReport:
    config: GpuCheckConfig
    device: str
    batches: list[ArmBatch] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # arms left out of the default, each with why

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        arms = []
        for b in self.batches:
            row = {k: v for k, v in asdict(b).items() if k not in ("tokens_of", "engine")}
            engine = {k: v for k, v in b.engine.items() if k != "engine"}
            arms.append(row | {"tokens_per_s": round(b.tokens_per_s, 1), "compared": b.arm != PLAIN,
                               "runner": engine.pop("runner", None),
                               "async_scheduling": engine.pop("async_scheduling", None),
                               "host_ms_per_step": engine.pop("host_ms_per_step", None)} | engine)
        return {"config": asdict(self.config), "device": self.device, "passed": self.passed,
                "checks": [asdict(c) for c in self.checks], "skipped": self.skipped, "arms": arms,
                "plain_vllm": plain_comparison(self.batches)}

    def print(self, console: Console) -> None:
        arms = Table(title=f"das bench gpu-check on {self.device}: {self.config.problems} x {self.config.samples}, "
                           f"{self.config.max_tokens} tokens, T={self.config.temperature}, {self.config.dtype}")
        for column in ("arm", "runner", "async", "host ms/step", "forward ms/step", "makespan s", "tokens",
                       "tokens/s", "drafted", "accepted", "errors"):
            arms.add_column(column, justify="right")
        for b in self.batches:
            e = b.engine
            arms.add_row(b.arm, str(e.get("runner") or "-"), {True: "on", False: "off"}.get(e.get("async_scheduling"),
                                                                                            "-"),
                         _ms(e.get("host_ms_per_step")), _ms(e.get("model_ms_per_step")), f"{b.makespan_s:.1f}",
                         str(b.tokens), f"{b.tokens_per_s:.0f}", str(b.draft_tokens), str(b.accepted_tokens),
                         str(b.errors))
        console.print(arms)
        for line in self.skipped:
            console.print(f"skipped {line}")
        if (plain := plain_comparison(self.batches)) is not None:
            console.print(f"das against plain vLLM ({plain['plain_runner']}, async scheduling "
                          f"{'on' if plain['plain_async_scheduling'] else 'off'}; speed only, one batch): makespan "
                          f"{plain['das_over_plain_makespan']:.3f}x, tokens/s {plain['das_over_plain_tokens_per_s']:.3f}x")
        checks = Table(title="acceptance checks: " + ("[green]all passed[/green]" if self.passed
                                                       else "[red]FAILED[/red]"))
        for column in ("check", "result", "detail"):
            checks.add_column(column)
        for c in self.checks:
            checks.add_row(c.name, "[green]pass[/green]" if c.passed else "[red]FAIL[/red]", c.detail)
        console.print(checks)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


# ---- the run (real servers) ----

def engine_core_pids(session_leader: int) -> list[int]:
    """vLLM engine-core processes in the session of `session_leader` (the das serve process and its Ray)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            if os.getsid(proc.info["pid"]) != session_leader:
                continue
        except OSError:
            continue
        title = " ".join(proc.info["cmdline"] or []) + " " + (proc.info["name"] or "")
        if ENGINE_CORE in title:
            found.append(proc.info["pid"])
    return found


def run_batch(client: RolloutClient, groups: list[dict[str, Any]], seed: int) -> list[SampleRecord]:
    return list(client.generate(groups, seed=seed))


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (dry run)"


def run_gpu_check(config: GpuCheckConfig, problems: list[Problem], log_dir: Path,
                  progress: Callable[[str], None], skipped: list[str] | None = None) -> GpuCheckReport:
    """The acceptance run (module docstring): a server per arm in `config.order`, the das server last for the
    control plane and the kill. `skipped`: arms left out of the default and why (reported)."""
    import httpx

    from das.bench.server_profile import engine_steps
    from das.bench.user_run import ServeProcess, UserRunConfig
    from das.service.engine.vllm.engine import engine_dtype
    from das.service.engine.vllm.models import prepare_model

    sampling = SamplingSpec(max_tokens=config.max_tokens, temperature=config.temperature)
    groups = [p.group(config.samples, sampling).model_dump(exclude_none=True) for p in problems]
    expected = len(groups) * config.samples
    weights = prepare_model(config.model, progress=True, dtype=engine_dtype(config.dtype))
    serve = UserRunConfig(port=config.port, ready_timeout_s=config.ready_timeout_s,
                          serve_args=("--model", config.model, "--dtype", config.dtype, "--weights-root",
                                      str(weights.parent), *config.serve_args))
    report = GpuCheckReport(config, device_name(), skipped=list(skipped or []))
    log_dir.mkdir(parents=True, exist_ok=True)
    for line in report.skipped:
        progress(f"skipped {line}")
    for arm in config.order:
        flags = arm_flags(arm)
        progress(f"{arm}: starting das serve {' '.join(flags)}")
        server = ServeProcess(flags, serve, log_dir / f"gpu-check-{arm}.log")
        try:
            server.wait_ready(config.ready_timeout_s, progress)
            with RolloutClient(server.url, None) as client:
                t0 = time.perf_counter()
                samples = run_batch(client, groups, config.seed)
                seconds = time.perf_counter() - t0
                engines = engine_steps(httpx.get(f"{server.url}/metrics", timeout=10.0).text)
                report.batches.append(ArmBatch.of(arm, samples, seconds, engines[0].summary() if engines else None))
                b = report.batches[-1]
                progress(f"{arm}: {b.tokens} tokens in {b.makespan_s:.1f} s on {b.engine.get('runner')} "
                         f"(host {_ms(b.engine.get('host_ms_per_step'))} ms a step)")
                if arm == "das":
                    report.checks += _control_plane_and_kill(client, server.proc.pid, groups, config, weights,
                                                             expected, progress)
        except (RuntimeError, TimeoutError, OSError, httpx.HTTPError) as exc:
            report.checks.append(Check(f"{arm} server", False, f"{type(exc).__name__}: {exc}"))
        finally:
            server.stop()
    report.checks[:0] = [runner_check(report.batches), identity_check(report.batches, expected),
                         host_time_check(report.batches), e2e_check(report.batches, expected, config.order)]
    return report


def _control_plane_and_kill(client: RolloutClient, serve_pid: int, groups: list[dict[str, Any]],
                            config: GpuCheckConfig, weights: Path, expected: int,
                            progress: Callable[[str], None]) -> list[Check]:
    progress("das: /pause?mode=keep, a batch sent while paused, /update_weights, /resume")
    client.pause("keep")
    paused = client.is_paused()
    held: list[SampleRecord] = []
    sender = threading.Thread(target=lambda: held.extend(run_batch(client, groups, config.seed + 1)), daemon=True)
    sender.start()
    time.sleep(5.0)  # long enough for samples to arrive if the pause did not hold them
    held_before = len(held)
    version = client.update_weights(str(weights))
    client.resume()
    resumed_paused = client.is_paused()
    sender.join(config.batch_timeout_s)
    checks = [control_plane_check(held_before, paused, version, held, expected, resumed_paused)]
    progress("das: killing an engine-core process, then another batch")
    killed = engine_core_pids(serve_pid)[:1]
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    after = run_batch(client, groups, config.seed + 2)
    checks.append(kill_check(killed, after, expected))
    return checks
