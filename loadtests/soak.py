"""Many trainers against one gateway, for a fixed time: throughput, latency, errors and a memory trend.

Each trainer is an `AsyncRolloutClient` that submits one batch after another (the same problems every epoch, as
RL revisits them) until the run's time is up or it has run `--max-batches`; every sample must come back exactly
once, from the right group, and every batch must end `done`. Meanwhile the gateway's resident memory is sampled
from its /metrics (`das_memory_resident_bytes`, per component: the gateway, and the history store when the server
has one), or, for a gateway this script started, from /proc/<pid>/status (VmRSS) when /metrics has no figure.

Memory verdict: a least-squares line through each component's samples of the second half of the run (the first
half is warm-up: imports, caches, the gateway's retained ended batches filling up to their bound); the memory is
"flat" when that line grows by less than --flat-mib over the second half.

By default the gateway runs over a stub engine (no model, in its process) in a child process on a free loopback
port, with a random token; --server URL targets a running gateway instead, on loopback only. Progress goes to stderr.

Run:  .venv/bin/python -m loadtests.soak --trainers 10 --duration 120
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import secrets
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from das.service.client import AsyncRolloutClient
from loadtests.child_gateway import SpawnedGateway, vm_rss_bytes


@dataclass(frozen=True)
class SoakConfig:
    """One run. Times in seconds, sizes in samples and tokens."""

    trainers: int = 10
    duration_s: float = 120.0  # trainers start no new batch after this
    max_batches: int = 100_000  # per trainer: the bound on count beside the one on time
    groups: int = 4  # groups per batch
    group_size: int = 8  # samples per group (n)
    tokens: int = 256  # output tokens per sample (the stub's output length and the requests' max_tokens)
    sample_interval_ms: float = 0.0  # stub engine: between two samples it finishes, of all batches (0: at once)
    server: str | None = None  # a running gateway (loopback) instead of the stub child
    token: str | None = None  # the token of --server
    wire: str = "msgpack"
    memory_interval_s: float = 2.0
    progress_interval_s: float = 10.0
    flat_mib: float = 16.0  # the memory verdict's threshold: growth over the second half, MiB
    grace_s: float = 60.0  # how long batches running at the end may take before they count as errors


@dataclass
class MemoryTrend:
    """A component's resident memory over the run, bytes; growth = the fitted line's rise over the second half."""

    source: str
    start_bytes: int
    end_bytes: int
    peak_bytes: int
    samples: int
    second_half_growth_bytes: float | None  # None: too few samples in the second half to fit a line
    flat: bool | None


@dataclass
class SoakResult:
    config: dict[str, Any]
    target: str
    elapsed_s: float
    batches: int
    samples: int
    samples_expected: int
    missing: int
    duplicates: int
    errors: int
    error_examples: list[str]
    samples_per_s: float
    batches_per_s: float
    batch_latency_ms: dict[str, float]
    first_sample_latency_ms: dict[str, float]
    memory: dict[str, MemoryTrend] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """No error, every sample exactly once, and every memory trend that could be judged flat."""
        return (self.errors == 0 and self.missing == 0 and self.duplicates == 0
                and self.samples == self.samples_expected and self.batches > 0
                and all(m.flat is not False for m in self.memory.values()))


def _serve(sock: socket.socket, token: str, tokens: int, interval_s: float) -> None:
    """Child process: the gateway over a stub engine (`tokens` a sample, one sample every `interval_s` seconds) on
    `sock` until SIGTERM (uvicorn stops on it)."""
    import uvicorn

    from das.service.cluster.rollout_backend import EngineBackend
    from das.service.engine.stub_engine import StubEngine, StubEngineConfig
    from das.service.http.gateway import create_app
    from das.service.config import GatewayConfig

    backend = EngineBackend(StubEngine(StubEngineConfig(tokens=tokens, sample_s=interval_s)))
    settings = GatewayConfig(token=token, max_batch_samples=10**6, freeze_gc=True)
    uvicorn.Server(uvicorn.Config(create_app(backend, settings), log_level="warning",
                                  access_log=False)).run(sockets=[sock])


class StubGateway(SpawnedGateway):
    """The gateway with a stub engine in a child process on a free loopback port, with a random token; `pid` for
    its memory."""

    def __init__(self, tokens: int, interval_s: float) -> None:
        self.token = secrets.token_hex(16)
        super().__init__(_serve, self.token, tokens, interval_s)


def require_loopback(url: str) -> None:
    """Load goes to this machine only: refuses a URL whose host is not a loopback address or localhost."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise SystemExit(f"--server {url}: only loopback targets (127.0.0.0/8, ::1, localhost) are allowed")


