"""A large history import into a real `das serve`, and a second `das serve` on the same state directory (issue 49).

The server is `das serve --stub-engine --state-dir D --max-body-bytes B` (embedded Ray: the gateway, the coordinator,
the history shards; engines with no model) in a child process on a free loopback port, with a random token. This
process is the trainer: `RolloutClient.add_history` imports about `--mb` MB of JSON history records, which the client
cuts into requests under the body limit (its `max_body_bytes` set to the server's B), while a thread polls
`/healthz` every 20 ms on its own connection. Then:

- a request announcing one byte over the limit is answered 413 (the limit the client split under is in force);
- what was stored is read back through the API: `GET /v1/history/{problem}` for every problem (rollouts and output
  tokens each must be exactly what was sent: a request imported twice shows as too many) and the gateway's
  `das_history_records_imported` counter;
- a second `das serve` on the same state directory: it must exit non-zero, saying the directory is in use; the first
  must still answer `/healthz`.

Figures (JSON on stdout): records, MB of JSON, requests (POST /v1/history counted at the client's transport),
seconds, records stored, `/healthz` latency during the import (p50, p99, max, polls), the second server's exit code
and message; `passed` and the verdicts. Exit status 1 if a verdict fails.

Run (it starts a Ray cluster: one such job at a time on a shared machine):
    flock /tmp/das-heavy.lock .venv/bin/python -m loadtests.history_import --mb 100
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from das.service.client import RolloutClient
from loadtests.child_gateway import ServeProcess, das_command, free_port
from loadtests.hostile_clients import Poller
from loadtests.soak import percentiles


@dataclass(frozen=True)
class ImportConfig:
    """One run. Sizes in MB (10**6 bytes) of JSON and tokens; times in seconds."""

    megabytes: float = 100.0  # JSON size of the whole import
    tokens: int = 2048  # output tokens per record
    per_problem: int = 16  # records per problem (the store keeps 64 per problem, so all of them stay)
    max_body_bytes: int = 64 << 20  # the server's --max-body-bytes, and the client's limit
    healthz_bound_ms: float = 500.0  # the verdict: no /healthz poll during the import took longer
    ready_timeout_s: float = 180.0
    refusal_timeout_s: float = 120.0  # how long the second das serve may take to refuse


@dataclass
class ImportResult:
    config: ImportConfig
    records: int = 0
    json_mb: float = 0.0
    requests: int = 0  # POST /v1/history requests the client sent
    seconds: float = 0.0
    added: int = 0  # what the server answered, summed over the requests
    read_back_rollouts: int = 0  # summed over GET /v1/history/{problem}
    read_back_tokens: int = 0
    problems_wrong: list[str] = field(default_factory=list)  # problems whose rollouts or tokens differ from sent
    imported_metric: float = 0.0  # das_history_records_imported
    over_limit_status: int | None = None  # the answer to a request announcing max_body_bytes + 1 bytes
    healthz_ms: dict[str, float] = field(default_factory=dict)
    healthz_failures: int = 0
    second_exit_code: int | None = None
    second_message: str = ""
    first_alive_after: bool = False
    first_exit_code: int | None = None
    verdicts: dict[str, bool] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.verdicts) and all(self.verdicts.values())


def history_records(megabytes: float, tokens: int, per_problem: int) -> list[dict[str, Any]]:
    """History records of `tokens` output tokens each, about `megabytes` MB of JSON in all, `per_problem` a problem
    (problem ids p0, p1, ...; sample_index 0.. within each)."""
    one = {"problem_id": "p0", "policy_version": 0, "sample_index": 0, "prompt_token_ids": [1, 2, 3, 4],
           "output_token_ids": [(7 * t) % 30000 for t in range(tokens)], "finish_reason": "stop"}
    count = max(1, round(megabytes * 1e6 / len(json.dumps(one, separators=(",", ":")))))
    return [{**one, "problem_id": f"p{i // per_problem}", "sample_index": i % per_problem} for i in range(count)]


class CountingTransport(httpx.HTTPTransport):
    """httpx's transport, counting the POST /v1/history requests that go through it (retries included)."""

    def __init__(self) -> None:
        super().__init__()
        self.history_posts = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.path == "/v1/history":
            self.history_posts += 1
        return super().handle_request(request)


def _metric(url: str, token: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith((f"{name} ", f"{name}{{", f"{name}_total ", f"{name}_total{{")))


