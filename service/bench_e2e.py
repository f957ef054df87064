"""`das bench e2e`: the same prompts, epoch after epoch, on one engine per arm (none, das, ngram, suffix).

Every arm gets its own engine with the same settings (model, dtype, context, seed, K); all engines are started
first, then each epoch runs every arm in turn, so the arms of an epoch are measured minutes apart under the same
machine load. `das` keeps its history from epoch to epoch (the RL setting: the same problems come back).

Per arm and epoch: makespan_s (first submit to last sample), tokens (output), tokens_per_s, draft_tokens and
accepted_tokens (vLLM's own speculative-decoding counters, the same for every method), acceptance_length (tokens
per verification step that carried a draft: 1 + accepted / drafts), tail_share (share of the makespan after the
median sample finished: what a long tail costs). identical_outputs: whether all arms produced token-identical
samples in every epoch (null at temperature > 0, where they need not); divergence: per arm, the share of samples
whose tokens differ from the first arm's, and noise_floor: the share of the first arm's samples that differ
between its own first two epochs (both at temperature 0: batch-shape numerics in bf16 make samples diverge even
without speculation, so divergence is read against this floor).
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from das.service.api_types import SampleResult, SamplingSpec
from das.service.engine import Engine, EngineConfig, SpecDecodeTally
from das.service.prompt_sets import Problem

ARMS = ("none", "das", "ngram", "suffix")


@dataclass(frozen=True)
class E2EConfig:
    model: str
    prompts: str
    samples: int = 8
    epochs: int = 2
    max_tokens: int = 256
    temperature: float = 0.0
    arms: tuple[str, ...] = ("none", "das")
    num_speculative_tokens: int = 8
    dtype: str = "bfloat16"
    max_model_len: int = 2048
    seed: int = 0
    enforce_eager: bool = False
    budget: dict[str, Any] = field(default_factory=dict)  # the das arm's budget hook (drafter/budget_hook.py)

    def __post_init__(self) -> None:
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown or not self.arms or len(set(self.arms)) != len(self.arms):
            raise ValueError(f"arms must be distinct names from {', '.join(ARMS)}; got {','.join(self.arms)}")
        for name in ("samples", "epochs", "max_tokens", "num_speculative_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in ("bfloat16", "float32", "float16"):
            raise ValueError(f"dtype must be bfloat16, float32 or float16, got {self.dtype!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


@dataclass
class ArmEpoch:
    makespan_s: float
    tokens: int
    tokens_per_s: float
    draft_tokens: int
    accepted_tokens: int
    acceptance_length: float
    tail_share: float
    errors: int


@dataclass
class E2EResult:
    config: E2EConfig
    epochs: list[dict[str, ArmEpoch]] = field(default_factory=list)
    identical_outputs: bool | None = None
    divergence: dict[str, float] = field(default_factory=dict)
    noise_floor: float | None = None
    proposer: dict[str, Any] = field(default_factory=dict)  # the das arm's per-step cost and history size
    setup_s: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"config": dataclasses.asdict(self.config),
                "epochs": [{"epoch": e, "arms": {arm: dataclasses.asdict(s) for arm, s in arms.items()}}
                           for e, arms in enumerate(self.epochs)],
                "identical_outputs": self.identical_outputs,
                "divergence": self.divergence,
                "noise_floor": self.noise_floor,
                "proposer": self.proposer,
                "engine_start_s": self.setup_s}

    def print(self, console: Any) -> None:
        from rich.table import Table

        table = Table(title=f"das bench e2e: {self.config.model}, {self.config.samples} samples x "
                            f"{self.config.epochs} epochs, T={self.config.temperature}")
        for col in ("epoch", "arm", "makespan s", "tok/s", "vs none", "drafted", "accepted", "accept len",
                    "tail share"):
            table.add_column(col, justify="right")
        for e, arms in enumerate(self.epochs):
            base = arms.get("none")
            for arm, s in arms.items():
                ratio = f"x{base.makespan_s / s.makespan_s:.2f}" if base and s.makespan_s else "-"
                table.add_row(str(e), arm, f"{s.makespan_s:.2f}", f"{s.tokens_per_s:.1f}", ratio,
                              str(s.draft_tokens), str(s.accepted_tokens), f"{s.acceptance_length:.2f}",
                              f"{s.tail_share:.2f}")
        console.print(table)
        console.print(f"identical outputs across arms: {self.identical_outputs}")
        if self.divergence:
            shares = ", ".join(f"{arm} {share:.1%}" for arm, share in self.divergence.items())
            console.print(f"samples that differ from {self.config.arms[0]}: {shares}")
        if self.noise_floor is not None:
            console.print(f"noise floor: {self.noise_floor:.1%} of {self.config.arms[0]}'s samples differ between "
                          f"its own epochs 1 and 2 (same prompts, other batch timing)")
        if self.proposer:
            p = self.proposer
            console.print(f"das proposer per decode step: p50 {p['step_us_p50']:.0f} us, p99 {p['step_us_p99']:.0f} us "
                          f"at {p['mean_batch']:.1f} requests on average; history {p['stored_tokens']} tokens")


async def run_e2e(config: E2EConfig, problems: list[Problem],
                  progress: Callable[[str], None] = lambda _: None) -> E2EResult:
    sampling = SamplingSpec(max_tokens=config.max_tokens, temperature=config.temperature)
    groups = [p.group(config.samples, sampling) for p in problems]
    result = E2EResult(config)
    engines: dict[str, Engine] = {}
    outputs: dict[str, list[list[list[int]]]] = {arm: [] for arm in config.arms}
    try:
        for arm in config.arms:
            progress(f"starting the {arm} engine")
            t0 = time.perf_counter()
            engines[arm] = await Engine.create(EngineConfig(
                model=config.model, speculation=arm, num_speculative_tokens=config.num_speculative_tokens,
                dtype=config.dtype, max_model_len=config.max_model_len, seed=config.seed,  # type: ignore[arg-type]
                enforce_eager=config.enforce_eager, budget=config.budget if arm == "das" else {}))
            result.setup_s[arm] = round(time.perf_counter() - t0, 1)
        for epoch in range(config.epochs):
            row: dict[str, ArmEpoch] = {}
            for arm, engine in engines.items():
                progress(f"epoch {epoch + 1}/{config.epochs}: {arm}")
                stats, samples = await _run_epoch(engine, groups)
                row[arm] = stats
                outputs[arm].append([s.token_ids for s in samples])
            result.epochs.append(row)
        if "das" in engines:
            result.proposer = await engines["das"].drafter_stats()
    finally:
        for engine in engines.values():
            await engine.close()
    if config.temperature == 0:
        first = [s for epoch in outputs[config.arms[0]] for s in epoch]
        for arm in config.arms[1:]:
            mine = [s for epoch in outputs[arm] for s in epoch]
            result.divergence[arm] = round(sum(a != b for a, b in zip(first, mine)) / len(first), 4)
        result.identical_outputs = not any(result.divergence.values()) if result.divergence else None
        runs = outputs[config.arms[0]]
        if len(runs) > 1:
            result.noise_floor = round(sum(a != b for a, b in zip(runs[0], runs[1])) / len(runs[0]), 4)
    return result


async def _run_epoch(engine: Engine, groups: list[Any]) -> tuple[ArmEpoch, list[SampleResult]]:
    before = dataclasses.replace(engine.spec_tally)
    start = time.perf_counter()
    finished: list[float] = []

    async def one(group: Any) -> list[SampleResult]:
        out = []
        async for sample in engine.generate(group):
            finished.append(time.perf_counter() - start)
            out.append(sample)
        return sorted(out, key=lambda s: s.sample_index)

    per_group = await asyncio.gather(*(one(g) for g in groups))
    makespan = time.perf_counter() - start
    samples = [s for g in per_group for s in g]
    after: SpecDecodeTally = engine.spec_tally
    drafts = after.drafts - before.drafts
    accepted = after.accepted_tokens - before.accepted_tokens
    tokens = sum(len(s.token_ids) for s in samples)
    median_done = statistics.median(finished)
    return ArmEpoch(
        makespan_s=round(makespan, 3), tokens=tokens, tokens_per_s=round(tokens / makespan, 2),
        draft_tokens=after.draft_tokens - before.draft_tokens, accepted_tokens=accepted,
        acceptance_length=round(1 + accepted / drafts, 3) if drafts else 1.0,
        tail_share=round((makespan - median_done) / makespan, 3),
        errors=sum(s.finish_reason == "error" for s in samples)), samples
