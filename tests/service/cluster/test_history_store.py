"""The history store's shard on its own (no Ray): windows, budgets, pulls by cursor, snapshots and restores."""

from __future__ import annotations

import array
import hashlib
import struct
from pathlib import Path

import msgpack
import pytest

from das.drafter.records import RecordError
from das.service.cluster.history_store import HistoryShard, shard_of
from das.service.config import HistoryConfig


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
    (tmp_path / "history-shard-1.msgpack").rename(tmp_path / "history-shard-1.msgpack.prev")
    with pytest.raises(ValueError, match="more shards than 1"):  # the previous generation counts too
        HistoryShard(0, HistoryConfig(shards=1), str(tmp_path))


def quarantined(state: Path) -> list[str]:
    return sorted(p.name for p in state.iterdir() if ".bad-" in p.name)


def two_generations(state: Path) -> HistoryShard:
    """A shard whose directory holds two snapshots: 2 rollouts in the previous one, 3 in the newest."""
    shard = HistoryShard(0, HistoryConfig(shards=1), str(state))
    shard.put("e", [record(index=0), record(index=1)])
    shard.snapshot()
    shard.put("e", [record(index=2)])
    shard.snapshot()
    assert sorted(p.name for p in state.iterdir()) == ["history-shard-0.msgpack", "history-shard-0.msgpack.prev"]
    return shard


