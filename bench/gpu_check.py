"""`das bench gpu-check`: the acceptance run for one machine with one GPU (or, as a dry run, the CPU).

One command, as a user would run the service: `das serve` per arm (none, suffix, das; fp32 by default, so that
the arms' logits agree bit for bit and keyed sampling draws the same tokens), the same seeded batch at T > 0
against each, then on the das server the RL control plane and an engine kill. Checks:

- identical samples: every sample of every arm has the tokens the `none` arm drew (keyed sampling, T > 0);
- short e2e: each arm's batch completes without an error sample (makespan, tokens/s, drafts accepted reported;
  one batch, so no speed verdict);
- RL control plane: POST /pause?mode=keep, a batch sent while paused is held (nothing arrives), POST
  /update_weights with the served model's own directory, POST /resume, and the held batch then completes under
  the new policy version with no error sample;
- engine kill: SIGKILL to a vLLM engine-core process of the server; the next batch completes without an error
  sample (the service restarts the engine and re-dispatches).

Prints a rich table and writes the report as JSON. The figures of a run on a shared CPU are not speeds.
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

ARMS = ("none", "suffix", "das")
BASELINE = "none"
ENGINE_CORE = "EngineCore"  # vLLM's engine-core process title (VLLM::EngineCore...)


@dataclass(frozen=True)
class GpuCheckConfig:
    """One acceptance run. `serve_args`: more `das serve` flags for every server (e.g. `--eager`)."""

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

    @classmethod
    def of(cls, arm: str, samples: Iterable[SampleRecord], seconds: float) -> ArmBatch:
        got = list(samples)
        return cls(arm, round(seconds, 3), sum(len(s.output_token_ids) for s in got),
                   sum(s.draft_tokens for s in got), sum(s.accepted_tokens for s in got),
                   sum(s.finish_reason == "error" for s in got),
                   {f"{s.problem_id}/{s.sample_index}": list(s.output_token_ids) for s in got})

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.makespan_s if self.makespan_s > 0 else 0.0


@dataclass(frozen=True)
class Check:
    """One acceptance check: passed, and what was seen."""

    name: str
    passed: bool
    detail: str


def identity_check(batches: list[ArmBatch], expected_samples: int) -> Check:
    """Every arm drew exactly the baseline arm's tokens for every sample."""
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

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {"config": asdict(self.config), "device": self.device, "passed": self.passed,
                "checks": [asdict(c) for c in self.checks],
                "arms": [{k: v for k, v in asdict(b).items() if k != "tokens_of"} | {
                    "tokens_per_s": round(b.tokens_per_s, 1)} for b in self.batches]}

    def print(self, console: Console) -> None:
        arms = Table(title=f"das bench gpu-check on {self.device}: {self.config.problems} x {self.config.samples}, "
                           f"{self.config.max_tokens} tokens, T={self.config.temperature}, {self.config.dtype}")
        for column in ("arm", "makespan s", "tokens", "tokens/s", "drafted", "accepted", "errors"):
            arms.add_column(column, justify="right")
        for b in self.batches:
            arms.add_row(b.arm, f"{b.makespan_s:.1f}", str(b.tokens), f"{b.tokens_per_s:.0f}", str(b.draft_tokens),
                         str(b.accepted_tokens), str(b.errors))
        console.print(arms)
        checks = Table(title="acceptance checks: " + ("[green]all passed[/green]" if self.passed
                                                       else "[red]FAILED[/red]"))
        for column in ("check", "result", "detail"):
            checks.add_column(column)
        for c in self.checks:
            checks.add_row(c.name, "[green]pass[/green]" if c.passed else "[red]FAIL[/red]", c.detail)
        console.print(checks)


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
                  progress: Callable[[str], None]) -> GpuCheckReport:
    """The acceptance run (module docstring): a server per arm in turn, the das server last for the control plane
    and the kill."""
    from das.bench.user_run import ServeProcess, UserRunConfig
    from das.service.engine.async_engine import engine_dtype
    from das.service.engine.models import prepare_model

    sampling = SamplingSpec(max_tokens=config.max_tokens, temperature=config.temperature)
    groups = [p.group(config.samples, sampling).model_dump(exclude_none=True) for p in problems]
    expected = len(groups) * config.samples
    weights = prepare_model(config.model, progress=True, dtype=engine_dtype(config.dtype))
    serve = UserRunConfig(port=config.port, ready_timeout_s=config.ready_timeout_s,
                          serve_args=("--model", config.model, "--dtype", config.dtype, "--weights-root",
                                      str(weights.parent), *config.serve_args))
    report = GpuCheckReport(config, device_name())
    log_dir.mkdir(parents=True, exist_ok=True)
    for arm in ARMS:
        progress(f"{arm}: starting das serve --speculation {arm}")
        server = ServeProcess(("--speculation", arm), serve, log_dir / f"gpu-check-{arm}.log")
        try:
            server.wait_ready(config.ready_timeout_s, progress)
            with RolloutClient(server.url, None) as client:
                t0 = time.perf_counter()
                report.batches.append(ArmBatch.of(arm, run_batch(client, groups, config.seed),
                                                  time.perf_counter() - t0))
                progress(f"{arm}: {report.batches[-1].tokens} tokens in {report.batches[-1].makespan_s:.1f} s")
                if arm == "das":
                    report.checks += _control_plane_and_kill(client, server.proc.pid, groups, config, weights,
                                                             expected, progress)
        except (RuntimeError, TimeoutError, OSError) as exc:
            report.checks.append(Check(f"{arm} server", False, f"{type(exc).__name__}: {exc}"))
        finally:
            server.stop()
    report.checks[:0] = [identity_check(report.batches, expected), e2e_check(report.batches, expected, ARMS)]
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