def over_limit_status(port: int, token: str, max_body_bytes: int) -> int | None:
    """The status the server answers to a history import announcing `max_body_bytes + 1` bytes (its headers only:
    the limit is checked before a body is read); None if it closed without an answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /v1/history HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer %s\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (token.encode(),
                                                                                        max_body_bytes + 1))
        answer = sock.recv(65536)
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else None


def second_server(state_dir: Path, timeout_s: float) -> tuple[int | None, str]:
    """`das serve` on `state_dir`, which another one holds: its exit code (None: still running after `timeout_s`,
    then killed) and what it printed, whitespace collapsed."""
    command = [str(das_command()), "serve", "--stub-engine", "--port", str(free_port()), "--state-dir",
               str(state_dir)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "COLUMNS": "300"})
    except subprocess.TimeoutExpired as exc:
        said = (exc.stdout or b"") + (exc.stderr or b"")
        return None, " ".join((said.decode() if isinstance(said, bytes) else said).split())
    return done.returncode, " ".join((done.stdout + done.stderr).split())


def run(config: ImportConfig, state_dir: Path | None = None) -> ImportResult:
    """The import and the second server; `state_dir` default: a temporary directory, removed afterwards."""
    if state_dir is None:
        with tempfile.TemporaryDirectory(prefix="das-history-import-") as temporary:
            return run(config, Path(temporary))
    result = ImportResult(config=config)
    records = history_records(config.megabytes, config.tokens, config.per_problem)
    result.records = len(records)
    result.json_mb = round(sum(len(json.dumps(r, separators=(",", ":"))) for r in records) / 1e6, 1)
    expected: dict[str, tuple[int, int]] = {}
    for record in records:
        count, tokens = expected.get(record["problem_id"], (0, 0))
        expected[record["problem_id"]] = (count + 1, tokens + len(record["output_token_ids"]))

    server = ServeProcess("--stub-engine", "--state-dir", str(state_dir), "--max-body-bytes",
                          str(config.max_body_bytes), ready_timeout_s=config.ready_timeout_s)
    with server:
        transport = CountingTransport()
        with RolloutClient(server.url, server.token, timeout=600, retries=0, transport=transport) as client:
            client.max_body_bytes = config.max_body_bytes
            poller = Poller(server.url)
            poller.start()
            time.sleep(0.2)
            start = time.monotonic()
            result.added = client.add_history(records)
            end = time.monotonic()
            poller.stopping.set()
            poller.join()
            result.seconds = round(end - start, 2)
            result.requests = transport.history_posts
            during = [1000 * seconds for at, seconds in poller.latencies if start <= at <= end]
            result.healthz_ms = {**percentiles(during), "polls": len(during)}
            result.healthz_failures = poller.failures

            for problem, (count, tokens) in expected.items():
                summary = client.history(problem)
                result.read_back_rollouts += summary.rollouts
                result.read_back_tokens += summary.output_tokens
                if (summary.rollouts, summary.output_tokens) != (count, tokens):
                    result.problems_wrong.append(problem)
        result.imported_metric = _metric(server.url, server.token, "das_history_records_imported")
        result.over_limit_status = over_limit_status(server.port, server.token, config.max_body_bytes)

        result.second_exit_code, result.second_message = second_server(state_dir, config.refusal_timeout_s)
        try:
            result.first_alive_after = httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200
        except httpx.HTTPError:
            result.first_alive_after = False
    result.first_exit_code = server.returncode

    total_tokens = sum(tokens for _, tokens in expected.values())
    result.verdicts = {
        "split_into_several_requests": result.requests > 1 and result.over_limit_status == 413,
        "every_record_stored_once": result.added == result.records == result.read_back_rollouts
        == int(result.imported_metric) and result.read_back_tokens == total_tokens and not result.problems_wrong,
        "healthz_never_stalled": result.healthz_failures == 0 and bool(during)
        and max(during) <= config.healthz_bound_ms,
        "second_server_refused": result.second_exit_code not in (None, 0)
        and f"--state-dir {state_dir} is in use by another das serve" in result.second_message,
        "first_server_unharmed": result.first_alive_after and result.first_exit_code == 0,
    }
    return result


def summary(result: ImportResult) -> dict[str, Any]:
    """The figures, as one JSON-able object."""
    figures = asdict(result)
    figures["problems_wrong"] = result.problems_wrong[:10]
    figures["passed"] = result.passed
    return figures


def main() -> None:
    defaults = ImportConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=defaults.megabytes, help="size of the import, MB of JSON")
    parser.add_argument("--tokens", type=int, default=defaults.tokens, help="output tokens per record")
    parser.add_argument("--per-problem", type=int, default=defaults.per_problem, help="records per problem (<= 64)")
    parser.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes,
                        help="the server's body limit, which the client splits under")
    parser.add_argument("--healthz-bound-ms", type=float, default=defaults.healthz_bound_ms,
                        help="the verdict's bound on every /healthz poll during the import")
    parser.add_argument("--state-dir", type=Path, default=None, help="default: a temporary directory")
    args = parser.parse_args()
    config = ImportConfig(megabytes=args.mb, tokens=args.tokens, per_problem=args.per_problem,
                          max_body_bytes=args.max_body_bytes, healthz_bound_ms=args.healthz_bound_ms)
    figures = summary(run(config, args.state_dir))
    print(json.dumps(figures))
    sys.exit(0 if figures["passed"] else 1)


if __name__ == "__main__":
    main()