def resident_from_metrics(text: str) -> dict[str, int]:
    """das_memory_resident_bytes by component (only components that report a figure above 0)."""
    found = {}
    for family in text_string_to_metric_families(text):
        if family.name == "das_memory_resident_bytes":
            for sample in family.samples:
                if sample.value > 0:
                    found[sample.labels["component"]] = int(sample.value)
    return found


def percentiles(values: list[float]) -> dict[str, float]:
    """p50, p90, p99 and max of `values` (nearest rank), rounded to 0.01; empty for no values."""
    if not values:
        return {}
    ordered = sorted(values)

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]

    return {"p50": round(rank(0.5), 2), "p90": round(rank(0.9), 2), "p99": round(rank(0.99), 2),
            "max": round(ordered[-1], 2)}


def memory_trend(points: list[tuple[float, int]], source: str, flat_bytes: float) -> MemoryTrend:
    """The trend of one component's (seconds since start, bytes) samples; see the module docstring."""
    values = [b for _, b in points]
    t_mid = (points[0][0] + points[-1][0]) / 2
    half = [(t, b) for t, b in points if t >= t_mid]
    growth = None
    if len(half) >= 3 and half[-1][0] > half[0][0]:
        slope = statistics.linear_regression([t for t, _ in half], [float(b) for _, b in half]).slope
        growth = slope * (half[-1][0] - half[0][0])
    return MemoryTrend(source=source, start_bytes=values[0], end_bytes=values[-1], peak_bytes=max(values),
                       samples=len(points), second_half_growth_bytes=growth,
                       flat=None if growth is None else growth < flat_bytes)


class _Tally:
    """What the trainers report, shared by the coroutines of one event loop."""

    def __init__(self) -> None:
        self.batches = 0
        self.samples = 0
        self.samples_expected = 0
        self.missing = 0
        self.duplicates = 0
        self.errors: list[str] = []
        self.batch_latency_ms: list[float] = []
        self.first_sample_ms: list[float] = []


async def _trainer(index: int, run_id: str, url: str, token: str | None, config: SoakConfig, stop_at: float,
                   tally: _Tally) -> None:
    groups = [{"problem_id": f"t{index}-p{g}", "n": config.group_size, "prompt_token_ids": [1 + g, 2, 3, 4],
               "sampling": {"max_tokens": config.tokens}} for g in range(config.groups)]
    expected = {(g, s) for g in range(config.groups) for s in range(config.group_size)}
    # retries=0: a transport error or a cut stream must show as an error here, not be healed by a resend.
    async with AsyncRolloutClient(url, token, wire=config.wire, retries=0) as client:  # type: ignore[arg-type]
        for epoch in range(config.max_batches):
            if time.monotonic() >= stop_at:
                return
            start = time.perf_counter()
            first: float | None = None
            seen: set[tuple[int, int]] = set()
            received = 0
            tally.samples_expected += len(expected)
            try:
                stream = client.generate(groups, batch_id=f"soak-{run_id}-t{index}-e{epoch}")
                async for record in stream:
                    if first is None:
                        first = time.perf_counter() - start
                    received += 1
                    seen.add((record.group_index, record.sample_index))
                    if record.problem_id != groups[record.group_index]["problem_id"] or record.error:
                        tally.errors.append(f"trainer {index} epoch {epoch}: wrong or failed sample "
                                            f"{record.problem_id}/{record.sample_index}: {record.error}")
                summary = stream.summary
                if summary is None or summary.status != "done" or summary.samples != len(expected):
                    tally.errors.append(f"trainer {index} epoch {epoch}: batch ended {summary}")
            except Exception as exc:  # every failure of a batch is counted, the trainer goes on
                tally.errors.append(f"trainer {index} epoch {epoch}: {type(exc).__name__}: {exc}")
            tally.batches += 1
            tally.samples += len(seen & expected)
            tally.duplicates += received - len(seen)
            tally.missing += len(expected - seen)
            tally.batch_latency_ms.append((time.perf_counter() - start) * 1e3)
            if first is not None:
                tally.first_sample_ms.append(first * 1e3)


