"""`StubService`: the Ray service over stub engines and its gateway in a child process on loopback, for tests that
kill engines (`process_pids` finds their processes; `wait_until` polls)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

from das.service.engine.stub_engine import StubEngineConfig
from tests.service.serve_process import free_port, metric


SERVE = """
import asyncio, signal, sys
import uvicorn
from das.service.cluster.coordinator import RayBackend
from das.service.config import GatewayConfig
from das.service.config import ServiceConfig
from das.service.http.gateway import create_app

async def main() -> None:
    backend = await RayBackend.start(ServiceConfig.model_validate_json(sys.argv[1]))
    try:
        app = create_app(backend, GatewayConfig(batch_stall_timeout_s=120))
        # uvicorn raises the signal that stopped it again once it is done: without this, that would interrupt the
        # backend's close.
        signal.signal(signal.SIGINT, lambda *args: None)
        await uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=int(sys.argv[2]),
                                            log_level="warning")).serve()
    finally:
        await backend.close()

asyncio.run(main())
"""


def wait_until(condition: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


class StubService:
    """RayBackend and the gateway (service/cluster/coordinator.py, service/http/gateway.py) in a child process on
    loopback, with the given ServiceConfig."""

    def __init__(self, tmp_path: Path, config: dict[str, Any]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / "service.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen([sys.executable, "-c", SERVE, json.dumps(config), str(self.port)],
                                         stdout=out, stderr=subprocess.STDOUT)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", timeout=10)

    def metric(self, name: str) -> float:
        return metric(self.get("/metrics").text, name)

    def wait_ready(self, engines: int) -> None:
        def up() -> bool:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                return self.get("/readyz").status_code == 200 and self.metric("das_engines_ready") == engines
            except httpx.TransportError:
                return False
        wait_until(up, 120, "the service did not become ready")

    def node_engines(self) -> list[int]:
        return process_pids(self.proc.pid, "ray::NodeEngine")

    def stop(self) -> None:
        """SIGINT; the service closes cleanly (exit status 0)."""
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        assert self.proc.returncode == 0, self.log.read_text()[-3000:]


STUB_VOCAB = StubEngineConfig().vocab_size


def process_pids(root: int, title: str) -> list[int]:
    """Processes under `root` whose title (what Ray and vLLM set: ray::NodeEngine, VLLM::EngineCore) has
    `title`."""
    found = []
    for proc in psutil.Process(root).children(recursive=True):
        try:
            if title in " ".join(proc.cmdline()) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found
