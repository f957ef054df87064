"""`HistoryShard`: one shard of the service's rollout history (a Ray actor in the service; a plain class here).

Problems are spread over S shards by `shard_of(problem_id, S)` (a stable hash, not Python's salted `hash`). A shard
holds, per problem, the recent finished rollouts (what engines build their drafter from) and the problem's
difficulty record (lengths by policy version, what length prediction reads).

Bounds: per problem the rollouts of the newest `window_versions` policy versions, at most `max_records_per_problem`
of them (oldest out first); per shard at most `max_tokens` output tokens (the least recently updated problems
lose their oldest rollouts first).

Pulling: every stored rollout gets a sequence number, increasing per shard, and the name of whoever pushed it.
An engine pulls "problem p after sequence c, not pushed by me": it gets what other engines and imports added
since its last pull, never its own rollouts back (its drafter saw those tokens as they were generated).

Snapshots: `snapshot()` writes the shard to `<state_dir>/history-shard-<i>.msgpack` (a temporary file, fsync,
then rename, so a crash leaves the old snapshot or the new one, never half of one); a new shard restores its own
file. The shard count is fixed for a state directory (a file records it): starting with another count is refused
with a clear error rather than guessed at. A file that does not parse is renamed `.corrupt` and skipped.
"""

from __future__ import annotations

import array
import hashlib
import logging
import os
import resource
import sys
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
from pydantic import BaseModel, ConfigDict, Field

from das.drafter.records import RecordError, RolloutRecord
from das.scheduler.difficulty import DifficultyBook, dump_difficulty, load_difficulty
from das.service.api import ProblemSummary, wire_problem

log = logging.getLogger(__name__)

SNAPSHOT_FORMAT = "das-history-shard"
SNAPSHOT_VERSION = 1
_SNAPSHOT_GLOB = "history-shard-*.msgpack"


