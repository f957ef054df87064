"""The gateway served for tests: `LiveServer` (uvicorn on loopback in a thread), its settings, request and
response helpers and the token."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import httpx
import uvicorn

from das.service.config import GatewayConfig
from das.service.http.request_guard import server_config


TOKEN = "s3cret-token"


class LiveServer:
    """uvicorn serving `app` on a free loopback port in a daemon thread; `url` once started. With
    `header_timeout_s`, served as `das serve` serves it (request_guard.server_config: the header deadline)."""

    def __init__(self, app: Any, header_timeout_s: float | None = None) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = (uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1) if header_timeout_s is None
                  else server_config(app, header_timeout_s, log_level="warning", timeout_graceful_shutdown=1))
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()


def gateway_settings(**settings: Any) -> GatewayConfig:
    # No gc.freeze in a shared pytest process: it would pin whatever other tests hold at that moment.
    return GatewayConfig(**settings)


def groups(count: int = 3, n: int = 4, **extra: Any) -> list[dict[str, Any]]:
    return [{"problem_id": f"p{i}", "prompt_token_ids": [1, 2, 3], "n": n, **extra} for i in range(count)]


def read_ndjson(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line) for line in response.iter_lines() if line]
