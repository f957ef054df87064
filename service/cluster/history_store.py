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

Snapshots: `snapshot()` writes the shard to `<state_dir>/history-shard-<i>.msgpack`: a header (magic, container
version, body length, sha256 of the body) and the msgpack body, written to a temporary file, fsynced, then renamed
into place after the previous snapshot was renamed to `history-shard-<i>.msgpack.prev` (two generations). A new
shard restores the newest file that checks out; a file that does not (torn, flipped byte, wrong shape) is renamed
`<name>.bad-<reason>-<unix time>` (quarantined, kept for inspection) and the previous generation is used. Files from
before the header (a bare msgpack body) still load if they validate. The shard count is fixed for a state directory
(a file records it): starting with another count is refused with a clear error rather than guessed at.

Idempotent pushes: engines `push` records with an id each, numbered 1, 2, ... per (origin, shard); a shard stores
an (origin, id) once, however often it is re-sent. It reports the ids its last snapshot covers (`durable`) and an
`epoch` (new per shard process), so an engine keeps what is not yet durable and re-sends it to a restarted shard.

Sequence numbers never go backwards across shard restarts: a shard process starts its counter at the wall clock in
microseconds (or above its snapshot's, whichever is higher), and a shard never stores a million rollouts a second,
so a cursor from a previous process never hides a new rollout.
"""

from __future__ import annotations

import array
import atexit
import hashlib
import logging
import os
import resource
import struct
import sys
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from das.drafter.records import RecordError, RolloutRecord
from das.scheduler.difficulty import DifficultyBook, dump_difficulty, load_difficulty
from das.service.config import HistoryConfig
from das.service.engine.contract import unstorable
from das.service.wire.api import ProblemSummary

log = logging.getLogger(__name__)

SNAPSHOT_FORMAT = "das-history-shard"
SNAPSHOT_VERSION = 3  # 2 added "received" (pushed ids by origin), 3 each rollout's sample key; 1 and 2 are still read
_SNAPSHOT_GLOB = "history-shard-*.msgpack*"  # both generations
# Container: magic, container version, body length (bytes), sha256 of the body; then the msgpack body. The magic's
# first byte is no msgpack map header, so a pre-container file (a bare msgpack map) is told apart by it.
_MAGIC = b"\x89DASHIST"
_CONTAINER_VERSION = 1
_HEADER = struct.Struct("<8sIQ32s")


class SnapshotError(ValueError):
    """A snapshot file that cannot be used; `reason` is a short tag that goes into the quarantined file's name."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


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
    sample_key: int | None = None  # the keyed-sampling key it drew with, where known (drafter/records.py)

    def key(self) -> tuple[int, int, bytes]:
        return self.policy_version, self.sample_index, self.output.tobytes()


@dataclass(slots=True)
class _Problem:
    prompt: array.array[int]  # int32, 4 bytes a token (a tuple of ints took ~36: 100k problems x 64 tokens, 230 MB)
    rollouts: deque[StoredRollout] = field(default_factory=deque)
    tokens: int = 0


@dataclass(frozen=True, slots=True)
class ShardStats:
    problems: int
    rollouts: int
    output_tokens: int
    resident_bytes: int  # resident memory of the shard's process now
    snapshot_fallbacks: int = 0  # restores from the previous generation because the newest was missing or bad
    snapshot_quarantined: int = 0  # snapshot files set aside as unreadable (at this process's start)
    snapshot_failures: int = 0  # snapshots that could not be written
    last_snapshot_unix_s: float | None = None  # when the snapshot on disk was written (None: there is none)


@dataclass(frozen=True, slots=True)
class PushReply:
    """What a shard says to `push`: how many records it stored now (not counting ids it already had or records too
    old for the window), its `epoch` (new per shard process) and `durable`: every id of the origin up to it is in
    the snapshot on disk (without a state directory, everything received: nothing more durable is possible)."""

    stored: int
    epoch: str
    durable: int


@dataclass(slots=True)
class _Received:
    """The ids one origin pushed to this shard: every id <= `floor`, and those in `above`."""

    floor: int = 0
    above: set[int] = field(default_factory=set)

    def add(self, rid: int) -> bool:
        """Records `rid`; False if it was already there."""
        if rid <= self.floor or rid in self.above:
            return False
        self.above.add(rid)
        self._compact()
        return True

    def settle(self, below: int) -> None:
        """Every id up to `below` counts as received (the pusher never sends them again)."""
        if below > self.floor:
            self.floor = below
            self.above = {i for i in self.above if i > below}
            self._compact()

    def _compact(self) -> None:
        while self.floor + 1 in self.above:
            self.floor += 1
            self.above.discard(self.floor)


class HistoryShard:
    """One shard; see the module docstring. Not thread-safe: Ray runs a (sync) actor's calls one at a time."""

    def __init__(self, index: int, config: HistoryConfig, state_dir: str | None = None) -> None:
        if not 0 <= index < config.shards:
            raise ValueError(f"shard index {index} outside [0, {config.shards})")
        self.index = index
        self.config = config
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.epoch = uuid.uuid4().hex
        self.difficulty = DifficultyBook()  # its own (longer) version window: lengths are cheap
        self._problems: OrderedDict[str, _Problem] = OrderedDict()  # least recently updated first
        self._tokens = 0
        # Above any sequence number a previous process of this shard gave out (see the module docstring).
        self._seq = time.time_ns() // 1000
        self._received: dict[str, _Received] = {}
        self._durable: dict[str, int] = {}  # origin -> the received floor the snapshot on disk holds
        self._dirty = False
        self._fallbacks = self._quarantined = self._failures = 0
        self._last_snapshot: float | None = None
        if self.state_dir is not None:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            self._restore()

    # ---- writes ----

    def put(self, origin: str, records: list[dict[str, Any]]) -> int:
        """Stores history-format records (validated here; a bad one, or one a snapshot could not hold, raises
        RecordError and stores nothing) in the given order. Returns how many were stored (a record older than the
        window is dropped). Not idempotent: a record put twice is stored twice (see `push`)."""
        return sum(self._add(origin, rec) for rec in self._parse(records))

    def push(self, origin: str, records: list[dict[str, Any]], ids: list[int], settled: int = 0) -> PushReply:
        """`put` by rollout identity: record i is (origin, ids[i]), and one already stored (a re-send after a
        timeout whose first send landed) is not stored again. `settled`: every id of the origin up to it was pushed
        or given up, never to be sent again (lets the shard forget ids). Bad ids or records raise and store
        nothing."""
        if len(ids) != len(records) or any(type(i) is not int or i < 1 for i in ids) or type(settled) is not int:
            raise RecordError("push: ids must be one positive integer per record")
        parsed = self._parse(records)
        received = self._received.setdefault(origin, _Received())
        received.settle(settled)
        fresh = [rec for rid, rec in zip(ids, parsed) if received.add(rid)]
        self._dirty = self._dirty or bool(fresh)  # the ids go into the snapshot even where no record was kept
        stored = sum(self._add(origin, rec) for rec in fresh)
        durable = received.floor if self.state_dir is None else self._durable.get(origin, 0)
        return PushReply(stored, self.epoch, durable)

    def _parse(self, records: list[dict[str, Any]]) -> list[RolloutRecord]:
        parsed = [RolloutRecord.from_dict(r) for r in records]
        for i, rec in enumerate(parsed):
            problem = unstorable(rec, f"record {i}")
            if problem:
                raise RecordError(problem)
        return parsed

    def _add(self, origin: str, rec: RolloutRecord, seq: int | None = None) -> bool:
        problem = self._problems.get(rec.problem_id)
        prompt = array.array("i", rec.prompt_token_ids)
        if problem is None or problem.prompt != prompt:
            # A problem id asked with another prompt: the old rollouts continue another text; drop them.
            if problem is not None:
                self._tokens -= problem.tokens
            problem = self._problems[rec.problem_id] = _Problem(prompt)
        newest = max((r.policy_version for r in problem.rollouts), default=rec.policy_version)
        if rec.policy_version <= newest - self.config.window_versions:
            return False
        if seq is None:
            self._seq += 1
            seq = self._seq
        else:  # restored from a snapshot
            self._seq = max(self._seq, seq)
        stored = StoredRollout(seq, origin, rec.policy_version, rec.sample_index,
                               array.array("i", rec.output_token_ids), rec.finish_reason, rec.reward,
                               rec.sample_key)
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
            prompt = problem.prompt.tolist()
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
        return ShardStats(len(self._problems), rollouts, self._tokens, resident_bytes(), self._fallbacks,
                          self._quarantined, self._failures, self._last_snapshot)

    # ---- snapshots ----

    def snapshot(self, force: bool = False) -> str | None:
        """Writes the shard to the state directory if anything changed since the last snapshot (or `force`);
        returns the file written, or None. The file it replaces becomes the previous generation. OSError if it
        could not be written (the files on disk are then as they were)."""
        if self.state_dir is None or not (self._dirty or force):
            return None
        floors = {origin: r.floor for origin, r in self._received.items()}
        doc = {"format": SNAPSHOT_FORMAT, "version": SNAPSHOT_VERSION, "shards": self.config.shards,
               "seq": self._seq, "received": {o: [r.floor, sorted(r.above)] for o, r in self._received.items()},
               "problems": [
            {"problem_id": pid, "prompt": p.prompt.tobytes(),
             "rollouts": [[r.seq, r.origin, r.policy_version, r.sample_index, r.output.tobytes(), r.finish_reason,
                           r.reward, r.sample_key] for r in p.rollouts],
             "difficulty": dump_difficulty(h) if (h := self.difficulty.get(pid)) is not None else None}
            for pid, p in self._problems.items()]}
        body = msgpack.packb(doc, use_bin_type=True)
        path = self._path()
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                f.write(_HEADER.pack(_MAGIC, _CONTAINER_VERSION, len(body), hashlib.sha256(body).digest()))
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            if path.exists():
                os.replace(path, self._path(previous=True))
            os.replace(tmp, path)  # a crash between the two renames leaves the previous generation: restored
            _fsync_dir(path.parent)
        except OSError:
            self._failures += 1
            tmp.unlink(missing_ok=True)
            raise
        self._dirty = False
        self._durable = floors
        self._last_snapshot = time.time()
        return str(path)

    def snapshot_on_exit(self) -> None:
        """The snapshot of a shard process that is stopping (SIGTERM, Ray's graceful exit): written if anything
        changed, failures logged, never raised (the process is going away)."""
        try:
            written = self.snapshot()
        except Exception:  # the last chance to save the history: say why it failed, never raise
            log.exception("history shard %d: snapshot at exit failed", self.index)
        else:
            if written:
                log.info("history shard %d: snapshot at exit: %s", self.index, written)

    def _restore(self) -> None:
        assert self.state_dir is not None
        for path in self.state_dir.glob(_SNAPSHOT_GLOB):
            if ".bad-" in path.name or ".tmp-" in path.name:
                continue  # quarantined or cut short: not a generation of any shard
            index = path.name.removeprefix("history-shard-").split(".", 1)[0]
            if not index.isdigit() or int(index) >= self.config.shards:
                raise ValueError(f"{path}: written by a store with more shards than {self.config.shards}; start "
                                 f"with the shard count the state directory was written with")
        for tmp in self.state_dir.glob(f"history-shard-{self.index}.msgpack.tmp-*"):
            tmp.unlink(missing_ok=True)  # a snapshot a crash cut short: never renamed into place, never read
        newest = self._path()
        for path in (newest, self._path(previous=True)):
            if not path.exists():
                continue
            try:
                shards, seq, received, rollouts, difficulties = _read_snapshot(path.read_bytes())
            except SnapshotError as exc:
                # A damaged snapshot must not stop the service (nor make it crash-loop); it is kept for
                # inspection under a name that says why, and the previous generation is tried.
                self._quarantined += 1
                bad = path.with_name(f"{path.name}.bad-{exc.reason}-{int(time.time())}")
                log.error("history shard %d: snapshot %s unreadable (%s); renamed to %s", self.index, path, exc,
                          bad.name)
                path.rename(bad)
                continue
            if shards != self.config.shards:
                raise ValueError(f"{path}: written by a store of {shards} shards, this one has "
                                 f"{self.config.shards}; start with the shard count the state directory was "
                                 f"written with")
            if path != newest:
                self._fallbacks += 1
                log.error("history shard %d: restored the previous snapshot %s (the newest was missing or bad)",
                          self.index, path)
            self._seq = max(self._seq, seq)
            self._received = {origin: _Received(floor, set(above)) for origin, (floor, above) in received.items()}
            self._durable = {origin: r.floor for origin, r in self._received.items()}
            for rseq, origin, record in rollouts:
                self._add(origin, record, seq=rseq)
            for history in difficulties:
                # The snapshot's record also holds the lengths and acceptance of rollouts trimmed from the window.
                self.difficulty.put(history)
            self._dirty = path != newest  # a fallback is written again as the newest soon
            self._last_snapshot = path.stat().st_mtime
            return

    def _path(self, previous: bool = False) -> Path:
        assert self.state_dir is not None
        return self.state_dir / f"history-shard-{self.index}.msgpack{'.prev' if previous else ''}"


class HistoryShardActor(HistoryShard):
    """The shard as the service runs it, a Ray actor: it snapshots on its own way out too (a SIGTERM to its worker,
    from `ray stop`, an operator or a node drain; Ray's worker turns SIGTERM into SystemExit, which runs atexit; a
    graceful actor exit calls `__ray_shutdown__`). A SIGKILL, an OOM kill or its raylet dying first runs neither:
    the last periodic snapshot is what survives, and the engines re-send what came after it."""

    def __init__(self, index: int, config: HistoryConfig, state_dir: str | None = None) -> None:
        super().__init__(index, config, state_dir)
        atexit.register(self.snapshot_on_exit)

    def __ray_shutdown__(self) -> None:
        self.snapshot_on_exit()


_Restored = tuple[int, int, dict[str, tuple[int, list[int]]], list[tuple[int, str, RolloutRecord]],
                  list[Any]]


def _read_snapshot(data: bytes) -> _Restored:
    """(shards, seq, received by origin, (seq, origin, record) per rollout, difficulty histories) of a snapshot
    file, every field checked; SnapshotError naming what is wrong otherwise."""
    if data[:1] == _MAGIC[:1]:
        if len(data) < _HEADER.size:
            raise SnapshotError("truncated", f"{len(data)} bytes, shorter than the header")
        magic, version, length, digest = _HEADER.unpack_from(data)
        if magic != _MAGIC:
            raise SnapshotError("format", "not a history snapshot (bad magic)")
        if version != _CONTAINER_VERSION:
            raise SnapshotError("version", f"container version {version}, this build reads {_CONTAINER_VERSION}")
        body = data[_HEADER.size:]
        if len(body) != length:
            raise SnapshotError("truncated", f"body of {len(body)} bytes, the header says {length}")
        if hashlib.sha256(body).digest() != digest:
            raise SnapshotError("checksum", "sha256 of the body does not match the header")
    else:
        body = data  # written before the container existed: used if it decodes and validates
    try:
        doc = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as exc:  # noqa: BLE001 -- msgpack raises several unrelated types; all mean "not msgpack"
        raise SnapshotError("format", f"not msgpack: {type(exc).__name__}: {exc}") from None
    try:
        return _validate(doc)
    except SnapshotError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError) as exc:  # RecordError
        raise SnapshotError("shape", f"{type(exc).__name__}: {exc}") from None


