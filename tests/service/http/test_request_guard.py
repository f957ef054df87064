"""The gateway against hostile clients (issue 48), over real loopback sockets with uvicorn serving as `das serve`
does (service/request_guard.server_config): the token is checked before any body byte is read; a stalled body or
a slowloris head is cut off with 408 within its timeout; a client that leaves ends the work it asked for, unless
the work can be attached to again; logprobs over vLLM's bound are refused; the schema's int64 bounds are exact;
405 names every method of a path."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from das.service.cluster.rollout_backend import RolloutBackend
from das.service.http.batch_journal import JournalEntry
from das.service.http.gateway import create_app
from das.service.config import GatewayConfig
from das.service.http.request_guard import parse_json_yielding
from das.service.wire.api import INT64_MAX
from tests.service.live_gateway import LiveServer
from tests.service.stub_backend import stub_backend


# to a tick early (CI measured 0.4998 s from before connect)
LOOP_TICK_S = 0.002
TOKEN = "guard-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class GuardedServer(LiveServer):
    """The gateway served by uvicorn with the header deadline, on a free loopback port, in a daemon thread."""

    def __init__(self, backend: RolloutBackend, **settings: Any) -> None:
        self.settings = GatewayConfig(token=TOKEN, **settings)
        super().__init__(create_app(backend, self.settings), self.settings.header_timeout_s)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)

    def metric(self, name: str, labels: str = "") -> float:
        text = httpx.get(f"{self.url}/metrics", headers=AUTH).text
        return sum(float(value) for found, value in re.findall(rf"^{name}(?:{{([^}}]*)}})? (\S+)$", text, re.M)
                   if labels in found)


@pytest.fixture
def serve() -> Iterator[Any]:
    servers: list[GuardedServer] = []

    def start(backend: RolloutBackend | None = None, **settings: Any) -> GuardedServer:
        server = GuardedServer(backend or stub_backend(), **settings).__enter__()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.__exit__()


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes, bool]:
    """Status, headers, body of one response, and whether the server then closed the connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers.get("content-length", "0")):
        body += sock.recv(65536)
    sock.settimeout(2)
    try:
        closed = sock.recv(1) == b""
    except (TimeoutError, ConnectionResetError):
        closed = False
    return int(lines[0].split()[1]), headers, body, closed


def test_no_token_is_401_from_the_headers_alone_and_the_connection_closes(serve):
    server = serve()
    sock = server.connect()
    # 60 MiB announced, none of it sent: a 401 now proves the body was never needed (nor read)
    sock.sendall(b"POST /v1/history HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 62914560\r\n\r\n")
    start = time.monotonic()
    status, headers, body, closed = read_response(sock)
    assert status == 401 and headers["www-authenticate"] == "Bearer" and headers["connection"] == "close"
    assert json.loads(body)["detail"] == "missing or wrong bearer token"
    assert closed and time.monotonic() - start < 3
    # the same for a wrong token, and on the OpenAI routes in OpenAI's shape
    sock = server.connect()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")
    status, headers, body, closed = read_response(sock)
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key" and closed
    # the probes stay open
    assert httpx.get(f"{server.url}/healthz").status_code == 200


def test_a_declared_body_over_the_limit_is_413_before_it_is_read(serve):
    server = serve(max_body_bytes=4096)
    sock = server.connect()
    sock.sendall(b"POST /v1/rollouts HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() +
                 b"\r\nContent-Length: 5000\r\n\r\n")
    status, headers, body, closed = read_response(sock)
    assert status == 413 and "max_body_bytes" in json.loads(body)["detail"] and closed


@pytest.mark.parametrize("path", ["/v1/rollouts", "/v1/completions"])
def test_a_body_that_never_comes_is_408_within_the_body_timeout(serve, path):
    server = serve(body_timeout_s=0.5)
    sock = server.connect()
    start = time.monotonic()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n".encode())
    status, headers, body, closed = read_response(sock)
    elapsed = time.monotonic() - start
    assert status == 408 and "body_timeout_s" in body.decode() and headers["connection"] == "close" and closed
    assert 0.5 - LOOP_TICK_S <= elapsed < 2.5, elapsed
    assert server.metric("das_request_body_timeouts_total") == 1