class HistoryConfig(BaseModel):
    """Bounds and placement of the history store."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shards: int = Field(2, ge=1, le=1024, description="HistoryStore actors; problems are spread by hash")
    window_versions: int = Field(2, ge=1, le=64, description="policy versions of rollouts kept per problem")
    max_records_per_problem: int = Field(64, ge=1, description="rollouts kept per problem (newest)")
    max_tokens: int = Field(50_000_000, ge=1, description="output tokens kept per shard (~4 bytes each)")
    snapshot_interval_s: float = Field(60.0, gt=0, description="seconds between snapshots of changed shards")


def unstorable(record: RolloutRecord, where: str = "record") -> str | None:
    """Why a valid history record cannot be stored (the format bounds its token ids and reward, not its other
    fields, and a snapshot's msgpack holds no integer beyond int64 and no lone surrogate), or None."""
    return wire_problem({"problem_id": record.problem_id, "policy_version": record.policy_version,
                         "sample_index": record.sample_index, "finish_reason": record.finish_reason}, where)


def shard_of(problem_id: str, shards: int) -> int:
    """The shard holding `problem_id`: the same in every process and run (blake2b of the UTF-8 id)."""
    digest = hashlib.blake2b(problem_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % shards


@dataclass(slots=True)
class StoredRollout:
    """One rollout as a shard keeps it: output tokens as an int32 array (4 bytes a token)."""

    seq: int
    origin: str
    policy_version: int
    sample_index: int
    output: array.array
    finish_reason: str | None
    reward: float | None

    def key(self) -> tuple[int, int, bytes]:
        return self.policy_version, self.sample_index, self.output.tobytes()


@dataclass(slots=True)
class _Problem:
    prompt: tuple[int, ...]
    rollouts: deque[StoredRollout] = field(default_factory=deque)
    tokens: int = 0


@dataclass(frozen=True, slots=True)
class ShardStats:
    problems: int
    rollouts: int
    output_tokens: int
    resident_bytes: int  # resident memory of the shard's process now


class HistoryShard:
    """One shard; see the module docstring. Not thread-safe: Ray runs a (sync) actor's calls one at a time."""

    def __init__(self, index: int, config: HistoryConfig, state_dir: str | None = None) -> None:
        if not 0 <= index < config.shards:
            raise ValueError(f"shard index {index} outside [0, {config.shards})")
        self.index = index
        self.config = config
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.difficulty = DifficultyBook()  # its own (longer) version window: lengths are cheap
        self._problems: OrderedDict[str, _Problem] = OrderedDict()  # least recently updated first
        self._tokens = 0
        self._seq = 0
        self._dirty = False
        if self.state_dir is not None:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            self._restore()

    # ---- writes ----

    def put(self, origin: str, records: list[dict[str, Any]]) -> int:
        """Stores history-format records (validated here; a bad one, or one a snapshot could not hold, raises
        RecordError and stores nothing) in the given order. Returns how many were stored (a record older than the
        window is dropped)."""
        parsed = [RolloutRecord.from_dict(r) for r in records]
        for i, rec in enumerate(parsed):
            problem = unstorable(rec, f"record {i}")
            if problem:
                raise RecordError(problem)
        return sum(self._add(origin, rec) for rec in parsed)

    def _add(self, origin: str, rec: RolloutRecord, seq: int | None = None) -> bool:
        problem = self._problems.get(rec.problem_id)
        if problem is None or problem.prompt != rec.prompt_token_ids:
            # A problem id asked with another prompt: the old rollouts continue another text; drop them.
            if problem is not None:
                self._tokens -= problem.tokens
            problem = self._problems[rec.problem_id] = _Problem(rec.prompt_token_ids)
        newest = max((r.policy_version for r in problem.rollouts), default=rec.policy_version)
        if rec.policy_version <= newest - self.config.window_versions:
            return False
        if seq is None:
            self._seq += 1
            seq = self._seq
        else:  # restored from a snapshot
            self._seq = max(self._seq, seq)
        stored = StoredRollout(seq, origin, rec.policy_version, rec.sample_index,
                               array.array("i", rec.output_token_ids), rec.finish_reason, rec.reward)
        problem.rollouts.append(stored)
        problem.tokens += len(stored.output)
        self._tokens += len(stored.output)
        self.difficulty.add_record(rec)
        self._problems.move_to_end(rec.problem_id)
        self._trim(problem, max(newest, rec.policy_version))
        self._dirty = True
        return True

    def _trim(self, problem: _Problem, newest: int) -> None:
        floor = newest - self.config.window_versions
        while problem.rollouts and (len(problem.rollouts) > self.config.max_records_per_problem
                                    or problem.rollouts[0].policy_version <= floor):
            self._drop_oldest(problem)
        # Shard budget: oldest rollouts of the least recently updated problems go first.
        while self._tokens > self.config.max_tokens:
            pid, victim = next(iter(self._problems.items()))
            self._drop_oldest(victim)
            if not victim.rollouts:
                del self._problems[pid]

    def _drop_oldest(self, problem: _Problem) -> None:
        gone = problem.rollouts.popleft()
        problem.tokens -= len(gone.output)
        self._tokens -= len(gone.output)

    # ---- reads ----

    def pull(self, cursors: dict[str, int], exclude_origin: str) -> dict[str, tuple[list[dict[str, Any]], int]]:
        """For each problem id -> cursor: the history-format records stored after sequence `cursor` and not
        pushed by `exclude_origin`, and the cursor to pass next time. Unknown problems get ([], cursor)."""
        out: dict[str, tuple[list[dict[str, Any]], int]] = {}
        for pid, cursor in cursors.items():
            problem = self._problems.get(pid)
            if problem is None:
                out[pid] = ([], cursor)
                continue
            prompt = list(problem.prompt)
            records = [_record(pid, prompt, r) for r in problem.rollouts
                       if r.seq > cursor and r.origin != exclude_origin]
            out[pid] = (records, max((r.seq for r in problem.rollouts), default=cursor))
        return out

    def difficulty_blobs(self) -> dict[str, bytes]:
        """Every problem's difficulty record (scheduler.difficulty's format), for length prediction."""
        return {pid: dump_difficulty(h) for pid in self.difficulty
                if (h := self.difficulty.get(pid)) is not None}

    def summary(self, problem_id: str) -> ProblemSummary | None:
        problem = self._problems.get(problem_id)
        if problem is None:
            return None
        lengths = sorted(len(r.output) for r in problem.rollouts)
        history = self.difficulty.get(problem_id)
        return ProblemSummary(
            problem_id=problem_id, rollouts=len(problem.rollouts), output_tokens=problem.tokens,
            policy_versions=sorted({r.policy_version for r in problem.rollouts}), prompt_tokens=len(problem.prompt),
            length_p50=_median(lengths), length_max=lengths[-1] if lengths else None,
            finish_reasons=history.finish_reasons() if history is not None else {})

    def stats(self) -> ShardStats:
        rollouts = sum(len(p.rollouts) for p in self._problems.values())
        return ShardStats(len(self._problems), rollouts, self._tokens, resident_bytes())

    # ---- snapshots ----

    def snapshot(self, force: bool = False) -> str | None:
        """Writes the shard to the state directory if anything changed since the last snapshot (or `force`);
        returns the file written, or None."""
        if self.state_dir is None or not (self._dirty or force):
            return None
        path = self._path()
        doc = {"format": SNAPSHOT_FORMAT, "version": SNAPSHOT_VERSION, "shards": self.config.shards,
               "seq": self._seq, "problems": [
            {"problem_id": pid, "prompt": array.array("i", p.prompt).tobytes(),
             "rollouts": [[r.seq, r.origin, r.policy_version, r.sample_index, r.output.tobytes(), r.finish_reason,
                           r.reward] for r in p.rollouts],
             "difficulty": dump_difficulty(h) if (h := self.difficulty.get(pid)) is not None else None}
            for pid, p in self._problems.items()]}
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(msgpack.packb(doc, use_bin_type=True))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self._dirty = False
        return str(path)

    def _restore(self) -> None:
        assert self.state_dir is not None
        for path in self.state_dir.glob(_SNAPSHOT_GLOB):
            index = path.stem.rsplit("-", 1)[-1]
            if not index.isdigit() or int(index) >= self.config.shards:
                raise ValueError(f"{path}: written by a store with more shards than {self.config.shards}; start "
                                 f"with the shard count the state directory was written with")
        path = self._path()
        if not path.exists():
            return
        try:
            doc = msgpack.unpackb(path.read_bytes(), raw=False)
            if doc.get("format") != SNAPSHOT_FORMAT or doc.get("version") != SNAPSHOT_VERSION:
                raise ValueError(f"not a {SNAPSHOT_FORMAT} v{SNAPSHOT_VERSION} file")
            shards = doc["shards"]
            rollouts, difficulties = [], []
            for entry in doc["problems"]:
                pid = entry["problem_id"]
                prompt = array.array("i", entry["prompt"]).tolist()
                for seq, origin, version, index, output, reason, reward in entry["rollouts"]:
                    rollouts.append((seq, origin, RolloutRecord(pid, version, index, prompt,
                                                                array.array("i", output).tolist(), reason, reward)))
                if entry["difficulty"] is not None:
                    difficulties.append(load_difficulty(entry["difficulty"]))
        except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:  # RecordError is a ValueError
            # A damaged snapshot must not stop the service; it is kept for inspection, not overwritten.
            log.error("history snapshot %s skipped and renamed to .corrupt: %s", path, exc)
            path.rename(path.with_suffix(".corrupt"))
            return
        if shards != self.config.shards:
            raise ValueError(f"{path}: written by a store of {shards} shards, this one has {self.config.shards}; "
                             f"start with the shard count the state directory was written with")
        for seq, origin, record in rollouts:
            self._add(origin, record, seq=seq)
        for history in difficulties:
            # The snapshot's record also holds the lengths and acceptance of rollouts trimmed from the window.
            self.difficulty.put(history)
        self._dirty = False

    def _path(self) -> Path:
        assert self.state_dir is not None
        return self.state_dir / f"history-shard-{self.index}.msgpack"


def _record(problem_id: str, prompt: list[int], r: StoredRollout) -> dict[str, Any]:
    d: dict[str, Any] = {"problem_id": problem_id, "policy_version": r.policy_version, "sample_index": r.sample_index,
                         "prompt_token_ids": prompt, "output_token_ids": r.output.tolist()}
    if r.finish_reason is not None:
        d["finish_reason"] = r.finish_reason
    if r.reward is not None:
        d["reward"] = r.reward
    return d


def _median(sorted_values: list[int]) -> float | None:
    n = len(sorted_values)
    if n == 0:
        return None
    return float(sorted_values[n // 2]) if n % 2 else (sorted_values[n // 2 - 1] + sorted_values[n // 2]) / 2


def resident_bytes() -> int:
    """Resident memory of this process now (bytes; /proc on Linux, peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
