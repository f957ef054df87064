"""Running a deployment's shell glue for real, with stand-in programs that log how they were called."""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Call:
    """One run of a stand-in: its name, arguments and the DAS_TOKEN it saw (None when unset)."""

    program: str
    argv: list[str]
    das_token: str | None


def run_with_stubs(script: str, programs: list[str], tmp_path: Path, env: dict[str, str] | None = None,
                   fail: str | None = None, wait_for: int = 0) -> tuple[int, list[Call]]:
    """Runs `script` with `bash -c` and `programs` replaced by stand-ins (first on PATH); the one named `fail`
    exits 1. Returns bash's exit status and the calls in order. `wait_for`: calls to wait for, for scripts that
    start a program in the background and return first (at most 10 s)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "calls.jsonl"
    log.unlink(missing_ok=True)
    for name in programs:
        stub = bin_dir / name
        # The stand-in appends one JSON line: its name, argv and DAS_TOKEN (python for exact argv quoting).
        stub.write_text(
            "#!/usr/bin/env python3\nimport json, os, sys\n"
            f"with open({str(log)!r}, 'a') as f:\n"
            f"    f.write(json.dumps([{name!r}, sys.argv[1:], os.environ.get('DAS_TOKEN')]) + '\\n')\n"
            f"sys.exit({1 if name == fail else 0})\n")
        stub.chmod(0o755)
    full_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path), **(env or {})}
    done = subprocess.run(["/bin/bash", "-c", "--", script], env=full_env, timeout=30, cwd=tmp_path)

    def calls() -> list[Call]:
        if not log.exists():
            return []
        return [Call(p, a, t) for p, a, t in map(json.loads, log.read_text().splitlines())]

    deadline = time.monotonic() + 10
    while len(calls()) < wait_for and time.monotonic() < deadline:
        time.sleep(0.05)
    return done.returncode, calls()