async def _sample_memory(url: str, token: str | None, pid: int | None, interval_s: float, t0: float,
                         out: dict[str, list[tuple[float, int]]], sources: dict[str, str]) -> None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=10) as http:
        while True:
            figures: dict[str, int] = {}
            try:
                response = await http.get("/metrics")
                if response.status_code == 200:
                    figures = resident_from_metrics(response.text)
                    sources.update({c: "das_memory_resident_bytes" for c in figures})
            except httpx.TransportError:
                pass  # the trainers report a gateway that stopped answering; a memory gap is no error
            if "gateway" not in figures and pid is not None:
                rss = vm_rss_bytes(pid)
                if rss is not None:
                    figures["gateway"] = rss
                    sources["gateway"] = f"/proc/{pid}/status VmRSS"
            now = time.monotonic() - t0
            for component, value in figures.items():
                out.setdefault(component, []).append((now, value))
            await asyncio.sleep(interval_s)


async def _progress(tally: _Tally, memory: dict[str, list[tuple[float, int]]], t0: float, duration_s: float,
                    interval_s: float) -> None:
    last_samples, last_t = 0, t0
    while True:
        await asyncio.sleep(interval_s)
        now = time.monotonic()
        rate = (tally.samples - last_samples) / (now - last_t)
        last_samples, last_t = tally.samples, now
        rss = ", ".join(f"{c} {points[-1][1] / 2**20:.1f} MiB" for c, points in sorted(memory.items()))
        print(f"[{now - t0:6.1f} / {duration_s:.0f} s] batches {tally.batches}, samples {tally.samples} "
              f"({rate:,.0f}/s now), errors {len(tally.errors)}; memory: {rss or 'n/a'}", file=sys.stderr,
              flush=True)


async def _run(config: SoakConfig, url: str, token: str | None, pid: int | None) -> SoakResult:
    tally = _Tally()
    memory: dict[str, list[tuple[float, int]]] = {}
    sources: dict[str, str] = {}
    run_id = secrets.token_hex(4)
    t0 = time.monotonic()
    stop_at = t0 + config.duration_s
    helpers = [asyncio.create_task(_sample_memory(url, token, pid, config.memory_interval_s, t0, memory, sources)),
               asyncio.create_task(_progress(tally, memory, t0, config.duration_s, config.progress_interval_s))]
    trainers = [asyncio.create_task(_trainer(i, run_id, url, token, config, stop_at, tally))
                for i in range(config.trainers)]
    done, pending = await asyncio.wait(trainers, timeout=config.duration_s + config.grace_s)
    for task in pending:
        task.cancel()
    if pending:
        tally.errors.append(f"{len(pending)} trainer(s) still running {config.grace_s:.0f} s after the end")
    elapsed = time.monotonic() - t0
    for task in helpers:
        task.cancel()
    await asyncio.gather(*trainers, *helpers, return_exceptions=True)
    return SoakResult(
        config=asdict(config) | {"token": None}, target=url, elapsed_s=round(elapsed, 2), batches=tally.batches,
        samples=tally.samples, samples_expected=tally.samples_expected, missing=tally.missing,
        duplicates=tally.duplicates, errors=len(tally.errors), error_examples=tally.errors[:5],
        samples_per_s=round(tally.samples / elapsed, 1), batches_per_s=round(tally.batches / elapsed, 2),
        batch_latency_ms=percentiles(tally.batch_latency_ms),
        first_sample_latency_ms=percentiles(tally.first_sample_ms),
        memory={c: memory_trend(points, sources[c], config.flat_mib * 2**20)
                for c, points in sorted(memory.items())})


