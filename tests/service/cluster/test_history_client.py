"""History shards that die, as real Ray actors (no model): a shard SIGKILLed between pushes, a shard SIGTERMed, and
`das serve --stub-engine` stopped by a SIGTERM to its whole process group (what a container runtime sends)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from das.service.client import RolloutClient
from das.service.cluster.history_client import HistoryClient
from das.service.cluster.history_store import HistoryShard, HistoryShardActor
from das.service.config import HistoryConfig, HistoryPushConfig
from tests.service.serve_process import free_port, wait_ready
from tests.service.cluster.flaky_shard import FlakyShard


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(address="local", num_cpus=1, object_store_memory=80 << 20, include_dashboard=False)
    yield
    ray.shutdown()


def record(batch: str, index: int) -> dict[str, Any]:
    return {"problem_id": "p", "policy_version": 0, "sample_index": index, "prompt_token_ids": [1, 2],
            "output_token_ids": [ord(c) for c in batch] + [index], "finish_reason": "stop"}


def shard_actor(state: Path) -> Any:
    return ray.remote(HistoryShardActor).options(num_cpus=0, max_restarts=-1, max_task_retries=0).remote(
        0, HistoryConfig(shards=1), str(state))


def pid_of(actor: Any) -> int:
    return int(ray.get(actor.__ray_call__.remote(lambda self: os.getpid())))


def stored(actor: Any) -> Counter[tuple[int, ...]]:
    """Every stored rollout's output, counted (a duplicate shows as a count of 2)."""
    records, _ = ray.get(actor.pull.remote({"p": 0}, "reader"))["p"]
    return Counter(tuple(r["output_token_ids"]) for r in records)


def test_a_push_that_runs_out_of_retries_is_kept_for_the_next_push(tmp_path: Path) -> None:
    shard = FlakyShard(tmp_path)
    client = HistoryClient([shard], HistoryPushConfig(retry_s=0.3, backoff_s=0.05, max_backoff_s=0.1))
    shard.down = 1000
    asyncio.run(client.push("e", [record("a", i) for i in range(2)]))  # gives up after ~0.3 s, keeps them
    assert shard.calls >= 3 and client.pending() == 2 and shard.shard.stats().rollouts == 0
    shard.down = 2  # back after two more failures: retried within the time
    asyncio.run(client.push("e", [record("b", 0)]))
    assert shard.shard.stats().rollouts == 3 and client.pending() == 3  # acknowledged, in no snapshot yet
    shard.shard.snapshot()
    asyncio.run(client.push("e", [record("c", 0)]))
    assert client.pending() == 1  # the reply said ids 1-3 are in the snapshot: only c is kept
    shard.restart()  # c was not snapshotted: the new process lacks it
    asyncio.run(client.push("e", [record("d", 0)]))
    expected = Counter(tuple(record(b, int(i))["output_token_ids"]) for b, i in ("a0", "a1", "b0", "c0", "d0"))
    records, _ = shard.shard.pull({"p": 0}, "reader")["p"]
    assert Counter(tuple(r["output_token_ids"]) for r in records) == expected


def test_pulls_wait_for_a_restarting_shard_then_go_on_without_it(tmp_path: Path) -> None:
    shard = FlakyShard(tmp_path)
    shard.shard.put("other", [record("a", 0)])
    client = HistoryClient([shard], HistoryPushConfig(retry_s=0.3, backoff_s=0.05, max_backoff_s=0.1))
    shard.down = 2
    assert len(asyncio.run(client.pull(0, {"p": 0}, "e"))["p"][0]) == 1
    shard.down = 1000
    assert asyncio.run(client.pull(0, {"p": 0}, "e")) == {}