def _validate(doc: object) -> _Restored:
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise SnapshotError("shape", what)

    need(isinstance(doc, dict), f"top level is a {type(doc).__name__}, not a map")
    assert isinstance(doc, dict)
    need(doc.get("format") == SNAPSHOT_FORMAT and doc.get("version") in (1, 2, SNAPSHOT_VERSION),
         f"not a {SNAPSHOT_FORMAT} v1 to v{SNAPSHOT_VERSION} document")
    fields = 8 if doc["version"] >= 3 else 7
    shards, seq, problems = doc.get("shards"), doc.get("seq"), doc.get("problems")
    need(type(shards) is int and type(seq) is int and isinstance(problems, list), "shards, seq or problems")
    received: dict[str, tuple[int, list[int]]] = {}
    need(isinstance(doc.get("received", {}), dict), "received")
    for origin, entry in doc.get("received", {}).items():
        need(isinstance(origin, str) and isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is int
             and isinstance(entry[1], list) and all(type(i) is int for i in entry[1]), "received")
        received[origin] = (entry[0], entry[1])
    rollouts: list[tuple[int, str, RolloutRecord]] = []
    difficulties = []
    for entry in problems:
        need(isinstance(entry, dict) and isinstance(entry.get("problem_id"), str)
             and isinstance(entry.get("prompt"), bytes) and len(entry["prompt"]) % 4 == 0
             and isinstance(entry.get("rollouts"), list), "problem entry")
        pid = entry["problem_id"]
        prompt = array.array("i", entry["prompt"]).tolist()
        for r in entry["rollouts"]:
            need(isinstance(r, list) and len(r) == fields and type(r[0]) is int and isinstance(r[1], str)
                 and isinstance(r[4], bytes) and len(r[4]) % 4 == 0, f"rollout of {pid!r}")
            rseq, origin, version, index, output, reason, reward = r[:7]
            record = RolloutRecord(pid, version, index, prompt, array.array("i", output).tolist(), reason, reward,
                                   r[7] if fields == 8 else None)
            rollouts.append((rseq, origin, record))
        blob = entry.get("difficulty")
        need(blob is None or isinstance(blob, bytes), f"difficulty of {pid!r}")
        if blob is not None:
            difficulties.append(load_difficulty(blob))
    return shards, seq, received, rollouts, difficulties


def _fsync_dir(directory: Path) -> None:
    """Makes renames in `directory` durable (POSIX: a rename is in the directory's data)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _record(problem_id: str, prompt: list[int], r: StoredRollout) -> dict[str, Any]:
    d: dict[str, Any] = {"problem_id": problem_id, "policy_version": r.policy_version, "sample_index": r.sample_index,
                         "prompt_token_ids": prompt, "output_token_ids": r.output.tolist()}
    if r.finish_reason is not None:
        d["finish_reason"] = r.finish_reason
    if r.reward is not None:
        d["reward"] = r.reward
    if r.sample_key is not None:
        d["sample_key"] = r.sample_key
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