def run(config: SoakConfig) -> SoakResult:
    """One soak run: against `config.server`, or a stub gateway started (and stopped) here."""
    if config.server is not None:
        require_loopback(config.server)
        return asyncio.run(_run(config, config.server.rstrip("/"), config.token, None))
    with StubGateway(config.tokens, config.sample_interval_ms / 1e3) as gateway:
        return asyncio.run(_run(config, gateway.url, gateway.token, gateway.pid))


def report(result: SoakResult) -> str:
    c = result.config
    mib = 2**20
    lines = [
        f"{c['trainers']} trainers for {c['duration_s']:.0f} s against {result.target} "
        f"({'stub engine' if c['server'] is None else 'running server'}; a batch: {c['groups']} groups x "
        f"{c['group_size']} samples x {c['tokens']} tokens, {c['wire']})",
        f"batches {result.batches}, samples {result.samples} of {result.samples_expected} expected "
        f"(missing {result.missing}, duplicates {result.duplicates}), errors {result.errors}",
        f"throughput: {result.samples_per_s:,.1f} samples/s, {result.batches_per_s} batches/s over "
        f"{result.elapsed_s} s",
        f"batch latency ms: {result.batch_latency_ms}",
        f"first sample latency ms: {result.first_sample_latency_ms}",
    ]
    lines += [f"  error: {e}" for e in result.error_examples]
    for component, trend in result.memory.items():
        growth = trend.second_half_growth_bytes
        verdict = ("too short to judge" if growth is None else
                   f"second-half growth {growth / mib:+.2f} MiB: {'flat' if trend.flat else 'GROWING'} "
                   f"(threshold {c['flat_mib']:g} MiB)")
        lines.append(f"memory {component} ({trend.source}, {trend.samples} samples): start "
                     f"{trend.start_bytes / mib:.1f} MiB, end {trend.end_bytes / mib:.1f} MiB, peak "
                     f"{trend.peak_bytes / mib:.1f} MiB; {verdict}")
    if not result.memory:
        lines.append("memory: no figure (the server exports no das_memory_resident_bytes)")
    lines.append(f"verdict: {'PASS' if result.passed else 'FAIL'}")
    return "\n".join(lines)


def main() -> None:
    defaults = SoakConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainers", type=int, default=defaults.trainers, help="concurrent trainers")
    parser.add_argument("--duration", type=float, default=defaults.duration_s,
                        help="seconds during which trainers start batches")
    parser.add_argument("--max-batches", type=int, default=defaults.max_batches, help="batches per trainer, at most")
    parser.add_argument("--groups", type=int, default=defaults.groups, help="groups per batch")
    parser.add_argument("--group-size", type=int, default=defaults.group_size, help="samples per group")
    parser.add_argument("--tokens", type=int, default=defaults.tokens, help="output tokens per sample")
    parser.add_argument("--sample-interval-ms", type=float, default=defaults.sample_interval_ms,
                        help="stub engine: pause between two samples it finishes, over every batch in flight")
    parser.add_argument("--server", help="a running gateway on loopback (default: start a stub gateway)")
    parser.add_argument("--token", help="bearer token of --server")
    parser.add_argument("--wire", choices=["msgpack", "ndjson"], default=defaults.wire)
    parser.add_argument("--memory-interval", type=float, default=defaults.memory_interval_s,
                        help="seconds between memory samples")
    parser.add_argument("--progress-interval", type=float, default=defaults.progress_interval_s,
                        help="seconds between progress lines (stderr)")
    parser.add_argument("--flat-mib", type=float, default=defaults.flat_mib,
                        help="memory is flat when it grows less than this over the second half, MiB")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    config = SoakConfig(trainers=args.trainers, duration_s=args.duration, max_batches=args.max_batches,
                        groups=args.groups, group_size=args.group_size, tokens=args.tokens,
                        sample_interval_ms=args.sample_interval_ms, server=args.server, token=args.token,
                        wire=args.wire, memory_interval_s=args.memory_interval,
                        progress_interval_s=args.progress_interval, flat_mib=args.flat_mib)
    result = run(config)
    print(json.dumps(asdict(result) | {"passed": result.passed}, indent=2) if args.json else report(result))
    sys.exit(0 if result.passed else 1)


if __name__ == "__main__":
    main()
