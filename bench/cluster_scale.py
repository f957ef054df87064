"""`das bench scale`: batches through the real gateway and coordinator over many engines on a multi-node Ray cluster
on this machine, and what the coordinator's process pays for them.

The cluster is Ray's own test cluster (`ray.cluster_utils.Cluster`): a head and `nodes - 1` more nodes, each a raylet
of its own on this machine. The engines are stub engines (model-less), `engines_per_actor` of them hosted in one
NodeEngine actor (`StubEngineConfig.engines_per_actor`) so that 1,024 engines fit in a few dozen processes; the
coordinator still sees and places each as an engine of its own, and runs an actor's engines in one call and one
stream a batch, as it does any actor's. This process is the driver, as `das serve` is: the coordinator (`RayBackend`)
and the gateway (FastAPI under uvicorn, on loopback) on one event loop. The client is another process (the trainer's
`RolloutClient`), so this process's CPU is the gateway's and the coordinator's alone.

Per configuration (engines x samples) one batch of `samples` samples in groups of `group_size` (GRPO's shape),
distinct problems, after a warm-up batch that gives every engine a group: samples/s through the gateway (the client's
wall time, request to last record), this process's CPU seconds (user + system, every thread: the event loop and
Ray's driver threads) per sample and per engine stream item (`BackendStats.engine_stream_items`: a Ray object of up
to 64 finished samples or a progress report, from an actor's stream), placement seconds per batch
(`BackendStats.placement_s`), this process's resident memory after the batch, and each sample's time from leaving its
engine (`SampleResult.finished_unix_s`) to its record reaching the client (one machine, one clock).
"""

from __future__ import annotations

import asyncio
import cProfile
import json
import os
import platform
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

_OBJECT_STORE_BYTES = 96 << 20  # per fake node: Ray's floor is 75 MiB; the stub's samples are small


@dataclass(frozen=True)
class ScaleConfig:
    """What `run_scale_bench` measures. `engines` must each be a multiple of `nodes` (every node runs
    engines / nodes). `token_s`: the stub's seconds per output token, so a group's samples end one after another as
    a real engine's do (16 tokens at 1 ms: a sample every 16 ms per group)."""

    engines: tuple[int, ...] = (8, 64, 256, 1024)
    samples: tuple[int, ...] = (1024, 16384)
    nodes: int = 4
    engines_per_actor: int = 64
    group_size: int = 16
    tokens: int = 16
    token_s: float = 0.001
    history_shards: int = 2
    repeats: int = 1  # batches measured per configuration; every figure reported is their median
    profile_dir: Path | None = None  # one more batch per configuration under cProfile, written here (not measured)

    def check(self) -> None:
        """ValueError for a configuration that cannot run."""
        if not self.engines or not self.samples:
            raise ValueError("give at least one engine count and one sample count")
        if self.nodes < 1 or self.engines_per_actor < 1 or self.group_size < 1 or self.repeats < 1:
            raise ValueError("nodes, engines_per_actor, group_size and repeats must be >= 1")
        for engines in self.engines:
            if engines < self.nodes or engines % self.nodes:
                raise ValueError(f"{engines} engines do not split over {self.nodes} nodes")
        for samples in self.samples:
            if samples < self.group_size or samples % self.group_size:
                raise ValueError(f"{samples} samples are not whole groups of {self.group_size}")


