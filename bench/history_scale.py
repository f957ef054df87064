"""`das bench history`: the history store at a dataset's scale (docs/design "The history store").

`problems` problems with `rollouts_per_problem` rollouts each, `tokens` output tokens in all, imported into `shards`
HistoryShard actors (the cluster's history store) in an embedded Ray cluster, as `POST /v1/history` does it
(`RayBackend.control` of an `AddHistory`: records cut by shard, one `put` per shard per chunk, chunks one after
another). While the import runs, a reader looks problems up one at a time (`summary`, what `GET /v1/history/{id}`
calls, and `pull`, what an engine calls before it runs a group), and the latencies are kept apart from the same
lookups on the idle store afterwards. Then: resident memory per stored token (the shard processes' growth over the
import, over the tokens stored), a snapshot of every shard at once (time, bytes), and a restore (every shard actor
killed and started again from the state directory; the time until each answers, and what it holds).
"""

from __future__ import annotations

import asyncio
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table


@dataclass(frozen=True)
class HistoryScaleConfig:
    """What `run_history_bench` imports. Output lengths are `tokens / (problems x rollouts_per_problem)` each."""

    problems: int = 100_000
    tokens: int = 10_000_000
    rollouts_per_problem: int = 2
    prompt_tokens: int = 64
    shards: int = 4
    chunk_records: int = 10_000  # records per import request (a client's add_history cuts its import so)
    lookup_interval_s: float = 0.02  # the reader's pause between two lookups

    def check(self) -> None:
        """ValueError for sizes that cannot run."""
        if min(self.problems, self.rollouts_per_problem, self.prompt_tokens, self.shards, self.chunk_records) < 1:
            raise ValueError("problems, rollouts_per_problem, prompt_tokens, shards and chunk_records must be >= 1")
        if self.tokens < self.problems * self.rollouts_per_problem:
            raise ValueError("tokens must give every rollout at least one output token")

    @property
    def output_tokens(self) -> int:
        """Output tokens of one rollout."""
        return self.tokens // (self.problems * self.rollouts_per_problem)


@dataclass(frozen=True)
class Latency:
    """Seconds of `count` calls: median, 99th percentile, largest."""

    count: int
    p50_ms: float
    p99_ms: float
    max_ms: float

    @classmethod
    def of(cls, seconds: list[float]) -> Latency:
        ms = np.array(seconds or [0.0]) * 1e3
        return cls(len(seconds), float(np.percentile(ms, 50)), float(np.percentile(ms, 99)), float(ms.max()))


@dataclass
class HistoryScaleResult:
    config: HistoryScaleConfig
    machine: dict[str, Any]
    import_s: float = 0.0
    import_tokens_per_s: float = 0.0
    problems_stored: int = 0
    tokens_stored: int = 0
    resident_bytes_before: int = 0
    resident_bytes_after: int = 0
    resident_bytes_per_token: float = 0.0
    snapshot_s: float = 0.0
    snapshot_bytes: int = 0
    start_empty_s: float = 0.0  # every shard actor started on an empty state directory, until each answers
    restore_s: float = 0.0
    problems_restored: int = 0
    tokens_restored: int = 0
    lookups: dict[str, Latency] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["config"] = asdict(self.config)
        return out

    def print(self, console: Console) -> None:
        c = self.config
        table = Table(title=f"History store: {c.problems:,} problems x {c.rollouts_per_problem} rollouts, "
                            f"{self.tokens_stored:,} output tokens, {c.shards} shards")
        table.add_column("figure")
        table.add_column("value", justify="right")
        rows = [("import (tokens/s)", f"{self.import_s:.1f} s ({self.import_tokens_per_s:,.0f})"),
                ("resident memory of the shards, before / after",
                 f"{self.resident_bytes_before / 2**20:,.0f} / {self.resident_bytes_after / 2**20:,.0f} MiB"),
                ("resident bytes per stored output token", f"{self.resident_bytes_per_token:.1f}"),
                ("snapshot of every shard at once", f"{self.snapshot_s:.2f} s, {self.snapshot_bytes / 2**20:,.0f} MiB"),
                ("start on an empty state directory", f"{self.start_empty_s:.2f} s"),
                ("restore (killed, started again, answering)", f"{self.restore_s:.2f} s, "
                                                              f"{self.problems_restored:,} problems, "
                                                              f"{self.tokens_restored:,} tokens")]
        rows += [(f"{name}: p50 / p99 / max (calls)", f"{lat.p50_ms:.1f} / {lat.p99_ms:.1f} / {lat.max_ms:.1f} ms "
                                                      f"({lat.count:,})") for name, lat in self.lookups.items()]
        for row in rows:
            table.add_row(*row)
        console.print(table)
        console.print(f"machine: {self.machine}")


def _say(message: str) -> None:
    print(f"[history] {message}", file=sys.stderr, flush=True)


def _records(config: HistoryScaleConfig, first: int, last: int) -> list[dict[str, Any]]:
    """The rollouts of problems first..last-1 in the history format (distinct prompts and outputs per problem)."""
    length = config.output_tokens
    out = []
    for p in range(first, last):
        prompt = [(p + i) % 30_000 + 1 for i in range(config.prompt_tokens)]
        for s in range(config.rollouts_per_problem):
            out.append({"problem_id": f"problem-{p}", "policy_version": 1, "sample_index": s,
                        "prompt_token_ids": prompt,
                        "output_token_ids": [(p * 7 + s * 13 + i) % 30_000 + 1 for i in range(length)],
                        "finish_reason": "stop"})
    return out