def test_a_trickling_chunked_body_is_408_within_the_body_timeout(serve):
    server = serve(body_timeout_s=0.6)
    sock = server.connect()
    start = time.monotonic()
    sock.sendall(f"POST /v1/history HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                 f"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
    sock.settimeout(0.1)
    got = b""
    while not got and time.monotonic() - start < 5:  # one byte every 0.1 s: never idle, never done
        try:
            sock.sendall(b"1\r\n \r\n")
        except OSError:
            break
        try:
            got = sock.recv(65536)
        except TimeoutError:
            pass
    elapsed = time.monotonic() - start
    assert got.startswith(b"HTTP/1.1 408"), got[:100]
    assert elapsed < 2.5, elapsed


def test_a_slowloris_head_is_408_within_the_header_timeout(serve):
    server = serve(header_timeout_s=0.5)
    start = time.monotonic()  # before connect: the header clock starts when the server accepts
    sock = server.connect()
    sock.sendall(b"GET /healthz HTTP/1.1\r\n")
    sock.settimeout(0.15)
    got = b""
    while not got and time.monotonic() - start < 5:  # one header line every 0.15 s
        try:
            sock.sendall(b"X-Slow: 1\r\n")
            got = sock.recv(65536)
        except TimeoutError:
            pass
        except OSError:
            break
    elapsed = time.monotonic() - start
    assert got.startswith(b"HTTP/1.1 408") and b"header_timeout_s" in got, got[:200]
    assert 0.5 - LOOP_TICK_S <= elapsed < 2.5, elapsed
    # a connection that says nothing at all is closed too
    idle = server.connect()
    idle.settimeout(5)
    assert idle.recv(65536).startswith(b"HTTP/1.1 408")


def test_kept_alive_connections_serve_every_request_and_time_out_a_slow_next_head(serve):
    server = serve(header_timeout_s=0.5)
    sock = server.connect()
    for _ in range(3):  # prompt requests on one connection, each well within the deadline, spread past it
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, body, closed = read_response(sock)
        assert status == 200 and json.loads(body) == {"status": "ok"} and not closed
    sock.sendall(b"GET /healthz HTTP/1.1\r\n")  # the next head stalls
    sock.settimeout(5)
    assert sock.recv(65536).startswith(b"HTTP/1.1 408")


def test_a_dropped_non_streaming_completion_is_aborted_within_a_second(serve):
    server = serve(stub_backend(first_sample_s=30), openai_coalesce_s=0)
    before = server.metric("das_batches_in_flight")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=1,
                   json={"model": "das", "prompt": [1, 2], "max_tokens": 600, "ignore_eos": True})
    left = time.monotonic()
    while server.metric("das_batches_in_flight") != before:
        assert time.monotonic() - left < 1.0, "the batch of a dropped request still runs"
        time.sleep(0.02)
    assert server.metric("das_requests_abandoned_total", 'route="/v1/completions"') == 1
    assert server.metric("das_batches_total", 'status="aborted"') == 1


def test_a_dropped_stream_aborts_an_unnamed_batch_but_not_a_named_one(serve):
    server = serve(stub_backend(first_sample_s=30))
    body = {"groups": [{"problem_id": "p", "prompt_token_ids": [1, 2], "n": 2}]}
    with httpx.stream("POST", f"{server.url}/v1/rollouts", headers=AUTH, json=body) as unnamed:
        unnamed_id = unnamed.headers["x-batch-id"]
    with httpx.stream("POST", f"{server.url}/v1/rollouts", headers=AUTH, json={**body, "batch_id": "keep"}):
        pass
    left = time.monotonic()
    while httpx.get(f"{server.url}/v1/rollouts/{unnamed_id}", headers=AUTH).json()["status"] != "aborted":
        assert time.monotonic() - left < 1.0, "the unnamed batch still runs"
        time.sleep(0.02)
    assert httpx.get(f"{server.url}/v1/rollouts/keep", headers=AUTH).json()["status"] == "running"  # re-attachable
    assert server.metric("das_requests_abandoned_total", 'route="/v1/rollouts"') == 1
    assert server.metric("das_batches_in_flight") == 1


def test_logprobs_over_vllms_bound_are_400_naming_it(serve):
    server = serve(stub_backend(tokens=2))
    ask = {"model": "das", "prompt": [1], "max_tokens": 2}
    refused = httpx.post(f"{server.url}/v1/completions", headers=AUTH, json={**ask, "logprobs": 10**9})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "logprobs"
    assert "20" in refused.json()["error"]["message"]
    assert httpx.post(f"{server.url}/v1/completions", headers=AUTH, json={**ask, "logprobs": 20}).status_code == 200


