"""vLLM's weight transfer through `das serve --engines-per-node 2 --weight-transfer gloo` with real processes, on the
tiny model (docs/design.md "Weight transfer: weights without the disk"): one server for the module (a start costs
~30-45 s here), its tests in order, each leaving both engines serving.

The server is started on the checkpoint the tests push (`served`): its first batch is what "a server started on the
pushed checkpoint" draws. Every push of `served` comes after `other` was loaded (the fixture reloads it, a test
pushes it), so the push is what brings those samples back: an engine or a worker the push missed would draw
`other`'s. `draws` (tests/service/weight_pushes.py) sends each group twice, so that both engines draw it, and checks
that both drew the same tokens under one version.

1. A push by `WeightSender` reaches both engines (world size 2) as one version, and they draw the first batch's
   samples again.
2. An engine SIGKILLed while the trainer is sending tensors (its actor's process, or its vLLM engine core: the
   group's rank): the push fails with the service's error naming that engine; both engines then serve the version
   before the push (the survivor kept it, the restarted engine loaded the saved push), and the next push reaches
   both. One restart each, ~25 s.
3. `das bench weight-sync --packed` on this server: its figures, and the versions and weights it leaves.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
import torch

from das.service.client.weights import WeightPushError
from das.service.engine.vllm.gloo_transfer import GlooGroup
from tests.service.cluster.stub_service import process_pids, wait_until
from tests.service.serve_process import TOKEN, Server, metric
from tests.service.weight_pushes import AUTH, Draws, draws, push, reload, tensor_bytes, tiny_checkpoints, transfer


@dataclass(frozen=True)
class TwoEngines:
    """The module's server, its checkpoints, and the draws the tests compare with: `booted` (the server's first
    batch, on `served`) and `others` (under `other`)."""

    server: Server
    weights_root: Path
    served: Path
    other: Path
    booted: Draws
    others: Draws


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoEngines]:
    """The server, started on `served`, left serving `other` (reloaded by path) as version 1."""
    root = tmp_path_factory.mktemp("two-engines")
    weights_root = root / "weights"
    served, other = tiny_checkpoints(weights_root)
    server = Server(served, root / "state", "--engines-per-node", "2", "--weight-transfer", "gloo",
                    "--weights-root", str(weights_root))
    try:
        server.wait_ready()
        booted, version = draws(server.url, engines=2)
        assert version == 0
        assert reload(server.url, other) == 1
        others, version = draws(server.url, engines=2)
        assert version == 1 and all(others[key] != booted[key] for key in booted)
        yield TwoEngines(server, weights_root, served, other, booted, others)
    finally:
        if server.proc.poll() is None:
            server.stop()


def scrape(server: Server) -> str:
    return httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=60).text


def test_a_push_reaches_both_engines_as_one_version_and_draws_what_a_server_started_on_it_draws(
        two: TwoEngines) -> None:
    url = two.server.url
    info = transfer(url)
    assert (info.backend, info.world_size, info.policy_version) == ("gloo", 2, 1)  # one worker per engine
    assert push(url, two.served) == 2
    assert transfer(url).policy_version == 2
    assert draws(url, engines=2) == (two.booted, 2)
    text = scrape(two.server)
    assert metric(text, "das_weight_transfers") == 1
    assert metric(text, "das_weight_transfer_bytes") == tensor_bytes(two.served)
    saved = two.server.state_dir / "pushed-weights" / "v2"  # for an engine that restarts later
    wait_until(saved.is_dir, 60, f"the push was not saved at {saved}")


def restarted(server: Server) -> dict[str, float]:
    """das_engine_restarts by engine."""
    text = scrape(server)
    return {engine: float(n) for engine, n in
            re.findall(r'^das_engine_restarts_total\{engine="([^"]+)"\} (\S+)$', text, re.MULTILINE)}


@pytest.mark.parametrize("death", ["actor", "engine core"])
def test_an_engine_killed_mid_push_fails_the_push_naming_it_and_every_engine_serves_one_version(
        two: TwoEngines, monkeypatch: pytest.MonkeyPatch, death: str) -> None:
    """`other` pushed first, so the version before the push that fails is not the weights the engines boot on.
    The trainer's sender (in this process) stops before its eighth tensor; one engine is SIGKILLed there (its
    actor's process, whose engine core, the group's rank, goes on receiving until it notices; or its engine core,
    whose actor lives on), and the sender goes on: the push fails with the service's answer, which names the dead
    engine (not gloo's "Connection closed by peer" of the trainer's broadcast). Then both engines serve `other`, the
    version before the push (the survivor kept it, the killed engine restarted and loaded the saved push, not its
    checkpoint), and the next push reaches both."""
    url = two.server.url
    old = push(url, two.other)  # saved: the version a restart loads
    before = restarted(two.server)
    halfway, resume = threading.Event(), threading.Event()
    broadcast = GlooGroup.broadcast
    sent = itertools.count()

    def held(group: GlooGroup, tensor: torch.Tensor) -> None:
        if next(sent) == 7:  # of the tiny model's 21 tensors
            halfway.set()
            assert resume.wait(120)
        broadcast(group, tensor)

    monkeypatch.setattr(GlooGroup, "broadcast", held)
    outcome: list[BaseException | int] = []

    def trainer() -> None:
        try:
            outcome.append(push(url, two.served))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=trainer)
    thread.start()
    try:
        assert halfway.wait(120)
        actor = process_pids(two.server.proc.pid, "ray::NodeEngine")[0]
        victim = psutil.Process(actor if death == "actor" else process_pids(actor, "EngineCore")[0])
        victim.send_signal(signal.SIGKILL)
        victim.wait(60)
    finally:
        resume.set()
        thread.join(180)
    monkeypatch.undo()
    (error,) = outcome
    assert isinstance(error, WeightPushError), repr(error)
    assert error.status == 500 and f"serve policy version {old}" in error.message, error.message

    def restarts() -> dict[str, float]:
        now = restarted(two.server)
        return {engine: n - before.get(engine, 0) for engine, n in now.items() if n > before.get(engine, 0)}

    wait_until(lambda: len(restarts()) == 1 and metric(scrape(two.server), "das_engines_ready") == 2, 300,
               "the killed engine did not serve again")
    ((engine, times),) = restarts().items()
    assert times == 1 and f"engine {engine} died during the weight transfer" in error.message, error.message
    assert transfer(url).policy_version == old
    assert draws(url, engines=2) == (two.others, old)
    assert push(url, two.served) == old + 1  # a new group, the restarted engine in it
    assert draws(url, engines=2) == (two.booted, old + 1)


def test_das_bench_weight_sync_reports_every_arm_and_leaves_one_version_on_both_engines(two: TwoEngines) -> None:
    url = two.server.url
    served = transfer(url).policy_version
    das = Path(sys.executable).with_name("das")
    result = subprocess.run([str(das), "bench", "weight-sync", str(two.served), "--weights-root",
                             str(two.weights_root), "--url", url, "--repeats", "1", "--packed", "--json"],
                            env={**os.environ, "DAS_TOKEN": TOKEN}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["bytes"] == tensor_bytes(two.served) and figures["repeats"] == 1
    for arm in ("push_s", "push_packed_s", "write_s", "reload_s"):
        assert 0 < figures[arm] < 60, (arm, figures)
    assert figures["push_gb_s"] == pytest.approx(figures["bytes"] / figures["push_s"] / 1e9)
    assert figures["checkpoint_gb_s"] == pytest.approx(
        figures["bytes"] / (figures["write_s"] + figures["reload_s"]) / 1e9)
    # each arm pushes twice (its group's first push untimed), then one reload: five versions, the same weights
    assert transfer(url).policy_version == served + 5
    assert draws(url, engines=2) == (two.booted, served + 5)
    assert not list(two.weights_root.glob("das-bench-weight-sync-*"))  # its checkpoint removed