@pytest.mark.parametrize("damage, reason", [
    (lambda data: data[:len(data) // 2], "truncated"),  # a torn write
    (lambda data: data[:20], "truncated"),  # torn inside the header
    (lambda data: data[:-7] + bytes([data[-7] ^ 0x01]) + data[-6:], "checksum"),  # one flipped bit in the body
    (lambda data: b"\x89NOTDASH" + data[8:], "format"),
    (lambda data: b"", "format"),
])
def test_a_damaged_newest_snapshot_falls_back_to_the_previous(tmp_path: Path, damage, reason: str,
                                                               caplog: pytest.LogCaptureFixture):
    two_generations(tmp_path)
    newest = tmp_path / "history-shard-0.msgpack"
    newest.write_bytes(damage(newest.read_bytes()))
    restored = HistoryShard(0, HistoryConfig(shards=1), str(tmp_path))
    assert restored.summary("p").rollouts == 2  # the previous generation, not an empty shard
    stats = restored.stats()
    assert (stats.snapshot_fallbacks, stats.snapshot_quarantined) == (1, 1)
    assert stats.last_snapshot_unix_s is not None
    assert [n.split(".bad-")[1].rsplit("-", 1)[0] for n in quarantined(tmp_path)] == [reason]
    assert "restored the previous snapshot" in caplog.text
    # the fallback is written again as the newest at the next snapshot
    assert restored.snapshot() is not None
    assert HistoryShard(0, HistoryConfig(shards=1), str(tmp_path)).summary("p").rollouts == 2


def test_the_newest_snapshot_missing_uses_the_previous(tmp_path: Path):
    """A crash between the two renames of a snapshot leaves only the previous generation."""
    two_generations(tmp_path)
    (tmp_path / "history-shard-0.msgpack").unlink()
    restored = HistoryShard(0, HistoryConfig(shards=1), str(tmp_path))
    assert restored.summary("p").rollouts == 2 and restored.stats().snapshot_fallbacks == 1
    assert quarantined(tmp_path) == []


def packed_snapshot(body: object) -> bytes:
    """A well-formed container (correct length and checksum) around any msgpack value."""
    data = msgpack.packb(body, use_bin_type=True)
    return struct.pack("<8sIQ32s", b"\x89DASHIST", 1, len(data), hashlib.sha256(data).digest()) + data


GOOD_DOC = {"format": "das-history-shard", "version": 2, "shards": 1, "seq": 3, "received": {}, "problems": []}


@pytest.mark.parametrize("data", [
    msgpack.packb([1, 2, 3]),  # a top-level list, pre-container style (once a crash loop)
    msgpack.packb(7),  # a top-level int
    b"\x93not msgpack",
    packed_snapshot([1, 2, 3]),
    packed_snapshot(12),
    packed_snapshot({**GOOD_DOC, "problems": 5}),
    packed_snapshot({**GOOD_DOC, "received": [1]}),
    packed_snapshot({**GOOD_DOC, "received": {"e": [1, "x"]}}),
    packed_snapshot({**GOOD_DOC, "problems": [{"problem_id": "p", "prompt": b"\0" * 5, "rollouts": []}]}),
    packed_snapshot({**GOOD_DOC, "problems": [{"problem_id": "p", "prompt": b"\0" * 4, "rollouts": [[1, "e"]]}]}),
    packed_snapshot({**GOOD_DOC, "problems": [{"problem_id": "p", "prompt": b"\0" * 4, "difficulty": b"junk",
                                               "rollouts": [[1, "e", 0, 0, b"\0" * 4, "stop", None]]}]}),
    packed_snapshot({**GOOD_DOC, "problems": [{"problem_id": "p", "prompt": b"\0" * 4, "difficulty": None,
                                               "rollouts": [[1, "e", -1, 0, b"\0" * 4, "stop", None]]}]}),
    packed_snapshot({**GOOD_DOC, "version": 9}),
])
def test_an_unreadable_snapshot_is_quarantined_and_startup_goes_on(tmp_path: Path, data: bytes):
    (tmp_path / "history-shard-0.msgpack").write_bytes(data)
    shard = HistoryShard(0, HistoryConfig(shards=1), str(tmp_path))
    assert shard.stats().rollouts == 0 and shard.stats().snapshot_quarantined == 1
    assert len(quarantined(tmp_path)) == 1 and not (tmp_path / "history-shard-0.msgpack").exists()
    shard.put("e", [record()])
    assert shard.snapshot() is not None  # and the shard works on


def test_a_snapshot_from_before_the_checksum_still_loads(tmp_path: Path):
    legacy = {"format": "das-history-shard", "version": 1, "shards": 1, "seq": 4, "problems": [
        {"problem_id": "p", "prompt": array.array("i", [1, 2]).tobytes(), "difficulty": None,
         "rollouts": [[4, "e", 0, 0, array.array("i", [5, 6]).tobytes(), "stop", None]]}]}
    (tmp_path / "history-shard-0.msgpack").write_bytes(msgpack.packb(legacy, use_bin_type=True))
    shard = HistoryShard(0, HistoryConfig(shards=1), str(tmp_path))
    assert shard.summary("p").rollouts == 1 and shard.stats().snapshot_quarantined == 0
    (records, _), = shard.pull({"p": 0}, "x").values()
    assert records[0]["output_token_ids"] == [5, 6]


def test_push_stores_a_rollout_identity_once(tmp_path: Path):
    shard = HistoryShard(0, HistoryConfig(shards=1), str(tmp_path))
    first = shard.push("e#1", [record(index=0), record(index=1)], [1, 2])
    assert first.stored == 2 and first.durable == 0  # nothing snapshotted yet
    # a re-send of id 2 (its first send landed, the reply was lost) with the new id 3
    again = shard.push("e#1", [record(index=1), record(index=2)], [2, 3])
    assert again.stored == 1 and again.epoch == first.epoch
    assert shard.push("e#2", [record(index=1)], [2]).stored == 1  # another origin's id 2 is another rollout
    assert shard.summary("p").rollouts == 4
    shard.snapshot()
    assert shard.push("e#1", [record(index=3)], [4]).durable == 3  # the snapshot holds ids 1-3
    with pytest.raises(RecordError, match="one positive integer per record"):
        shard.push("e#1", [record()], [0])
    with pytest.raises(RecordError, match="one positive integer per record"):
        shard.push("e#1", [record(), record()], [5])

    # a new process restores what the snapshot received: ids 1-3 are not stored again, the lost id 4 is
    restarted = HistoryShard(0, HistoryConfig(shards=1), str(tmp_path))
    assert restarted.epoch != first.epoch
    reply = restarted.push("e#1", [record(index=1), record(index=2), record(index=3)], [2, 3, 4])
    assert reply.stored == 1 and reply.durable == 3
    assert restarted.summary("p").rollouts == 5


def test_push_without_a_state_directory_is_durable_once_received():
    shard = HistoryShard(0, HistoryConfig(shards=1))
    assert shard.push("e", [record(index=0)], [2]).durable == 0  # id 1 not here yet
    assert shard.push("e", [record(index=1)], [1]).durable == 2
    assert shard.push("e", [record(index=2)], [7], settled=6).durable == 7  # 3-6 given up by the pusher


def test_a_cursor_from_a_previous_shard_process_hides_nothing_new():
    """A shard that restarts without a snapshot starts empty; an engine's cursor from before must still see what
    the new process stores (sequence numbers never go backwards)."""
    old = HistoryShard(0, HistoryConfig(shards=1))
    old.put("e", [record(index=i) for i in range(50)])
    _, cursor = old.pull({"p": 0}, "x")["p"]
    new = HistoryShard(0, HistoryConfig(shards=1))
    new.put("e", [record(index=0)])
    assert len(new.pull({"p": cursor}, "x")["p"][0]) == 1


def test_a_rollouts_sample_key_is_kept_through_a_snapshot_and_pulled_with_it(tmp_path: Path):
    shard = HistoryShard(0, HistoryConfig(shards=1), str(tmp_path))
    keyed = {**record(index=1), "sample_key": -(2**63)}
    shard.put("e", [record(index=0), keyed])
    shard.snapshot()
    restored = HistoryShard(0, HistoryConfig(shards=1), str(tmp_path))
    (records, _), = restored.pull({"p": 0}, "x").values()
    assert sorted((r["sample_index"], r.get("sample_key")) for r in records) == [(0, None), (1, -(2**63))]
    # a version-3 rollout without its key field is a damaged snapshot, not a rollout without a key
    bad = {**GOOD_DOC, "version": 3, "problems": [{"problem_id": "p", "prompt": b"\0" * 4, "difficulty": None,
                                                   "rollouts": [[1, "e", 0, 0, b"\0" * 4, "stop", None]]}]}
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "history-shard-0.msgpack").write_bytes(packed_snapshot(bad))
    assert HistoryShard(0, HistoryConfig(shards=1), str(tmp_path / "other")).stats().snapshot_quarantined == 1