@dataclass(frozen=True)
class ScaleRun:
    """One configuration's figures (CPU and memory: the driver process, where the gateway and coordinator run), each
    the median over `repeats` batches; `coordinator_cpu_s_per_sample_each` the batches' own, in order."""

    engines: int
    samples: int
    actors: int
    wall_s: float
    samples_per_s: float
    coordinator_cpu_s: float
    coordinator_cpu_s_per_sample: float
    event_loop_cpu_s_per_sample: float  # the main thread's share: the event loop (gateway, coordinator, Ray's Python)
    engine_events: int
    coordinator_cpu_s_per_engine_event: float
    placement_s_per_batch: float
    coordinator_rss_mib: float
    engine_to_client_p50_ms: float
    engine_to_client_p99_ms: float
    engine_to_client_max_ms: float
    repeats: int = 1
    coordinator_cpu_s_per_sample_each: tuple[float, ...] = ()

    @classmethod
    def median_of(cls, batches: list[ScaleRun]) -> ScaleRun:
        """One run whose every figure is the median of `batches`' (one configuration's repeats)."""
        measured = [f.name for f in fields(cls) if f.type == "float"]  # the figures; the rest name the run
        return replace(batches[0], **{name: float(np.median([getattr(b, name) for b in batches])) for name in measured},
                       engine_events=int(np.median([b.engine_events for b in batches])), repeats=len(batches),
                       coordinator_cpu_s_per_sample_each=tuple(b.coordinator_cpu_s_per_sample for b in batches))


@dataclass
class ScaleResult:
    config: ScaleConfig
    machine: dict[str, Any]
    runs: list[ScaleRun] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        config = asdict(self.config)
        config["profile_dir"] = str(self.config.profile_dir) if self.config.profile_dir else None
        return {"config": config, "machine": self.machine, "runs": [asdict(r) for r in self.runs],
                "cpu_per_sample_ratio": self.cpu_per_sample_ratio()}

    def cpu_per_sample_ratio(self) -> dict[str, float]:
        """Per sample count (as a string key), the coordinator's CPU per sample at the most engines over that at the
        fewest (medians of the repeats): how its cost grows with the engines. Empty with one engine count."""
        ratios = {}
        for samples in self.config.samples:
            runs = sorted((r for r in self.runs if r.samples == samples), key=lambda r: r.engines)
            if len(runs) > 1 and runs[0].coordinator_cpu_s_per_sample > 0:
                ratios[str(samples)] = runs[-1].coordinator_cpu_s_per_sample / runs[0].coordinator_cpu_s_per_sample
        return ratios

    def print(self, console: Console) -> None:
        table = Table(title=f"Gateway + coordinator over stub engines ({self.config.nodes} Ray nodes, "
                            f"{self.config.engines_per_actor} engines an actor, groups of {self.config.group_size})")
        for column in ("engines", "samples", "samples/s", "CPU us/sample", "loop thread", "CPU us/event", "events",
                       "placement ms/batch", "RSS MiB", "engine->client p50 / p99 ms"):
            table.add_column(column, justify="right")
        for r in self.runs:
            table.add_row(str(r.engines), str(r.samples), f"{r.samples_per_s:,.0f}",
                          f"{r.coordinator_cpu_s_per_sample * 1e6:,.0f}", f"{r.event_loop_cpu_s_per_sample * 1e6:,.0f}",
                          f"{r.coordinator_cpu_s_per_engine_event * 1e6:,.0f}", f"{r.engine_events:,}",
                          f"{r.placement_s_per_batch * 1e3:.1f}", f"{r.coordinator_rss_mib:.0f}",
                          f"{r.engine_to_client_p50_ms:.0f} / {r.engine_to_client_p99_ms:.0f}")
        console.print(table)
        for samples, ratio in self.cpu_per_sample_ratio().items():
            console.print(f"{samples} samples: CPU per sample at {max(self.config.engines)} engines / at "
                          f"{min(self.config.engines)}: {ratio:.2f}x (medians of {self.config.repeats})")
        console.print(f"machine: {self.machine}")


def _say(message: str) -> None:
    print(f"[scale] {message}", file=sys.stderr, flush=True)


