"""The server under load, in a child process of the load test: its start (on a free loopback port, ready once
`/readyz` answers 200), its resident memory, and its stop, for every script in loadtests/.

- `SpawnedGateway`: a function of the load test's own (uvicorn serving the gateway over a stub engine) in a
  spawned process, handed the listening socket; stopped with SIGTERM (uvicorn's graceful stop).
- `ServeProcess`: the `das serve` command itself (embedded Ray, the gateway, the history shards), with a random
  token in $DAS_TOKEN; stopped with SIGINT (what Ctrl-C sends: it snapshots the history, then stops).

Run the scripts as modules from the repository root (`python -m loadtests.soak`), so that they import this one.
"""

from __future__ import annotations

import multiprocessing
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import httpx


def vm_rss_bytes(pid: int) -> int | None:
    """Resident memory of process `pid` from /proc (Linux), None when it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server that binds its own socket)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, alive: Callable[[], bool], timeout_s: float) -> None:
    """Returns once `url`/readyz answers 200; RuntimeError when the process died first or `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if not alive():
            raise RuntimeError("the server's child process exited before it was ready")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server was not ready within {timeout_s:g} s")
        time.sleep(0.1)


class SpawnedGateway:
    """`serve(sock, *args)` in a spawned child process, `sock` bound to a free 127.0.0.1 port (`url`); `serve`
    must be a module-level function that serves on the socket until SIGTERM."""

    def __init__(self, serve: Callable[..., None], *args: Any, ready_timeout_s: float = 60.0) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))
        self.port = int(self._socket.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._ready_timeout_s = ready_timeout_s
        self._process = multiprocessing.get_context("spawn").Process(target=serve, args=(self._socket, *args),
                                                                      daemon=True)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def rss(self) -> int:
        """The child's resident memory, bytes (0 when it cannot be read)."""
        return (vm_rss_bytes(self._process.pid) or 0) if self._process.pid else 0

    def __enter__(self) -> SpawnedGateway:
        self._process.start()
        try:
            wait_ready(self.url, self._process.is_alive, self._ready_timeout_s)
        except RuntimeError:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._process.terminate()
        self._process.join(timeout=15)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._socket.close()


class ServeProcess:
    """`das serve --port P *args` (the `das` script beside this Python) on a free port, its output in a temporary
    file (`output()`); `token` is its bearer token. `returncode` once it has stopped."""

    def __init__(self, *args: str, ready_timeout_s: float = 180.0, stop_timeout_s: float = 90.0) -> None:
        self.token = secrets.token_hex(16)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [str(das_command()), "serve", "--port", str(self.port), *args]
        self._ready_timeout_s = ready_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._log: IO[str] = tempfile.TemporaryFile("w+")
        self._process: subprocess.Popen[str] | None = None
        self.returncode: int | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def output(self) -> str:
        """What the process has written to stdout and stderr so far."""
        self._log.flush()
        self._log.seek(0)
        return self._log.read()

    def __enter__(self) -> ServeProcess:
        self._process = subprocess.Popen(self.command, env={**os.environ, "DAS_TOKEN": self.token, "COLUMNS": "300"},
                                         stdout=self._log, stderr=subprocess.STDOUT, text=True)
        process = self._process
        try:
            wait_ready(self.url, lambda: process.poll() is None, self._ready_timeout_s)
        except RuntimeError as exc:
            self.__exit__()
            raise RuntimeError(f"{exc}; das serve said:\n{self.output()[-4000:]}") from None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGINT)
            try:
                self._process.wait(timeout=self._stop_timeout_s)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self.returncode = self._process.returncode


def das_command() -> Path:
    """The `das` console script of this Python's environment."""
    return Path(sys.executable).with_name("das")
