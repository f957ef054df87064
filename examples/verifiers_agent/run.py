"""One command: start `das serve` (SmolLM2, eager) unless `--url` names a running one, run the verifiers
code-repair agent against it, print each trajectory and write the token ids for training to `--out`."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Optional

import httpx
import typer

from examples.verifiers_agent.agent import AgentConfig, run_agent

app = typer.Typer(add_completion=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(model: str, state_dir: Path, ready_timeout_s: float) -> tuple[subprocess.Popen[bytes], str]:
    """`das serve` on a free loopback port, once /readyz answers 200."""
    port = _free_port()
    das = Path(sys.executable).with_name("das")
    state_dir.mkdir(parents=True, exist_ok=True)
    log = (state_dir / "serve.log").open("wb")
    proc = subprocess.Popen([str(das), "serve", "--model", model, "--port", str(port), "--eager", "--max-model-len",
                             "2048", "--state-dir", str(state_dir)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"das serve exited with {proc.returncode}; log: {log.name}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.terminate()
            raise TimeoutError(f"das serve not ready after {ready_timeout_s:.0f} s; log: {log.name}")
        time.sleep(1)


@app.command()
def main(
    url: Annotated[Optional[str], typer.Option(help="A running das serve; default: start one.")] = None,
    model: Annotated[str, typer.Option(help="Model of the server this command starts.")] = "smollm2",
    tasks: Annotated[int, typer.Option(min=1, max=12)] = 2,
    turns: Annotated[int, typer.Option(min=1)] = 3,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1)] = 256,
    seed: Annotated[int, typer.Option()] = 0,
    out: Annotated[Path, typer.Option(help="The trajectories' token ids and rewards, JSON.")] =
        Path("runs/verifiers_agent/rollouts.json"),
    state_dir: Annotated[Path, typer.Option(help="State of the server this command starts.")] =
        Path("runs/verifiers_agent/state"),
) -> None:
    proc = None
    if url is None:
        proc, url = _serve(model, state_dir, ready_timeout_s=600)
    try:
        rollouts = asyncio.run(run_agent(AgentConfig(base_url=url, tasks=tasks, turns=turns, max_tokens=max_tokens,
                                                     seed=seed)))
    finally:
        if proc is not None:
            proc.send_signal(2)
            proc.wait(120)
    for r in rollouts:
        print(f"{r.task}: reward {r.reward:.0f}, {len(r.turns)} turns, "
              f"{sum(len(t.completion_token_ids) for t in r.turns)} completion tokens")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([{"task": r.task, "reward": r.reward, "turns": [asdict(t) for t in r.turns]}
                               for r in rollouts]))
    print(f"token ids for training: {out}")


if __name__ == "__main__":
    app()
