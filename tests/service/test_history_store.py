"""The history store's shard on its own (no Ray): windows, budgets, pulls by cursor, snapshots and restores."""

from __future__ import annotations

from pathlib import Path

import pytest

from das.drafter.records import RecordError
from das.service.history_store import HistoryConfig, HistoryShard, shard_of


def record(pid: str = "p", version: int = 0, index: int = 0, tokens: list[int] | None = None,
           prompt: list[int] | None = None) -> dict:
    return {"problem_id": pid, "policy_version": version, "sample_index": index,
            "prompt_token_ids": prompt or [1, 2], "output_token_ids": tokens if tokens is not None else [5, 6, 7],
            "finish_reason": "stop"}


def test_shard_of_is_stable_and_spreads():
    assert shard_of("problem-1", 4) == shard_of("problem-1", 4)  # not Python's per-process salted hash
    assert len({shard_of(f"p{i}", 4) for i in range(100)}) == 4


def test_pull_returns_what_others_added_since_the_cursor():
    shard = HistoryShard(0, HistoryConfig(shards=1))
    shard.put("engine-a", [record(index=0), record(index=1)])
    shard.put("engine-b", [record(index=2, tokens=[8, 9])])
    (records, cursor), = shard.pull({"p": 0}, "engine-a").values()
    assert [r["sample_index"] for r in records] == [2] and records[0]["output_token_ids"] == [8, 9]
    assert records[0]["prompt_token_ids"] == [1, 2] and records[0]["finish_reason"] == "stop"
    assert shard.pull({"p": cursor}, "engine-a")["p"] == ([], cursor)  # nothing new
    shard.put("import", [record(index=3)])
    (records, _), = shard.pull({"p": cursor}, "engine-a").values()
    assert [r["sample_index"] for r in records] == [3]
    assert shard.pull({"unknown": 5}, "engine-a") == {"unknown": ([], 5)}


def test_bad_records_store_nothing():
    shard = HistoryShard(0, HistoryConfig(shards=1))
    with pytest.raises(RecordError, match="sample_index"):
        shard.put("x", [record(index=0), record(index=-1)])
    assert shard.stats().rollouts == 0


@pytest.mark.parametrize("bad, message", [
    (record(version=10**30), "record 1.policy_version: integer beyond int64"),
    (record(index=2**64), "record 1.sample_index: integer beyond int64"),
    (record(pid="\ud800"), "record 1.problem_id: not valid Unicode"),
    ({**record(), "finish_reason": "\udc80"}, "record 1.finish_reason: not valid Unicode"),
])
def test_records_a_snapshot_could_not_hold_store_nothing(tmp_path: Path, bad: dict, message: str):
    """A policy_version of 10**30 was once stored, and from then on every snapshot (the shutdown one too) failed."""
    shard = HistoryShard(0, HistoryConfig(shards=1), str(tmp_path))
    with pytest.raises(RecordError, match=message):
        shard.put("x", [record(index=0), bad])
    shard.put("x", [record(version=2**63 - 1)])
    assert shard.snapshot() is not None
    restored = HistoryShard(0, HistoryConfig(shards=1), str(tmp_path))
    assert restored.summary("p").policy_versions == [2**63 - 1]


def test_window_of_versions_and_per_problem_cap():
    shard = HistoryShard(0, HistoryConfig(shards=1, window_versions=2, max_records_per_problem=3))
    shard.put("x", [record(version=0, index=i) for i in range(2)])
    shard.put("x", [record(version=1, index=0)])
    assert shard.summary("p").policy_versions == [0, 1]
    shard.put("x", [record(version=2, index=0)])
    assert shard.summary("p").policy_versions == [1, 2]  # version 0 left the window
    assert shard.put("x", [record(version=0, index=5)]) == 0  # too old to store
    shard.put("x", [record(version=2, index=i) for i in range(1, 4)])
    summary = shard.summary("p")
    assert summary.rollouts == 3 and summary.policy_versions == [2]


def test_token_budget_evicts_the_least_recently_updated_problem_first():
    shard = HistoryShard(0, HistoryConfig(shards=1, max_tokens=10))
    shard.put("x", [record("old", tokens=[1] * 4)])
    shard.put("x", [record("new", tokens=[1] * 4)])
    shard.put("x", [record("new", index=1, tokens=[1] * 4)])
    assert shard.summary("old") is None and shard.summary("new").rollouts == 2
    assert shard.stats().output_tokens == 8


def test_a_new_prompt_for_a_problem_drops_its_old_rollouts():
    shard = HistoryShard(0, HistoryConfig(shards=1))
    shard.put("x", [record(prompt=[1, 2]), record(index=1, prompt=[1, 2])])
    shard.put("x", [record(index=2, prompt=[3, 4])])
    summary = shard.summary("p")
    assert summary.rollouts == 1 and summary.prompt_tokens == 2


def test_snapshot_and_restore(tmp_path: Path):
    config = HistoryConfig(shards=2)
    shards = [HistoryShard(i, config, str(tmp_path)) for i in range(2)]
    pids = [f"p{i}" for i in range(6)]
    for pid in pids:
        # identical rollouts are distinct rollouts (greedy decoding repeats itself): both are kept
        shards[shard_of(pid, 2)].put("engine", [record(pid, index=0), record(pid, index=0)])
    assert [s.snapshot() for s in shards] == [str(tmp_path / f"history-shard-{i}.msgpack") for i in range(2)]
    assert shards[0].snapshot() is None  # unchanged since: nothing written

    restored = [HistoryShard(i, config, str(tmp_path)) for i in range(2)]
    for pid in pids:
        shard = restored[shard_of(pid, 2)]
        assert shard.summary(pid) == shards[shard_of(pid, 2)].summary(pid)
        assert shard.summary(pid).rollouts == 2
        assert len(shard.difficulty.lengths(pid)) == 2
        (records, _), = shard.pull({pid: 0}, "another-engine").values()
        assert len(records) == 2
    # pushes after the restore continue the sequence: a cursor from before still sees only what is new
    _, cursor = restored[shard_of("p0", 2)].pull({"p0": 0}, "e")["p0"]
    restored[shard_of("p0", 2)].put("engine", [record("p0", index=1)])
    assert len(restored[shard_of("p0", 2)].pull({"p0": cursor}, "e")["p0"][0]) == 1


def test_a_different_shard_count_is_refused(tmp_path: Path):
    HistoryShard(1, HistoryConfig(shards=2), str(tmp_path)).put("e", [record()])
    first = HistoryShard(1, HistoryConfig(shards=2), str(tmp_path))
    first.put("e", [record()])
    first.snapshot()
    with pytest.raises(ValueError, match="more shards than 1"):
        HistoryShard(0, HistoryConfig(shards=1), str(tmp_path))
    with pytest.raises(ValueError, match="store of 2 shards, this one has 3"):
        HistoryShard(1, HistoryConfig(shards=3), str(tmp_path))


def test_a_corrupt_snapshot_is_set_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    (tmp_path / "history-shard-0.msgpack").write_bytes(b"\x93not msgpack")
    shard = HistoryShard(0, HistoryConfig(shards=1), str(tmp_path))
    assert shard.stats().rollouts == 0
    assert (tmp_path / "history-shard-0.corrupt").exists() and "skipped" in caplog.text
