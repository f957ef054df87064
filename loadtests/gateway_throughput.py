"""Gateway throughput and added latency with a stub engine, over real loopback HTTP.

The gateway (uvicorn, EngineBackend over a StubEngine in its process) runs in a child process; this process is the
trainer (RolloutClient, msgpack by default). Two measurements, each repeated and reported as the median of the
repeats:

- throughput: the stub engine makes one batch's samples as fast as it can; samples/s = samples / (first request
  byte to last sample decoded by the client). The stub runs inside the gateway's process, so this is a lower bound
  on the gateway alone.
- added latency: the stub engine finishes samples at a fixed rate (--rate samples/s: StubEngineConfig.sample_s)
  and the backend logs the time each sample leaves it for the gateway; the client stamps each sample when it has
  decoded it. Added latency = client stamp - backend emission, per sample (both time.perf_counter, which on Linux
  is CLOCK_MONOTONIC and shared by the two processes); p50 and p99.

With `--progress` the batches ask for the opt-in token progress stream (RolloutRequest.progress): the stub engine
reports each sample's tokens but its last in one piece before the sample, and the client decodes those objects too;
compare samples/s with and without it (the stub reports progress to the gateway in both: engines always do, for
resume and stall detection; what --progress adds is the per-sample progress frames stored and streamed).

With `--traces` the gateway traces every batch (GatewayConfig.otlp_traces_endpoint, service/http/tracing.py) to a
collector stand-in in this process (loadtests/otlp_collector.py), each batch under a traceparent as a trainer's
would be: compare samples/s with and without it. A span the exporter's queue had no room for is dropped, not
waited for; `spans_received` says how many reached the collector.

Goal (issue 5): >= 5,000 samples/s with msgpack and <= 5 ms p99 added per sample.
Run: .venv/bin/python -m loadtests.gateway_throughput [--progress] [--traces]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import secrets
import socket
import statistics
import threading
import time
from collections.abc import AsyncGenerator, Sequence
from multiprocessing.connection import Connection
from typing import Any

from loadtests.child_gateway import SpawnedGateway
from loadtests.otlp_collector import OtlpCollector

GOAL_SAMPLES_PER_S = 5000.0
GOAL_P99_ADDED_MS = 5.0
MAX_TOKENS = 4096  # the batches' max_tokens: above any --tokens, so the stub's output length decides


def _serve(sock: socket.socket, stub: dict[str, Any], traces: str | None, conn: Connection) -> None:
    """Child process: the gateway over a stub engine (StubEngineConfig `stub`) on `sock` until SIGTERM, tracing to
    the collector at `traces` if given; answers "emissions" (returns and clears the backend's emission log) on
    `conn`."""
    import uvicorn

    from das.service.cluster.group_aborts import GroupAborts
    from das.service.cluster.rollout_backend import EngineBackend, ProgressSink
    from das.service.config import GatewayConfig
    from das.service.engine.stub_engine import StubEngine, StubEngineConfig
    from das.service.http.gateway import create_app
    from das.service.wire.api import GroupRequest, SampleResult

    class LoggedBackend(EngineBackend):
        """Logs (group index, sample index, time.perf_counter()) of every sample as it leaves the backend for the
        gateway: where the gateway's added latency starts."""

        def __init__(self, engine: StubEngine) -> None:
            super().__init__(engine)
            self.emissions: list[tuple[int, int, float]] = []

        async def generate(self, groups: Sequence[GroupRequest], on_progress: ProgressSink | None = None,
                           aborts: GroupAborts | None = None) -> AsyncGenerator[tuple[int, SampleResult], None]:
            async with contextlib.aclosing(super().generate(groups, on_progress, aborts)) as samples:
                async for index, sample in samples:
                    self.emissions.append((index, sample.sample_index, time.perf_counter()))
                    yield index, sample

    backend = LoggedBackend(StubEngine(StubEngineConfig(max_model_len=2 * MAX_TOKENS, **stub)))
    settings = GatewayConfig(max_batch_samples=10**6, freeze_gc=True, otlp_traces_endpoint=traces)
    server = uvicorn.Server(uvicorn.Config(create_app(backend, settings), log_level="warning", access_log=False))

    def commands() -> None:
        while True:
            command = conn.recv()
            if command == "emissions":
                log, backend.emissions[:] = list(backend.emissions), []
                conn.send(log)

    threading.Thread(target=commands, daemon=True).start()
    server.run(sockets=[sock])


class StubServer(SpawnedGateway):
    """The gateway in a child process on a free loopback port, its backend's emission log on a pipe."""

    def __init__(self, traces: str | None = None, **stub: Any) -> None:
        self._conn, child = multiprocessing.Pipe()
        super().__init__(_serve, stub, traces, child)

    def emissions(self) -> dict[tuple[int, int], float]:
        """(group, sample) -> perf_counter time the backend emitted it, since the last call."""
        self._conn.send("emissions")
        return {(g, s): t for g, s, t in self._conn.recv()}


def _groups(samples: int, group_size: int) -> list[dict[str, Any]]:
    count = -(-samples // group_size)
    return [{"problem_id": f"p{i}", "prompt_token_ids": [1, 2, 3, 4], "n": min(group_size, samples - i * group_size),
             "sampling": {"max_tokens": MAX_TOKENS}} for i in range(count)]


def _run_batch(url: str, groups: list[dict[str, Any]], wire: str, progress: bool = False, traced: bool = False
               ) -> tuple[float, dict[tuple[int, int], float]]:
    """Seconds from the request to the last sample decoded, and each sample's decode time (perf_counter).
    `traced`: the request carries a fresh W3C traceparent."""
    from das.service.client import RolloutClient
    from das.service.wire.sample_progress import ProgressRecord

    received: dict[tuple[int, int], float] = {}
    with RolloutClient(url, wire=wire, retries=0) as client:  # type: ignore[arg-type]
        if traced:
            client.http.headers["traceparent"] = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
        start = time.perf_counter()
        for record in client.generate(groups, progress=progress):
            if isinstance(record, ProgressRecord):
                continue
            received[(record.group_index, record.sample_index)] = time.perf_counter()
        elapsed = time.perf_counter() - start
    return elapsed, received


def measure(samples: int, group_size: int, tokens: int, rate: float, repeats: int, wire: str,
            progress: bool = False, traces: bool = False) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        collector = stack.enter_context(OtlpCollector()) if traces else None
        result = _measure(samples, group_size, tokens, rate, repeats, wire, progress,
                          collector.url if collector is not None else None)
    result["spans_received"] = len(collector.spans()) if collector is not None else None
    return result


def _measure(samples: int, group_size: int, tokens: int, rate: float, repeats: int, wire: str, progress: bool,
             traces: str | None) -> dict[str, Any]:
    groups = _groups(samples, group_size)
    traced = traces is not None
    throughputs = []
    with StubServer(traces, tokens=tokens) as server:
        _run_batch(server.url, groups[:8], wire, progress, traced)  # warm-up: first-request imports and connections
        server.emissions()
        for _ in range(repeats):
            elapsed, received = _run_batch(server.url, groups, wire, progress, traced)
            assert len(received) == samples and len(server.emissions()) == samples
            throughputs.append(samples / elapsed)

    paced_samples = min(samples, int(rate * 4))  # about 4 s of emission per repeat
    paced_groups = _groups(paced_samples, group_size)
    p50s, p99s, paced_rates = [], [], []
    with StubServer(traces, tokens=tokens, sample_s=1.0 / rate) as server:
        _run_batch(server.url, paced_groups[:8], wire, progress, traced)
        server.emissions()
        for _ in range(repeats):
            elapsed, received = _run_batch(server.url, paced_groups, wire, progress, traced)
            emitted = server.emissions()
            added_ms = sorted((received[k] - emitted[k]) * 1e3 for k in emitted)
            assert len(added_ms) == paced_samples == len(received)
            p50s.append(added_ms[len(added_ms) // 2])
            p99s.append(added_ms[min(len(added_ms) - 1, int(0.99 * len(added_ms)))])
            paced_rates.append(paced_samples / elapsed)

    return {
        "wire": wire, "progress": progress, "traces": traced, "samples": samples, "group_size": group_size,
        "tokens_per_sample": tokens,
        "repeats": repeats, "samples_per_s": round(statistics.median(throughputs)),
        "samples_per_s_runs": [round(x) for x in throughputs],
        "paced_rate": rate, "paced_samples": paced_samples,
        "paced_achieved_samples_per_s": round(statistics.median(paced_rates)),
        "added_ms_p50": round(statistics.median(p50s), 3), "added_ms_p99": round(statistics.median(p99s), 3),
        "added_ms_p99_runs": [round(x, 3) for x in p99s],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=20000, help="samples per batch (throughput)")
    parser.add_argument("--group-size", type=int, default=16, help="samples per group (n)")
    parser.add_argument("--tokens", type=int, default=256, help="output tokens per sample")
    parser.add_argument("--rate", type=float, default=5000.0, help="the stub engine's sample rate for the latency "
                                                                   "runs, samples/s")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--wire", choices=["msgpack", "ndjson"], default="msgpack")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--progress", action="store_true", help="batches ask for the token progress stream")
    parser.add_argument("--traces", action="store_true", help="the gateway traces every batch to a collector "
                                                              "stand-in (OTLP/HTTP), each under a traceparent")
    args = parser.parse_args()
    result = measure(args.samples, args.group_size, args.tokens, args.rate, args.repeats, args.wire, args.progress,
                     args.traces)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    ok_rate = result["samples_per_s"] >= GOAL_SAMPLES_PER_S
    ok_p99 = result["added_ms_p99"] <= GOAL_P99_ADDED_MS
    print(f"wire {result['wire']}{' with progress' if result['progress'] else ''}"
          f"{' traced' if result['traces'] else ''}, "
          f"{result['tokens_per_sample']} tokens/sample, groups of {result['group_size']}, "
          f"median of {result['repeats']} repeats")
    print(f"throughput: {result['samples_per_s']} samples/s over {result['samples']} samples "
          f"(runs {result['samples_per_s_runs']}; goal >= {GOAL_SAMPLES_PER_S:.0f}: {'ok' if ok_rate else 'MISSED'})")
    print(f"added latency at {result['paced_rate']:.0f} samples/s emitted ({result['paced_samples']} samples, "
          f"{result['paced_achieved_samples_per_s']} samples/s received): p50 {result['added_ms_p50']} ms, "
          f"p99 {result['added_ms_p99']} ms (runs {result['added_ms_p99_runs']}; goal <= {GOAL_P99_ADDED_MS} ms: "
          f"{'ok' if ok_p99 else 'MISSED'})")
    if result["traces"]:
        print(f"spans received by the collector: {result['spans_received']} (the rest dropped at the exporter's "
              f"queue)")


if __name__ == "__main__":
    main()