async def _lookups(shards: list[Any], problems: Callable[[], int], interval_s: float, stop: asyncio.Event,
                   summary_s: list[float], pull_s: list[float]) -> None:
    """Looks up a random problem among the first `problems()` imported, one call at a time, until `stop`."""
    from das.service.cluster.history_store import shard_of

    rng = random.Random(0)
    while not stop.is_set():
        known = problems()
        if known:
            pid = f"problem-{rng.randrange(known)}"
            shard = shards[shard_of(pid, len(shards))]
            started = time.perf_counter()
            await shard.summary.remote(pid)
            summary_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            await shard.pull.remote({pid: 0}, "bench-reader")
            pull_s.append(time.perf_counter() - started)
        await asyncio.sleep(interval_s)


async def _run(config: HistoryScaleConfig, state_dir: str, progress: Callable[[str], None],
               result: HistoryScaleResult) -> None:
    import ray

    from das.service.cluster.history_store import HistoryShardActor, shard_of
    from das.service.config import HistoryConfig

    history = HistoryConfig(shards=config.shards, max_tokens=max(50_000_000, 2 * config.tokens // config.shards))
    actor = ray.remote(HistoryShardActor).options(num_cpus=0, max_restarts=0)
    started = time.perf_counter()
    shards = [actor.remote(i, history, state_dir) for i in range(config.shards)]
    before = await asyncio.gather(*(s.stats.remote() for s in shards))
    result.start_empty_s = time.perf_counter() - started
    result.resident_bytes_before = sum(s.resident_bytes for s in before)

    imported = 0
    stop = asyncio.Event()
    during: tuple[list[float], list[float]] = ([], [])
    reader = asyncio.create_task(_lookups(shards, lambda: imported, config.lookup_interval_s, stop, *during))
    per_chunk = max(1, config.chunk_records // config.rollouts_per_problem)
    started = time.perf_counter()
    last_said = started
    for first in range(0, config.problems, per_chunk):
        last = min(first + per_chunk, config.problems)
        records = await asyncio.to_thread(_records, config, first, last)
        by_shard: dict[int, list[dict[str, Any]]] = {}
        for record in records:
            by_shard.setdefault(shard_of(record["problem_id"], config.shards), []).append(record)
        await asyncio.gather(*(shards[s].put.remote("import", rs) for s, rs in by_shard.items()))
        imported = last
        if time.perf_counter() - last_said > 5:
            last_said = time.perf_counter()
            progress(f"imported {imported:,} / {config.problems:,} problems ({last_said - started:.0f} s)")
    result.import_s = time.perf_counter() - started
    stop.set()
    await reader

    stats = await asyncio.gather(*(s.stats.remote() for s in shards))
    result.problems_stored = sum(s.problems for s in stats)
    result.tokens_stored = sum(s.output_tokens for s in stats)
    result.import_tokens_per_s = result.tokens_stored / result.import_s
    result.resident_bytes_after = sum(s.resident_bytes for s in stats)
    result.resident_bytes_per_token = ((result.resident_bytes_after - result.resident_bytes_before)
                                       / max(result.tokens_stored, 1))
    progress(f"imported {result.tokens_stored:,} tokens of {result.problems_stored:,} problems in "
             f"{result.import_s:.1f} s; {result.resident_bytes_per_token:.1f} resident bytes a token")

    stop = asyncio.Event()
    idle: tuple[list[float], list[float]] = ([], [])
    reader = asyncio.create_task(_lookups(shards, lambda: imported, config.lookup_interval_s, stop, *idle))
    await asyncio.sleep(max(2.0, 100 * config.lookup_interval_s))
    stop.set()
    await reader
    result.lookups = {"summary while importing": Latency.of(during[0]), "pull while importing": Latency.of(during[1]),
                      "summary, idle": Latency.of(idle[0]), "pull, idle": Latency.of(idle[1])}

    started = time.perf_counter()
    await asyncio.gather(*(s.snapshot.remote(True) for s in shards))
    result.snapshot_s = time.perf_counter() - started
    result.snapshot_bytes = sum(p.stat().st_size for p in Path(state_dir).glob("history-shard-*.msgpack"))
    progress(f"snapshot of {config.shards} shards: {result.snapshot_s:.2f} s, {result.snapshot_bytes / 2**20:.0f} MiB")

    for shard in shards:
        ray.kill(shard)  # no exit snapshot: what a crash leaves
    started = time.perf_counter()
    shards = [actor.remote(i, history, state_dir) for i in range(config.shards)]
    restored = await asyncio.gather(*(s.stats.remote() for s in shards))
    result.restore_s = time.perf_counter() - started
    result.problems_restored = sum(s.problems for s in restored)
    result.tokens_restored = sum(s.output_tokens for s in restored)
    progress(f"restored {result.problems_restored:,} problems in {result.restore_s:.2f} s")
    for shard in shards:
        ray.kill(shard)


def run_history_bench(config: HistoryScaleConfig, progress: Callable[[str], None] = _say) -> HistoryScaleResult:
    """Runs the import, lookups, snapshot and restore in an embedded Ray cluster (shut down at the end) with a
    temporary state directory (removed)."""
    import os
    import platform

    import ray

    config.check()
    result = HistoryScaleResult(config, {"cpus": os.cpu_count(), "python": platform.python_version(),
                                         "ray": ray.__version__, "load_average_at_start": list(os.getloadavg())})
    progress(f"{config.problems:,} problems, {config.tokens:,} tokens into {config.shards} shards")
    ray.init(address="local", include_dashboard=False, object_store_memory=256 << 20, num_cpus=2)
    try:
        with tempfile.TemporaryDirectory(prefix="das-history-bench-") as state_dir:
            asyncio.run(_run(config, state_dir, progress, result))
    finally:
        ray.shutdown()
    return result