def _groups(samples: int, group_size: int, prefix: str, tokens: int) -> list[dict[str, Any]]:
    return [{"problem_id": f"{prefix}-{i}", "n": group_size, "prompt_token_ids": [1 + i % 97, 2, 3, 4],
             "sampling": {"max_tokens": tokens}} for i in range(samples // group_size)]


def _client(url: str) -> None:
    """The trainer, in a process of its own (`python -m das.bench.cluster_scale URL`): runs each batch it reads from
    stdin, a JSON line {"groups": [...], "batch_id": ...}, and answers a JSON line: the wall seconds from the request
    to the last record, and each record's seconds from leaving its engine to arriving here."""
    from das.service.client import RolloutClient
    from das.service.wire.api import SampleRecord

    with RolloutClient(url, retries=0) as client:
        for line in sys.stdin:
            job = json.loads(line)
            delays: list[float] = []
            started = time.perf_counter()
            for record in client.generate(job["groups"], batch_id=job["batch_id"], timings=True):
                if isinstance(record, SampleRecord):
                    if record.finish_reason not in ("stop", "length"):
                        raise RuntimeError(f"sample failed: {record.finish_reason} {record.error}")
                    if record.finished_unix_s is None:  # every sample here left an engine actor
                        raise RuntimeError("a record without finished_unix_s: the gateway dropped timings")
                    delays.append(time.time() - record.finished_unix_s)
            print(json.dumps({"wall_s": time.perf_counter() - started, "delays": delays}), flush=True)


def _thread_cpu(process: Any, thread_id: int) -> float:
    """CPU seconds (user + system) of one thread of `process` (a psutil.Process), 0 if it has none by that id."""
    return next((t.user_time + t.system_time for t in process.threads() if t.id == thread_id), 0.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _measure_engines(config: ScaleConfig, address: str, engines: int, progress: Callable[[str], None]
                           ) -> list[ScaleRun]:
    """Starts the service over `engines` engines on the cluster at `address`, runs every sample count, stops it."""
    import psutil
    import uvicorn

    from das.service.engine.stub_engine import StubEngineConfig
    from das.service.cluster.coordinator import RayBackend
    from das.service.config import ServiceConfig
    from das.service.config import HistoryConfig
    from das.service.http.gateway import create_app
    from das.service.config import GatewayConfig
    from das.service.http.request_guard import server_config

    per_node = engines // config.nodes
    service = ServiceConfig(
        engine=StubEngineConfig(tokens=config.tokens, token_s=config.token_s,
                                     engines_per_actor=config.engines_per_actor),
        address=address, engines_per_node=per_node, history=HistoryConfig(shards=config.history_shards))
    started = time.perf_counter()
    backend = await RayBackend.start(service, progress=lambda m: progress(m[:160]))
    runs: list[ScaleRun] = []
    client: asyncio.subprocess.Process | None = None
    server = None
    serving: asyncio.Task[None] | None = None
    try:
        await backend.wait_ready()
        actors = config.nodes * -(-per_node // config.engines_per_actor)
        progress(f"{engines} engines in {actors} actors ready after {time.perf_counter() - started:.1f} s")
        port = _free_port()
        settings = GatewayConfig(freeze_gc=True)
        app = create_app(backend, settings)
        server = uvicorn.Server(server_config(app, settings.header_timeout_s, host="127.0.0.1", port=port,
                                              log_level="warning"))
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)
        client = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "das.bench.cluster_scale", f"http://127.0.0.1:{port}",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=64 << 20)
        assert client.stdin is not None and client.stdout is not None
        requests, replies = client.stdin, client.stdout

        async def batch(groups: list[dict[str, Any]], batch_id: str) -> tuple[float, list[float]]:
            requests.write(json.dumps({"groups": groups, "batch_id": batch_id}).encode() + b"\n")
            await requests.drain()
            line = await replies.readline()
            if not line:
                raise RuntimeError(f"the client process ended (exit status {await client.wait()})")
            reply = json.loads(line)
            return float(reply["wall_s"]), [float(d) for d in reply["delays"]]

        warm_n = max(1, min(config.group_size, 4096 // engines))
        await batch([{**g, "n": warm_n} for g in _groups(engines * config.group_size, config.group_size, "warm",
                                                          config.tokens)], f"warm-{engines}")
        me = psutil.Process()
        loop_thread = threading.get_native_id()
        for samples in config.samples:
            groups = _groups(samples, config.group_size, "p", config.tokens)
            batches: list[ScaleRun] = []
            for repeat in range(config.repeats):
                before_cpu, before, before_loop = me.cpu_times(), backend.stats(), _thread_cpu(me, loop_thread)
                wall, delays = await batch(groups, f"scale-{engines}-{samples}-{repeat}")
                after_cpu, after, after_loop = me.cpu_times(), backend.stats(), _thread_cpu(me, loop_thread)
                cpu = (after_cpu.user + after_cpu.system) - (before_cpu.user + before_cpu.system)
                events = after.engine_stream_items - before.engine_stream_items
                placements = max(after.placements - before.placements, 1)
                ms = np.array(delays or [0.0]) * 1e3
                batches.append(ScaleRun(
                    engines=engines, samples=samples, actors=actors, wall_s=wall, samples_per_s=samples / wall,
                    coordinator_cpu_s=cpu, coordinator_cpu_s_per_sample=cpu / samples,
                    event_loop_cpu_s_per_sample=(after_loop - before_loop) / samples, engine_events=events,
                    coordinator_cpu_s_per_engine_event=cpu / max(events, 1),
                    placement_s_per_batch=(after.placement_s - before.placement_s) / placements,
                    coordinator_rss_mib=me.memory_info().rss / (1 << 20),
                    engine_to_client_p50_ms=float(np.percentile(ms, 50)),
                    engine_to_client_p99_ms=float(np.percentile(ms, 99)), engine_to_client_max_ms=float(ms.max())))
                if config.repeats > 1:
                    progress(f"{engines} engines x {samples} samples, batch {repeat + 1}/{config.repeats}: "
                             f"{batches[-1].coordinator_cpu_s_per_sample * 1e6:,.0f} us CPU/sample")
            run = ScaleRun.median_of(batches)
            runs.append(run)
            progress(f"{engines} engines x {samples} samples: {run.samples_per_s:,.0f} samples/s, "
                     f"{run.coordinator_cpu_s_per_sample * 1e6:,.0f} us CPU/sample "
                     f"({run.event_loop_cpu_s_per_sample * 1e6:,.0f} on the loop's thread), "
                     f"{run.engine_events:,} engine events, placement {run.placement_s_per_batch * 1e3:.1f} ms, "
                     f"RSS {run.coordinator_rss_mib:.0f} MiB")
            if config.profile_dir is not None:
                config.profile_dir.mkdir(parents=True, exist_ok=True)
                profile = cProfile.Profile()
                profile.enable()
                await batch(groups, f"profile-{engines}-{samples}")
                profile.disable()
                path = config.profile_dir / f"coordinator-{engines}x{samples}.prof"
                profile.dump_stats(path)
                progress(f"profile of the event loop's thread written to {path}")
    finally:
        if client is not None:
            if client.stdin is not None:
                client.stdin.close()
            try:
                await asyncio.wait_for(client.wait(), 30)
            except TimeoutError:
                client.kill()
                await client.wait()
        if server is not None and serving is not None:
            server.should_exit = True
            await serving
        await backend.close()
    return runs


def run_scale_bench(config: ScaleConfig, progress: Callable[[str], None] = _say) -> ScaleResult:
    """Every configuration of `config` on one Ray test cluster of `config.nodes` nodes (shut down at the end)."""
    from ray.cluster_utils import Cluster

    config.check()
    import ray

    result = ScaleResult(config, {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                                  "python": platform.python_version(), "ray": ray.__version__,
                                  "load_average_at_start": list(os.getloadavg())})
    progress(f"starting a Ray cluster of {config.nodes} nodes on this machine")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": _OBJECT_STORE_BYTES,
                                                            "include_dashboard": False})
    try:
        for _ in range(config.nodes - 1):
            cluster.add_node(num_cpus=1, object_store_memory=_OBJECT_STORE_BYTES)
        cluster.wait_for_nodes()
        for engines in config.engines:
            result.runs.extend(asyncio.run(_measure_engines(config, cluster.address, engines, progress)))
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
    return result


if __name__ == "__main__":
    _client(sys.argv[1])
