"""`das serve` as a child process for tests: `Server` (started on a free port, stopped with its process group),
`metric` (one /metrics sample), `free_port`, the token."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import httpx


TOKEN = "serve-test-token"

# The session's shared SmolLM2 server's engine (tests/conftest.py): float32 (what "auto" serves on a CPU without
# native bfloat16, and what the weight pushes send), a context the verifiers agent's multi-turn chats fit in. A
# reference server that must sample what the shared one samples is started with the same flags.
SMOLLM2_SERVE_FLAGS = ("--dtype", "float32", "--max-model-len", "2048")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(text: str, name: str) -> float:
    """Sum of every sample of a counter family in Prometheus text (all label sets)."""
    return sum(float(v) for v in re.findall(rf"^{name}(?:_total)?(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def wait_ready(proc: subprocess.Popen[str], url: str, timeout_s: float, poll_s: float = 1.0) -> None:
    """Returns once `das serve` (`proc`, at `url`) answers /readyz 200; fails with its output if it exits first, or
    after `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else "das serve exited"
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "das serve did not become ready"
        time.sleep(poll_s)


class Server:
    """A `das serve` process (embedded Ray, the tiny model, eager) on a free loopback port; `env`: variables set for
    it beside this process's."""

    def __init__(self, model: Path, state_dir: Path, *flags: str, env: Mapping[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.state_dir = state_dir
        das = Path(sys.executable).with_name("das")
        self.proc = subprocess.Popen(
            [str(das), "serve", "--model", str(model), "--port", str(self.port), "--dtype", "float32",
             "--max-model-len", "256", "--eager", "--state-dir", str(state_dir), *flags],
            env={**os.environ, **(env or {}), "DAS_TOKEN": TOKEN}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True)

    def wait_ready(self) -> None:
        wait_ready(self.proc, self.url, timeout_s=300)

    def stop(self) -> str:
        """SIGINT (what Ctrl-C sends), then the process's output."""
        self.proc.send_signal(signal.SIGINT)
        try:
            out, _ = self.proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        assert self.proc.returncode == 0, out
        return out
