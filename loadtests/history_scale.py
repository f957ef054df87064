"""The history store at cluster scale: what one shard sustains, and how many shards a 512-engine cluster needs.

The load is the original system's step on every node of a 64-node x 8-engine cluster: each node runs 128 prompts
x 16 samples a step, outputs up to 16K tokens (long-tailed), a window of 2 policy versions. One shard holds its
share of those problems; this script plays that share against ONE shard, scaled down to what a small machine runs
in minutes, and measures the shard:

- push: every group's 16 rollouts arrive as one `push` (what `HistoryClient` sends when a group's stream ends),
  from many engines at once (`--push-concurrency` calls in flight); tokens stored per second of wall time.
- pull at dispatch: at the start of every step after the first, every engine with problems on the shard pulls
  them at once (one call each; an engine mostly runs problems it did not run before, so it pulls their whole
  window); latency of each call from the start of the burst (queueing behind the others included), p50 / p99.
- memory per stored token: the shard process's resident memory after the run minus before, over the output
  tokens it holds (the store itself accounts 4 bytes a token, in int32 arrays).
- snapshot: `snapshot(force=True)` of the full shard to a state directory (msgpack, sha256, fsync, rename).

Then the arithmetic for the cluster (printed with every term): push demand = engines x decode tokens/s each
(`--engine-tokens-per-s`, an assumption) against the shard's push rate at `--utilisation`; the dispatch burst
(every problem of the step pulls its window at once) against the shard's pull rate within `--dispatch-target-s`;
the tokens held (the larger of the step's problems x window and the dataset's problems x one group) against a
shard's `max_tokens`; the snapshot of a shard's share within `--snapshot-target-s`. Shards = the largest.

`--mode actor` (default) runs the shard as the service does, a Ray actor (`HistoryShardActor`, an embedded
single-node Ray cluster), with Ray's serialization both ways; `--mode in-process` calls the shard class in this
process with the same pickling of arguments and replies (no Ray: fast start, for the smoke test).

Run:  .venv/bin/python loadtests/history_scale.py --out history-scale.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import pickle
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from das.service.cluster.history_store import HistoryShard, HistoryShardActor, PushReply, ShardStats
from das.service.config import HistoryConfig

Mode = Literal["actor", "in-process"]


@dataclass(frozen=True)
class ScaleConfig:
    """One run: the load on the shard under test, then the cluster the arithmetic is for."""

    mode: Mode = "actor"
    problems: int = 256  # problems on the shard under test (its share of the cluster's step)
    samples: int = 16  # rollouts per problem per step (the group size)
    steps: int = 3  # policy versions pushed, one a step
    median_tokens: int = 3000  # output length: lognormal with this median ...
    sigma: float = 0.8  # ... and this log-space spread ...
    max_tokens: int = 16384  # ... capped here
    prompt_tokens: int = 256
    engines: int = 512  # engines that may pull from the shard at dispatch (callers: at most one per problem)
    push_concurrency: int = 32  # pushes in flight at once
    window_versions: int = 2
    seed: int = 0
    # The cluster of the arithmetic.
    nodes: int = 64
    engines_per_node: int = 8
    prompts_per_node_step: int = 128
    dataset_problems: int = 17_000  # problems revisited epoch after epoch (e.g. DAPO-Math-17K)
    engine_tokens_per_s: float = 2500.0  # decode throughput of one engine (assumption: 7B model, one H100)
    utilisation: float = 0.5  # share of a shard's push rate the cluster may use (pushes come in bursts)
    dispatch_target_s: float = 2.0  # the step's pulls at dispatch should be served within this
    snapshot_target_s: float = 5.0  # a snapshot blocks its shard; keep it under this
    shard_max_tokens: int = HistoryConfig().max_tokens


@dataclass
class Figures:
    """What the run measured on the one shard."""

    mean_tokens: float = 0.0
    pushed_tokens: int = 0
    push_calls: int = 0
    push_s: float = 0.0
    push_tokens_per_s: float = 0.0
    pull_calls: int = 0
    pull_ms: dict[str, float] = field(default_factory=dict)  # p50, p99, max over every dispatch's calls
    pulled_tokens: int = 0
    pull_tokens_per_s: float = 0.0  # tokens returned / burst wall time, over the dispatches
    stored_tokens: int = 0
    stored_rollouts: int = 0
    rss_before_bytes: int = 0
    rss_after_bytes: int = 0
    memory_bytes_per_token: float = 0.0
    snapshot_s: float = 0.0
    snapshot_bytes: int = 0
    snapshot_bytes_per_token: float = 0.0


@dataclass
class Result:
    config: dict[str, Any]
    figures: Figures
    cluster: dict[str, Any]
    mode_note: str
    elapsed_s: float


class _Shard:
    """The shard under test behind one async interface: a Ray actor, or the class in-process with the pickling a
    Ray call does (arguments there, the reply back)."""

    def __init__(self, mode: Mode, config: HistoryConfig, state_dir: str) -> None:
        self.mode = mode
        if mode == "actor":
            import ray

            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                     object_store_memory=512 << 20)
            self._actor = ray.remote(HistoryShardActor).options(num_cpus=0, max_restarts=0).remote(
                0, config, state_dir)
        else:
            self._local = HistoryShard(0, config, state_dir)

    async def call(self, method: str, *args: Any) -> Any:
        if self.mode == "actor":
            return await getattr(self._actor, method).remote(*args)
        sent = pickle.loads(pickle.dumps(args, protocol=5))
        return pickle.loads(pickle.dumps(getattr(self._local, method)(*sent), protocol=5))

    def close(self) -> None:
        if self.mode == "actor":
            import ray

            ray.kill(self._actor)  # no snapshot at exit: the measured one is on disk already
            ray.shutdown()


def _lengths(config: ScaleConfig, rng: random.Random, count: int) -> list[int]:
    mu = math.log(config.median_tokens)
    return [max(1, min(config.max_tokens, round(rng.lognormvariate(mu, config.sigma)))) for _ in range(count)]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


async def _measure(config: ScaleConfig, shard: _Shard, progress: Progress) -> Figures:
    rng = random.Random(config.seed)
    pool = [rng.randrange(150_000) for _ in range(2 * config.max_tokens)]  # output tokens are slices of it
    prompts = {f"problem-{p}": pool[p: p + config.prompt_tokens] for p in range(config.problems)}
    callers = min(config.engines, config.problems)
    ids: dict[str, int] = {}
    cursors: dict[tuple[int, str], int] = {}  # (engine, problem) -> its cursor
    figures = Figures()
    lengths_seen: list[int] = []
    pull_latencies: list[float] = []
    pull_wall = 0.0
    before: ShardStats = await shard.call("stats")
    figures.rss_before_bytes = before.resident_bytes
    task = progress.add_task("steps", total=config.steps * (config.problems + callers))

    async def dispatch(step: int) -> None:
        """Every engine with problems on the shard pulls them at once; engine e runs a rotating share."""
        nonlocal pull_wall
        owned: dict[int, list[str]] = {}
        for p, pid in enumerate(prompts):
            owned.setdefault((p + step * 7) % callers, []).append(pid)
        start = time.perf_counter()

        async def pull(engine: int, problems: list[str]) -> None:
            origin = f"engine-{engine}"
            reply = await shard.call("pull", {pid: cursors.get((engine, pid), 0) for pid in problems}, origin)
            pull_latencies.append(time.perf_counter() - start)
            for pid, (records, cursor) in reply.items():
                cursors[(engine, pid)] = cursor
                figures.pulled_tokens += sum(len(r["output_token_ids"]) for r in records)
            progress.advance(task)

        await asyncio.gather(*(pull(e, problems) for e, problems in owned.items()))
        pull_wall += time.perf_counter() - start
        figures.pull_calls += len(owned)

    for step in range(config.steps):
        version = step + 1
        if step > 0:
            await dispatch(step)
        limit = asyncio.Semaphore(config.push_concurrency)

        async def push(p: int, pid: str) -> None:
            origin = f"engine-{(p + version * 3) % config.engines}"
            lengths = _lengths(config, rng, config.samples)
            lengths_seen.extend(lengths)
            records = []
            for i, length in enumerate(lengths):
                offset = rng.randrange(len(pool) - length)
                records.append({"problem_id": pid, "policy_version": version, "sample_index": i,
                                "prompt_token_ids": prompts[pid], "output_token_ids": pool[offset: offset + length],
                                "finish_reason": "length" if length == config.max_tokens else "stop"})
            first = ids.get(origin, 0) + 1
            ids[origin] = first + len(records) - 1
            async with limit:
                reply: PushReply = await shard.call("push", origin, records, list(range(first, ids[origin] + 1)))
            assert reply.stored == len(records), reply
            figures.pushed_tokens += sum(lengths)
            progress.advance(task)

        start = time.perf_counter()
        await asyncio.gather(*(push(p, pid) for p, pid in enumerate(prompts)))
        figures.push_s += time.perf_counter() - start
        figures.push_calls += config.problems
    progress.update(task, description="dispatch")
    await dispatch(config.steps)  # the next step's dispatch: every window full
    progress.update(task, description="snapshot")

    after: ShardStats = await shard.call("stats")
    start = time.perf_counter()
    written = await shard.call("snapshot", True)
    figures.snapshot_s = time.perf_counter() - start
    figures.snapshot_bytes = os.path.getsize(written)
    figures.mean_tokens = statistics.fmean(lengths_seen)
    figures.push_tokens_per_s = figures.pushed_tokens / figures.push_s
    figures.pull_ms = {"p50": 1e3 * _percentile(pull_latencies, 0.5), "p99": 1e3 * _percentile(pull_latencies, 0.99),
                       "max": 1e3 * max(pull_latencies)}
    figures.pull_tokens_per_s = figures.pulled_tokens / pull_wall
    figures.stored_tokens, figures.stored_rollouts = after.output_tokens, after.rollouts
    figures.rss_after_bytes = after.resident_bytes
    figures.memory_bytes_per_token = (after.resident_bytes - before.resident_bytes) / after.output_tokens
    figures.snapshot_bytes_per_token = figures.snapshot_bytes / after.output_tokens
    return figures


def cluster_arithmetic(config: ScaleConfig, f: Figures) -> dict[str, Any]:
    """Shards a cluster needs, from the measured figures; every term with the formula it came from."""
    engines = config.nodes * config.engines_per_node
    step_problems = config.nodes * config.prompts_per_node_step
    window = config.samples * config.window_versions  # rollouts a problem holds at most (and an engine pulls)
    push_demand = engines * config.engine_tokens_per_s
    samples_per_engine_step = config.prompts_per_node_step * config.samples / config.engines_per_node
    step_s = samples_per_engine_step * f.mean_tokens / config.engine_tokens_per_s
    dispatch_tokens = step_problems * window * f.mean_tokens
    held_step = step_problems * window * f.mean_tokens
    held_dataset = config.dataset_problems * config.samples * f.mean_tokens
    held = max(held_step, held_dataset)
    snapshot_s_per_token = f.snapshot_s / f.stored_tokens
    terms = {
        "push": math.ceil(push_demand / (config.utilisation * f.push_tokens_per_s)),
        "dispatch": math.ceil(dispatch_tokens / (f.pull_tokens_per_s * config.dispatch_target_s)),
        "memory": math.ceil(held / config.shard_max_tokens),
        "snapshot": math.ceil(held * snapshot_s_per_token / config.snapshot_target_s),
    }
    shards = max(terms.values())
    per_shard = held / shards
    return {
        "engines": engines, "step_problems": step_problems, "mean_output_tokens": f.mean_tokens,
        "step_s_estimate": step_s,
        "push_demand_tokens_per_s": push_demand,
        "dispatch_tokens": dispatch_tokens,
        "held_tokens_step_window": held_step, "held_tokens_dataset": held_dataset,
        "held_bytes_rss": held * f.memory_bytes_per_token,
        "shards_by": terms, "shards": shards,
        "at_that_count": {
            "push_utilisation": push_demand / shards / f.push_tokens_per_s,
            "dispatch_s": dispatch_tokens / shards / f.pull_tokens_per_s,
            "tokens_per_shard": per_shard,
            "rss_bytes_per_shard": per_shard * f.memory_bytes_per_token,
            "snapshot_s_per_shard": per_shard * snapshot_s_per_token,
            "snapshot_bytes_per_shard": per_shard * f.snapshot_bytes_per_token},
        "formulas": {
            "push": f"{engines} engines x {config.engine_tokens_per_s:g} tok/s = {push_demand:,.0f} tok/s / "
                    f"({config.utilisation:g} x {f.push_tokens_per_s:,.0f} tok/s a shard)",
            "dispatch": f"{step_problems} problems x {window} rollouts x {f.mean_tokens:,.0f} tok = "
                        f"{dispatch_tokens:,.0f} tok / ({f.pull_tokens_per_s:,.0f} tok/s a shard x "
                        f"{config.dispatch_target_s:g} s)",
            "memory": f"max(step: {held_step:,.0f}, dataset {config.dataset_problems} x {config.samples} x "
                      f"{f.mean_tokens:,.0f} = {held_dataset:,.0f}) tok / {config.shard_max_tokens:,} tok a shard",
            "snapshot": f"{held:,.0f} tok x {snapshot_s_per_token * 1e9:.2f} ns/tok / {config.snapshot_target_s:g} s",
        },
    }


def run(config: ScaleConfig, console: Console | None = None) -> Result:
    console = console or Console(stderr=True)
    started = time.perf_counter()
    shard_config = HistoryConfig(shards=1, window_versions=config.window_versions,
                                 max_records_per_problem=max(64, config.samples * config.window_versions),
                                 max_tokens=max(HistoryConfig().max_tokens, 4 * config.problems * config.samples
                                                * config.window_versions * config.max_tokens))
    with tempfile.TemporaryDirectory(prefix="history-scale-") as state_dir:
        shard = _Shard(config.mode, shard_config, state_dir)
        try:
            with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          console=console, transient=True) as progress:
                figures = asyncio.run(_measure(config, shard, progress))
        finally:
            shard.close()
    note = ("a HistoryShardActor in an embedded Ray cluster; this process plays the engines (Ray serialization both "
            "ways)" if config.mode == "actor" else
            "HistoryShard in this process; arguments and replies pickled (protocol 5) as a Ray call would; no Ray "
            "transport, so Ray's per-call overhead is not counted")
    return Result(asdict(config), figures, cluster_arithmetic(config, figures), note,
                  time.perf_counter() - started)


def report(result: Result, console: Console) -> None:
    f, c, cfg = result.figures, result.cluster, result.config
    table = Table(title=f"One history shard ({cfg['mode']}): {cfg['problems']} problems x {cfg['samples']} samples "
                        f"x {cfg['steps']} versions, mean {f.mean_tokens:,.0f} output tokens")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for name, value in (
            ("push: tokens/s sustained", f"{f.push_tokens_per_s:,.0f}"),
            (f"push: calls ({cfg['samples']} rollouts each), tokens", f"{f.push_calls:,} / {f.pushed_tokens:,}"),
            ("pull at dispatch: p50 / p99 / max", " / ".join(f"{f.pull_ms[k]:,.1f} ms" for k in ("p50", "p99", "max"))),
            ("pull: calls, tokens/s served", f"{f.pull_calls:,} / {f.pull_tokens_per_s:,.0f}"),
            ("stored: rollouts / output tokens", f"{f.stored_rollouts:,} / {f.stored_tokens:,}"),
            ("memory: RSS delta per stored token", f"{f.memory_bytes_per_token:.2f} B"),
            ("snapshot: time / size", f"{f.snapshot_s:.3f} s / {f.snapshot_bytes / 2**20:,.1f} MiB"),
            ("snapshot: bytes per stored token", f"{f.snapshot_bytes_per_token:.2f} B")):
        table.add_row(name, value)
    console.print(table)
    cluster = Table(title=f"{c['engines']} engines: shards needed (step of {c['step_problems']} problems, ~"
                          f"{c['step_s_estimate']:,.0f} s at {cfg['engine_tokens_per_s']:g} tok/s an engine)")
    cluster.add_column("bound")
    cluster.add_column("shards", justify="right")
    cluster.add_column("arithmetic")
    for name, shards in c["shards_by"].items():
        cluster.add_row(name, str(shards), c["formulas"][name])
    at = c["at_that_count"]
    cluster.add_row("[bold]needed[/bold]", f"[bold]{c['shards']}[/bold]",
                    f"push at {at['push_utilisation']:.0%} of capacity, dispatch {at['dispatch_s']:.2f} s, "
                    f"{at['tokens_per_shard']:,.0f} tok ({at['rss_bytes_per_shard'] / 2**30:.2f} GiB RSS) a shard, "
                    f"snapshot {at['snapshot_s_per_shard']:.2f} s")
    console.print(cluster)


def main() -> None:
    d = ScaleConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["actor", "in-process"], default=d.mode)
    for name, default, doc in (
            ("problems", d.problems, "problems on the shard under test"),
            ("samples", d.samples, "rollouts per problem per step"),
            ("steps", d.steps, "policy versions pushed"),
            ("median-tokens", d.median_tokens, "median output length (lognormal)"),
            ("sigma", d.sigma, "log-space spread of the output length"),
            ("max-tokens", d.max_tokens, "output length cap"),
            ("prompt-tokens", d.prompt_tokens, "prompt length"),
            ("engines", d.engines, "engines pulling at dispatch (at most one per problem)"),
            ("push-concurrency", d.push_concurrency, "pushes in flight"),
            ("window-versions", d.window_versions, "policy versions a problem keeps"),
            ("seed", d.seed, "random seed"),
            ("nodes", d.nodes, "cluster: nodes"),
            ("engines-per-node", d.engines_per_node, "cluster: engines a node"),
            ("prompts-per-node-step", d.prompts_per_node_step, "cluster: prompts a node runs a step"),
            ("dataset-problems", d.dataset_problems, "cluster: problems revisited every epoch"),
            ("engine-tokens-per-s", d.engine_tokens_per_s, "cluster: decode tokens/s of one engine (assumption)"),
            ("utilisation", d.utilisation, "cluster: share of a shard's push rate to use"),
            ("dispatch-target-s", d.dispatch_target_s, "cluster: seconds the dispatch pulls may take"),
            ("snapshot-target-s", d.snapshot_target_s, "cluster: seconds a shard's snapshot may take"),
            ("shard-max-tokens", d.shard_max_tokens, "cluster: tokens a shard holds (HistoryConfig.max_tokens)")):
        parser.add_argument(f"--{name}", type=type(default), default=default, help=doc)
    parser.add_argument("--out", type=Path, default=Path("history-scale.json"), help="JSON result file")
    args = parser.parse_args()
    config = ScaleConfig(**{k.replace("-", "_"): v for k, v in vars(args).items() if k != "out"})
    result = run(config)
    report(result, Console(width=160))
    args.out.write_text(json.dumps(asdict(result), indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