def test_int64_bounds_in_the_schema_are_exact_and_what_the_validators_take(serve):
    server = serve(stub_backend())
    schema = httpx.get(f"{server.url}/openapi.json").text
    assert "e+18" not in schema and str(INT64_MAX) in schema and str(-INT64_MAX - 1) in schema
    bounds = json.loads(schema)["components"]["schemas"]["WeightsRequest"]["properties"]["version"]
    assert bounds["maximum"] == INT64_MAX and type(bounds["maximum"]) is int
    # the largest version the schema allows passes validation (403: no weights root here), one more does not
    at_bound = httpx.post(f"{server.url}/v1/weights", headers=AUTH, json={"path": "x", "version": INT64_MAX})
    assert at_bound.status_code == 403
    over = httpx.post(f"{server.url}/v1/weights", headers=AUTH, json={"path": "x", "version": INT64_MAX + 1})
    assert over.status_code == 422


def test_405_lists_every_method_of_the_path(serve):
    server = serve()
    response = httpx.options(f"{server.url}/v1/rollouts/some-batch", headers=AUTH)
    assert response.status_code == 405
    assert set(response.headers["allow"].split(", ")) == {"GET", "DELETE"}


def test_a_large_history_import_parses_off_the_loop_and_imports(serve):
    server = serve(stub_backend())
    record = {"problem_id": "p", "policy_version": 0, "sample_index": 0, "prompt_token_ids": [1, 2, 3],
              "output_token_ids": list(range(1000))}
    records = [{**record, "sample_index": i} for i in range(400)]  # ~2 MB: above OFFLOOP_JSON_BYTES
    body = json.dumps({"records": records}).encode()
    assert parse_json_yielding(body) == json.loads(body)
    response = httpx.post(f"{server.url}/v1/history", headers={**AUTH, "Content-Type": "application/json"},
                          content=body, timeout=30)
    assert response.status_code == 200 and response.json() == {"added": 400}
    bad = httpx.post(f"{server.url}/v1/history", headers={**AUTH, "Content-Type": "application/json"},
                     content=body[:-1], timeout=30)  # cut short: FastAPI's own 422 for JSON it cannot parse
    assert bad.status_code == 422 and bad.json()["detail"][0]["type"] == "json_invalid"


def test_a_previous_run_refusal_reads_without_a_doubled_word():
    entry = JournalEntry(batch_id="b", digest="d", samples_expected=8, accepted_unix_s=0.0, previous_run=True)
    message = entry.refusal("d").message
    assert "an unknown number of 8 samples" in message and "of of" not in message


def test_a_large_history_import_is_validated_off_the_loop_and_its_errors_do_not_echo_it(serve, monkeypatch):
    """The records' checks of a body over OFFLOOP_JSON_BYTES run in a worker thread, not on the event loop's (a
    small body's stay on it); a bad record is 422 naming it, without the 2 MB of input echoed back."""
    import threading

    from das.service.wire import api

    checked_in: list[str] = []
    real_check = api.wire_problem

    def recording_check(value: Any, where: str = "value") -> str | None:
        checked_in.append(threading.current_thread().name)
        return real_check(value, where)

    monkeypatch.setattr(api, "wire_problem", recording_check)
    server = serve(stub_backend())
    record = {"problem_id": "p", "policy_version": 0, "sample_index": 0, "prompt_token_ids": [1, 2, 3],
              "output_token_ids": list(range(1000))}
    headers = {**AUTH, "Content-Type": "application/json"}
    small = httpx.post(f"{server.url}/v1/history", headers=headers, json={"records": [record]})
    assert small.status_code == 200 and small.json() == {"added": 1}
    loop_thread = checked_in[0]  # the request's checks come first; then the backend's, in a worker thread
    checked_in.clear()
    records = [{**record, "sample_index": i} for i in range(400)]  # ~2 MB
    big = httpx.post(f"{server.url}/v1/history", headers=headers, json={"records": records}, timeout=30)
    assert big.status_code == 200 and big.json() == {"added": 400}
    assert checked_in and loop_thread not in set(checked_in), (loop_thread, set(checked_in))
    records[250]["output_token_ids"] = [*range(7), INT64_MAX + 1]
    bad = httpx.post(f"{server.url}/v1/history", headers=headers, json={"records": records}, timeout=30)
    assert bad.status_code == 422 and len(bad.content) < 1000
    [error] = bad.json()["detail"]
    assert error["loc"] == ["body", "records"] and "record 250.output_token_ids[7]: integer beyond int64" in error["msg"]
    assert "input" not in error
    assert httpx.get(f"{server.url}/metrics", headers=AUTH).text.count("das_history_records_imported_total 401.0") == 1