def test_a_full_outbox_gives_up_the_oldest(tmp_path: Path) -> None:
    shard = FlakyShard(tmp_path)
    client = HistoryClient([shard], HistoryPushConfig(retry_s=0, max_pending_tokens=5))
    shard.down = 1000
    for i in range(4):  # 2 tokens each
        asyncio.run(client.push("e", [record("a", i)]))
    assert client.pending() == 2 and client.given_up == 2
    shard.down = 0
    asyncio.run(client.push("e", []))  # nothing new: nothing sent
    asyncio.run(client.push("e", [record("b", 0)]))
    assert client.given_up == 3  # the outbox was full again before the send
    records, _ = shard.shard.pull({"p": 0}, "reader")["p"]
    assert sorted(r["output_token_ids"][1] for r in records) == [0, 3]  # a2 given up with a0, a1; a3 and b0 kept
    # ids the client gave up are settled: the shard's received floor moved past them
    assert shard.shard.push("e", [record("z", 0)], [1]).stored == 0


def test_rollouts_pushed_around_a_shard_sigkill_are_all_kept_once(local_ray: None, tmp_path: Path) -> None:
    shard = shard_actor(tmp_path)
    client = HistoryClient([shard], HistoryPushConfig(retry_s=60, backoff_s=0.1, max_backoff_s=0.5))
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(client.push("engine#1", [record("a", i) for i in range(3)]))
        ray.get(shard.snapshot.remote())  # the periodic snapshot: holds batch a
        loop.run_until_complete(client.push("engine#1", [record("b", i) for i in range(3)]))
        assert client.pending() == 3  # b is acknowledged but in no snapshot: kept (a was pruned by b's reply)
        _, cursor = ray.get(shard.pull.remote({"p": 0}, "reader"))["p"]
        old_pid = pid_of(shard)
        os.kill(old_pid, signal.SIGKILL)  # no atexit, no snapshot: the shard loses b
        # pushed while the shard is dead or restarting: retried until it is back, then b is re-sent
        loop.run_until_complete(client.push("engine#1", [record("c", i) for i in range(3)]))
    finally:
        loop.close()
    assert pid_of(shard) != old_pid
    expected = Counter(tuple(record(b, i)["output_token_ids"]) for b in "abc" for i in range(3))
    assert stored(shard) == expected  # every rollout, each once
    # a cursor from the dead process still sees what the new one stored (b again, c)
    records, _ = ray.get(shard.pull.remote({"p": cursor}, "reader"))["p"]
    assert Counter(r["output_token_ids"][0] for r in records) == Counter({ord("b"): 3, ord("c"): 3})


def test_a_shard_snapshots_on_its_own_sigterm(local_ray: None, tmp_path: Path) -> None:
    shard = shard_actor(tmp_path)
    ray.get(shard.put.remote("e", [record("a", i) for i in range(4)]))
    os.kill(pid_of(shard), signal.SIGTERM)
    deadline = time.monotonic() + 30
    while not (tmp_path / "history-shard-0.msgpack").exists():
        assert time.monotonic() < deadline, "no snapshot after SIGTERM"
        time.sleep(0.1)
    ray.kill(shard, no_restart=True)
    assert HistoryShard(0, HistoryConfig(shards=1), str(tmp_path)).stats().rollouts == 4


def test_das_serve_stopped_by_a_process_group_sigterm_leaves_a_complete_snapshot(tmp_path: Path) -> None:
    port = free_port()
    state = tmp_path / "state"
    das = Path(sys.executable).with_name("das")
    # No periodic snapshot during the test: whatever is on disk was written on the way out.
    proc = subprocess.Popen([str(das), "serve", "--stub-engine", "--port", str(port), "--state-dir", str(state),
                             "--snapshot-interval", "3600"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, timeout_s=180, poll_s=0.5)
        groups = [{"problem_id": f"p{i}", "prompt_token_ids": [5, 6, 7 + i], "n": 4,
                   "sampling": {"max_tokens": 16}} for i in range(6)]
        with RolloutClient(url) as client:
            assert len(list(client.generate(groups))) == 24
            assert sum(client.history(f"p{i}").rollouts for i in range(6)) == 24
        os.killpg(proc.pid, signal.SIGTERM)  # the driver, the raylet, the shard and engine workers at once
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    restored = [HistoryShard(i, HistoryConfig(shards=2), str(state)) for i in range(2)]
    assert sum(s.stats().rollouts for s in restored) == 24, out
    assert all(s.stats().snapshot_quarantined == 0 for s in restored), out
