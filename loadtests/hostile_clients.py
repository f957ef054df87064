"""Hostile clients against the gateway on loopback (issue 48): unauthenticated large bodies, slowloris heads,
stalled bodies and clients that leave, while `/healthz` is polled throughout.

The gateway runs over a stub engine (no model, in its process) in a child process on a free 127.0.0.1 port, served
as `das serve` serves it (service/request_guard.server_config: the header deadline), with a random token. This
process is the attacker; every phase is bounded in time, and nothing leaves the machine.

Phases, one after another, with a `/healthz` poller (its own thread, one kept-alive connection) running through all:

1. **big bodies**: `--big-connections` connections at once, each announcing a `--big-body-mib` MiB body without a
   token and sending `--big-sent-mib` MiB of it (or until the server closes). Per connection: the status, and how
   many bytes the client had sent when the answer came (a 401 before the body was sent is a 401 before it was
   read). The gateway's resident memory (VmRSS) is sampled every 50 ms: growth = peak during the phase - before.
2. **slow senders**: `--slowloris` connections each sending one header line every `--slowloris-interval` s (never
   finishing the head), one connection that sends nothing, and `--stalled-bodies` authenticated requests announcing
   a 1000-byte body and sending none. Per connection: seconds until the server answered 408 or closed.
3. **drops**: `--drops` non-streaming `/v1/completions` whose client gives up after 1 s (the stub's first sample
   comes after 60 s); seconds from the drop until `das_batches_in_flight` is back to where it was, and the
   `das_requests_abandoned_total` count.

4. (with `--import-mib N`, informational) one authenticated history import of about N MiB: its status and
   seconds, and `/healthz` p99 while it ran (its parse and validation run off the event loop).

Verdicts (`passed`): memory growth < 50 MB and every big-body connection answered 401 before it had sent its body;
every slow head and stalled body cut off within its timeout + `--slack` s; every dropped request's batch ended
within 1 s; `/healthz` p99 < 100 ms over the whole run.

Run:  .venv/bin/python -m loadtests.hostile_clients            (--json for one JSON object)
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import select
import socket
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from loadtests.child_gateway import SpawnedGateway

MIB = 1 << 20
HEALTHZ_P99_LIMIT_S = 0.1
MEMORY_GROWTH_LIMIT_BYTES = 50 * 10**6
DROP_LIMIT_S = 1.0


@dataclass(frozen=True)
class HostileConfig:
    big_connections: int = 10
    big_body_mib: int = 60
    big_sent_mib: int = 59
    slowloris: int = 50
    slowloris_interval_s: float = 1.0
    stalled_bodies: int = 10
    drops: int = 5
    header_timeout_s: float = 3.0
    body_timeout_s: float = 3.0
    slack_s: float = 1.0  # scheduling allowance over a timeout on a busy machine
    import_mib: int = 0  # > 0: a last, informational phase: one authenticated history import of about this size
    phase_limit_s: float = 60.0  # no phase runs longer


@dataclass
class BigBody:
    status: int | None
    sent_bytes_at_answer: int | None  # what the client had sent when the answer arrived
    sent_bytes: int  # in all, until the server closed or the client was done
    answer_s: float | None


@dataclass
class HostileResult:
    config: HostileConfig
    big_bodies: list[BigBody] = field(default_factory=list)
    memory_before_bytes: int = 0
    memory_peak_bytes: int = 0
    memory_after_bytes: int = 0
    slow_head_cutoff_s: list[float | None] = field(default_factory=list)  # None: not cut off within the phase
    idle_connection_cutoff_s: float | None = None
    stalled_body_cutoff_s: list[float | None] = field(default_factory=list)
    stalled_body_statuses: list[int | None] = field(default_factory=list)
    drop_end_s: float | None = None  # from the drops until the batches in flight were back
    abandoned: float = 0.0
    healthz_latency_ms: dict[str, float] = field(default_factory=dict)
    healthz_p99_ms_by_phase: dict[str, float] = field(default_factory=dict)
    healthz_failures: int = 0
    import_status: int | None = None
    import_s: float | None = None
    verdicts: dict[str, bool] = field(default_factory=dict)

    @property
    def memory_growth_bytes(self) -> int:
        return self.memory_peak_bytes - self.memory_before_bytes

    @property
    def passed(self) -> bool:
        return all(self.verdicts.values())


def _serve(sock: socket.socket, token: str, header_timeout_s: float, body_timeout_s: float) -> None:
    """Child process: the gateway over a stub engine whose first sample comes after 60 s, until SIGTERM."""
    import uvicorn

    from das.service.cluster.rollout_backend import EngineBackend
    from das.service.engine.stub_engine import StubEngine, StubEngineConfig
    from das.service.http.gateway import create_app
    from das.service.config import GatewayConfig
    from das.service.http.request_guard import server_config

    settings = GatewayConfig(token=token, header_timeout_s=header_timeout_s, body_timeout_s=body_timeout_s,
                               openai_coalesce_s=0, freeze_gc=True)
    backend = EngineBackend(StubEngine(StubEngineConfig(first_sample_s=60.0)))
    config = server_config(create_app(backend, settings), header_timeout_s, log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])


class Gateway(SpawnedGateway):
    """The gateway child process on a free loopback port, with a random token."""

    def __init__(self, config: HostileConfig) -> None:
        self.token = secrets.token_hex(16)
        super().__init__(_serve, self.token, config.header_timeout_s, config.body_timeout_s)

    def metric(self, name: str, labels: str = "") -> float:
        text = httpx.get(f"{self.url}/metrics", headers={"Authorization": f"Bearer {self.token}"}, timeout=10).text
        return sum(float(value) for found, value in re.findall(rf"^{name}(?:{{([^}}]*)}})? (\S+)$", text, re.M)
                   if labels in found)


class Poller(threading.Thread):
    """Polls `/healthz` every `interval_s` on one kept-alive connection; latencies in seconds."""

    def __init__(self, url: str, interval_s: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.url, self.interval_s = url, interval_s
        self.latencies: list[tuple[float, float]] = []  # (time.monotonic() at the poll, seconds it took)
        self.failures = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self.stopping.is_set():
                start = time.perf_counter()
                try:
                    ok = client.get(f"{self.url}/healthz").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.latencies.append((time.monotonic(), time.perf_counter() - start))
                self.failures += not ok
                self.stopping.wait(self.interval_s)


class MemorySampler(threading.Thread):
    def __init__(self, gateway: Gateway) -> None:
        super().__init__(daemon=True)
        self.gateway, self.peak = gateway, 0
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            self.peak = max(self.peak, self.gateway.rss)
            self.stopping.wait(0.05)


def _big_body(port: int, config: HostileConfig) -> BigBody:
    """One connection: headers announcing the body without a token, then as much of the body as the server takes."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/history HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % (config.big_body_mib * MIB))
    sock.setblocking(False)
    chunk = memoryview(b" " * MIB)
    to_send = config.big_sent_mib * MIB
    sent, answer, sent_at_answer, answer_s, sending = 0, b"", None, None, True
    start = time.monotonic()
    deadline = start + config.phase_limit_s
    try:
        while time.monotonic() < deadline:
            writable = [sock] if sending and sent < to_send else []
            readable, ready, _ = select.select([sock], writable, [], 0.5)
            if readable:
                try:
                    data = sock.recv(65536)
                except ConnectionResetError:
                    data = b""
                if data and sent_at_answer is None:
                    sent_at_answer, answer_s = sent, time.monotonic() - start
                answer += data
                if not data:  # closed by the server
                    break
            if ready:
                try:
                    sent += sock.send(chunk[:min(MIB, to_send - sent)])
                except (BrokenPipeError, ConnectionResetError):
                    sending = False
            if not sending and sent_at_answer is not None:
                break
    finally:
        sock.close()
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else None
    return BigBody(status=status, sent_bytes_at_answer=sent_at_answer, sent_bytes=sent, answer_s=answer_s)


def _cut_off(sock: socket.socket, start: float, limit_s: float, trickle: bytes | None = None,
             interval_s: float = 1.0) -> tuple[float | None, int | None]:
    """Seconds from `start` until the server answered or closed `sock` (None: not within `limit_s`), and the
    status it answered; `trickle` is sent every `interval_s` meanwhile."""
    sock.setblocking(False)
    next_send = time.monotonic() + interval_s
    try:
        while time.monotonic() - start < limit_s:
            readable, _, _ = select.select([sock], [], [], 0.05)
            if readable:
                try:
                    data = sock.recv(65536)
                except ConnectionResetError:
                    data = b""
                status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else None
                return time.monotonic() - start, status
            if trickle is not None and time.monotonic() >= next_send:
                try:
                    sock.send(trickle)
                except OSError:
                    return time.monotonic() - start, None
                next_send += interval_s
        return None, None
    finally:
        sock.close()


def _history_body(size: int) -> bytes:
    """A history import of about `size` bytes: records of 100 prompt and 1000 output tokens."""
    record = {"problem_id": "p", "policy_version": 0, "sample_index": 0, "prompt_token_ids": list(range(100)),
              "output_token_ids": list(range(1000, 2000))}
    one = len(json.dumps(record))
    return json.dumps({"records": [{**record, "sample_index": i} for i in range(max(1, size // one))]}).encode()


def _p99(latencies: list[float]) -> float | None:
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else None


def _in_threads(jobs: list[Any]) -> list[Any]:
    results: list[Any] = [None] * len(jobs)

    def run(i: int) -> None:
        results[i] = jobs[i]()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def run(config: HostileConfig) -> HostileResult:
    result = HostileResult(config=config)
    with Gateway(config) as gateway:
        poller = Poller(gateway.url)
        poller.start()
        phases = {"idle": time.monotonic()}
        time.sleep(0.5)  # a few polls before the attack: the baseline

        # 1. big bodies
        phases["big_bodies"] = time.monotonic()
        result.memory_before_bytes = gateway.rss
        memory = MemorySampler(gateway)
        memory.start()
        result.big_bodies = _in_threads([lambda: _big_body(gateway.port, config)] * config.big_connections)
        time.sleep(0.5)
        memory.stopping.set()
        memory.join()
        result.memory_peak_bytes = max(memory.peak, result.memory_before_bytes)
        result.memory_after_bytes = gateway.rss

        # 2. slow senders
        phases["slow_senders"] = time.monotonic()
        limit = max(config.header_timeout_s, config.body_timeout_s) + config.slack_s + 5
        auth = f"Authorization: Bearer {gateway.token}\r\n".encode()

        def slow_head() -> float | None:
            sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=10)
            start = time.monotonic()
            sock.sendall(b"GET /healthz HTTP/1.1\r\n")
            return _cut_off(sock, start, limit, b"X-Slow: 1\r\n", config.slowloris_interval_s)[0]

        def idle() -> float | None:
            sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=10)
            return _cut_off(sock, time.monotonic(), limit)[0]

        def stalled_body() -> tuple[float | None, int | None]:
            sock = socket.create_connection(("127.0.0.1", gateway.port), timeout=10)
            start = time.monotonic()
            sock.sendall(b"POST /v1/rollouts HTTP/1.1\r\nHost: 127.0.0.1\r\n" + auth +
                         b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
            return _cut_off(sock, start, limit)

        slow = _in_threads([slow_head] * config.slowloris + [idle] + [stalled_body] * config.stalled_bodies)
        result.slow_head_cutoff_s = slow[:config.slowloris]
        result.idle_connection_cutoff_s = slow[config.slowloris]
        result.stalled_body_cutoff_s = [s for s, _ in slow[config.slowloris + 1:]]
        result.stalled_body_statuses = [status for _, status in slow[config.slowloris + 1:]]

        # 3. drops
        phases["drops"] = time.monotonic()
        in_flight = gateway.metric("das_batches_in_flight")

        def drop() -> None:
            try:
                httpx.post(f"{gateway.url}/v1/completions", timeout=1.0,
                           headers={"Authorization": f"Bearer {gateway.token}"},
                           json={"model": "das", "prompt": [1, 2, 3], "max_tokens": 600, "ignore_eos": True})
            except httpx.TimeoutException:
                pass

        _in_threads([drop] * config.drops)
        dropped = time.monotonic()
        while time.monotonic() - dropped < config.phase_limit_s:
            if gateway.metric("das_batches_in_flight") <= in_flight:
                result.drop_end_s = time.monotonic() - dropped
                break
            time.sleep(0.02)
        result.abandoned = gateway.metric("das_requests_abandoned_total", 'route="/v1/completions"')

        # 4. (informational) one large authenticated import: how long /healthz waits behind its parse and checks
        if config.import_mib > 0:
            phases["import"] = time.monotonic()
            body = _history_body(config.import_mib * MIB)
            start = time.monotonic()
            response = httpx.post(f"{gateway.url}/v1/history", content=body, timeout=config.phase_limit_s,
                                  headers={"Authorization": f"Bearer {gateway.token}",
                                           "Content-Type": "application/json"})
            result.import_status, result.import_s = response.status_code, time.monotonic() - start
            time.sleep(0.2)

        poller.stopping.set()
        poller.join()
    # The verdict covers the attack phases; the informational import phase is reported on its own.
    latencies = [seconds for at, seconds in poller.latencies if at < phases.get("import", float("inf"))]
    result.healthz_failures = poller.failures
    result.healthz_latency_ms = {"p50": 1000 * statistics.median(latencies), "p99": 1000 * (_p99(latencies) or 0),
                                 "max": 1000 * max(latencies), "polls": float(len(latencies))}
    bounds = [*phases.items(), ("end", float("inf"))]
    for i, (name, start) in enumerate(bounds[:-1]):
        p99 = _p99([seconds for at, seconds in poller.latencies if start <= at < bounds[i + 1][1]])
        if p99 is not None:
            result.healthz_p99_ms_by_phase[name] = 1000 * p99
    header_limit = config.header_timeout_s + config.slack_s
    body_limit = config.body_timeout_s + config.slack_s
    result.verdicts = {
        "memory_growth_under_50MB": result.memory_growth_bytes < MEMORY_GROWTH_LIMIT_BYTES,
        "every_big_body_401_before_it_was_sent": all(
            b.status == 401 and b.sent_bytes_at_answer is not None and b.sent_bytes_at_answer < config.big_sent_mib
            * MIB for b in result.big_bodies),
        "slow_heads_cut_off_in_time": all(s is not None and s <= header_limit
                                          for s in [*result.slow_head_cutoff_s, result.idle_connection_cutoff_s]),
        "stalled_bodies_408_in_time": all(s is not None and s <= body_limit for s in result.stalled_body_cutoff_s)
        and all(status == 408 for status in result.stalled_body_statuses),
        "drops_aborted_within_1s": result.drop_end_s is not None and result.drop_end_s <= DROP_LIMIT_S
        and result.abandoned == config.drops,
        "healthz_p99_under_100ms": result.healthz_latency_ms["p99"] < 1000 * HEALTHZ_P99_LIMIT_S
        and result.healthz_failures == 0,
    }
    return result


def summary(result: HostileResult) -> dict[str, Any]:
    """The figures, as one JSON-able object."""
    big = result.big_bodies
    cutoffs = [s for s in result.slow_head_cutoff_s if s is not None]
    return {
        "config": asdict(result.config),
        "big_bodies": {"statuses": [b.status for b in big],
                       "sent_mib_at_answer_max": max((b.sent_bytes_at_answer or 0) / MIB for b in big) if big else None,
                       "sent_mib_max": max(b.sent_bytes / MIB for b in big) if big else None,
                       "answer_s_max": max((b.answer_s or 0) for b in big) if big else None},
        "memory_mb": {"before": result.memory_before_bytes / 1e6, "peak": result.memory_peak_bytes / 1e6,
                      "after": result.memory_after_bytes / 1e6, "growth": result.memory_growth_bytes / 1e6},
        "slow_heads": {"count": len(result.slow_head_cutoff_s), "cut_off": len(cutoffs),
                       "cutoff_s_max": max(cutoffs) if cutoffs else None,
                       "idle_connection_cutoff_s": result.idle_connection_cutoff_s},
        "stalled_bodies": {"statuses": result.stalled_body_statuses,
                           "cutoff_s_max": max((s for s in result.stalled_body_cutoff_s if s is not None),
                                               default=None)},
        "drops": {"count": result.config.drops, "abandoned_metric": result.abandoned,
                  "batches_back_s": result.drop_end_s},
        "healthz_ms": result.healthz_latency_ms, "healthz_p99_ms_by_phase": result.healthz_p99_ms_by_phase,
        "healthz_failures": result.healthz_failures,
        "import": {"mib": result.config.import_mib, "status": result.import_status, "seconds": result.import_s,
                   "healthz_p99_ms": result.healthz_p99_ms_by_phase.get("import")},
        "verdicts": result.verdicts, "passed": result.passed,
    }


def main() -> None:
    defaults = HostileConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--big-connections", type=int, default=defaults.big_connections)
    parser.add_argument("--big-body-mib", type=int, default=defaults.big_body_mib, help="announced body size")
    parser.add_argument("--big-sent-mib", type=int, default=defaults.big_sent_mib, help="of it, sent at most")
    parser.add_argument("--slowloris", type=int, default=defaults.slowloris, help="connections trickling a head")
    parser.add_argument("--slowloris-interval", type=float, default=defaults.slowloris_interval_s,
                        help="seconds between their header lines")
    parser.add_argument("--stalled-bodies", type=int, default=defaults.stalled_bodies)
    parser.add_argument("--drops", type=int, default=defaults.drops, help="dropped non-streaming completions")
    parser.add_argument("--header-timeout", type=float, default=defaults.header_timeout_s)
    parser.add_argument("--body-timeout", type=float, default=defaults.body_timeout_s)
    parser.add_argument("--slack", type=float, default=defaults.slack_s)
    parser.add_argument("--import-mib", type=int, default=defaults.import_mib,
                        help="then one authenticated history import of this size (informational, no verdict)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    config = HostileConfig(big_connections=args.big_connections, big_body_mib=args.big_body_mib,
                           big_sent_mib=args.big_sent_mib, slowloris=args.slowloris,
                           slowloris_interval_s=args.slowloris_interval, stalled_bodies=args.stalled_bodies,
                           drops=args.drops, header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                           slack_s=args.slack, import_mib=args.import_mib)
    figures = summary(run(config))
    print(json.dumps(figures, indent=None if args.json else 2))
    sys.exit(0 if figures["passed"] else 1)


if __name__ == "__main__":
    main()
