"""Difficulty history per problem: how long its recent rollouts ran, how they ended, how well drafts were accepted.

This is the input of length prediction (``das.scheduler.length``) and of the draft budget policy. It is small by
construction: per problem at most ``window`` policy versions x ``max_per_version`` lengths, at most
``MAX_FINISH_REASONS`` finish-reason counters per version, and two ``k_max``-long acceptance arrays. It travels
with the drafter history (HistoryStore snapshots, pull at dispatch) as one msgpack blob per problem.

Serialized layout (format "das-difficulty-history", version 1), a msgpack map with exactly these keys::

    {"format": str, "version": 1, "problem_id": str,
     "window": int, "max_per_version": int, "k_max": int,
     "versions": [{"policy_version": int, "lengths": bytes,          # int32 little-endian, tokens, in arrival order
                   "finish_reasons": {str: int}}],                     # strictly increasing policy_version
     "proposed": bytes, "accepted": bytes}                             # int64 little-endian, k_max each
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import msgpack
import numpy as np

from das.drafter.msgpack_document import decode_document, require_field
from das.drafter.records import RolloutRecord

FORMAT = "das-difficulty-history"
VERSION = 1

DEFAULT_WINDOW = 4
DEFAULT_MAX_PER_VERSION = 64
DEFAULT_K_MAX = 16
# Hard limits, enforced on construction and on load, so that a hostile blob cannot make us allocate much.
MAX_WINDOW = 1024
MAX_PER_VERSION = 1 << 16
MAX_K = 1024
MAX_LENGTH = 2**31 - 1  # tokens; lengths are stored as int32
MAX_COUNT = 2**63 - 1  # counters are int64
# Finish reasons come from engines ("stop", "length", "abort"), but a record may carry any string: only this many
# distinct reasons of at most MAX_REASON_CHARS characters are kept per version, the rest are counted as OTHER_REASON.
MAX_FINISH_REASONS = 16
MAX_REASON_CHARS = 64
OTHER_REASON = "<other>"

_NO_LENGTHS = np.zeros(0, dtype=np.int64)
_NO_LENGTHS.flags.writeable = False
_TOP_KEYS = frozenset({"format", "version", "problem_id", "window", "max_per_version", "k_max", "versions",
                       "proposed", "accepted"})
_VERSION_KEYS = frozenset({"policy_version", "lengths", "finish_reasons"})


class DifficultyFormatError(ValueError):
    """A serialized difficulty history that cannot be loaded; the message says which part is wrong."""


class _Clock:
    """A change counter shared by the histories of one book, so that the book can tell in O(1) whether any
    length changed since it cached its global prior (histories may be updated directly, not only via the book)."""

    __slots__ = ("ticks",)

    def __init__(self) -> None:
        self.ticks = 0


class _VersionBucket:
    """Lengths (tokens, most recent ``maxlen``) and finish-reason counts of one policy version."""

    __slots__ = ("lengths", "reasons")

    def __init__(self, maxlen: int) -> None:
        self.lengths: deque[int] = deque(maxlen=maxlen)
        self.reasons: dict[str, int] = {}

    def count_reason(self, reason: str) -> None:
        named = len(self.reasons) - (OTHER_REASON in self.reasons)
        if reason not in self.reasons and (len(reason) > MAX_REASON_CHARS or named >= MAX_FINISH_REASONS - 1):
            # At most MAX_FINISH_REASONS - 1 named reasons, so with OTHER_REASON the map stays within the bound.
            reason = OTHER_REASON
        self.reasons[reason] = self.reasons.get(reason, 0) + 1


def _is_int(v: object) -> bool:
    # numpy ints are fine; bool is an int subclass in Python but never a valid length or count.
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _check_limit(name: str, value: object, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= hi:
        raise ValueError(f"{name} must be an int in [1, {hi}], got {value!r}")
    return value


class DifficultyHistory:
    """The difficulty history of one problem.

    Invariants: at most ``window`` policy versions are held, always the highest seen (a length of an older version
    than all held ones, with the window full, is ignored); each holds between 1 and ``max_per_version`` lengths
    (the most recently added; lengths are output tokens, in [0, 2**31-1]); ``proposed[i]`` / ``accepted[i]``
    count the verification steps whose draft had a token at position i (0-based) / had it accepted, so both are
    non-increasing in i and ``accepted <= proposed`` element-wise. Finish-reason counts are kept per held version
    and leave with it.
    """

    __slots__ = ("problem_id", "window", "max_per_version", "k_max", "proposed", "accepted", "_versions", "_clock",
                 "_all")

    def __init__(self, problem_id: str, *, window: int = DEFAULT_WINDOW,
                 max_per_version: int = DEFAULT_MAX_PER_VERSION, k_max: int = DEFAULT_K_MAX) -> None:
        if not isinstance(problem_id, str) or not problem_id:
            raise ValueError("problem_id must be a non-empty string")
        self.problem_id = problem_id
        self.window = _check_limit("window", window, MAX_WINDOW)
        self.max_per_version = _check_limit("max_per_version", max_per_version, MAX_PER_VERSION)
        self.k_max = _check_limit("k_max", k_max, MAX_K)
        self.proposed = np.zeros(self.k_max, dtype=np.int64)
        self.accepted = np.zeros(self.k_max, dtype=np.int64)
        self._versions: dict[int, _VersionBucket] = {}
        self._clock = _Clock()
        self._all: np.ndarray | None = None  # lengths() of all held versions, dropped on every change

    @property
    def revision(self) -> int:
        """Increases whenever a length is added (a history adopted by a book shares the book's counter)."""
        return self._clock.ticks

    @property
    def policy_versions(self) -> list[int]:
        """The versions held, increasing."""
        return sorted(self._versions)

    def add_length(self, policy_version: int, length: int, finish_reason: str | None = None) -> bool:
        """Record one finished rollout of ``length`` output tokens. Returns False (and records nothing) when the
        version is older than every held version and the window is full; evicts the oldest version when a new one
        overflows the window. ``finish_reason`` None is not counted."""
        if not _is_int(policy_version) or policy_version < 0:
            raise ValueError(f"policy_version must be an int >= 0, got {policy_version!r}")
        if not _is_int(length) or not 0 <= length <= MAX_LENGTH:
            raise ValueError(f"length must be an int in [0, {MAX_LENGTH}] tokens, got {length!r}")
        policy_version, length = int(policy_version), int(length)
        bucket = self._versions.get(policy_version)
        if bucket is None:
            if len(self._versions) >= self.window and policy_version < min(self._versions):
                return False
            bucket = self._versions[policy_version] = _VersionBucket(self.max_per_version)
            if len(self._versions) > self.window:
                del self._versions[min(self._versions)]
        bucket.lengths.append(length)
        if finish_reason is not None:
            bucket.count_reason(finish_reason)
        self._clock.ticks += 1
        self._all = None
        return True

    def lengths(self, policy_version: int | None = None) -> np.ndarray:
        """Output lengths (tokens, int64, read-only) of one held version, or of all held versions (oldest version
        first) when ``policy_version`` is None; empty when there are none. The latter is cached until the next
        change, since length prediction asks for it at every scheduling step."""
        if policy_version is not None:
            bucket = self._versions.get(policy_version)
            out = np.fromiter(bucket.lengths if bucket else (), dtype=np.int64)
        elif self._all is not None:
            return self._all
        else:
            n = sum(len(b.lengths) for b in self._versions.values())
            out = self._all = np.fromiter((x for _, b in self._buckets() for x in b.lengths), dtype=np.int64,
                                          count=n)
        out.flags.writeable = False
        return out

    def finish_reasons(self) -> dict[str, int]:
        """Finish-reason counts over the held versions (every rollout added, not only the lengths kept)."""
        out: dict[str, int] = {}
        for bucket in self._versions.values():
            for reason, n in bucket.reasons.items():
                out[reason] = out.get(reason, 0) + n
        return out

    def record_acceptance(self, proposed_len: int, accepted: int) -> None:
        """Add one verification step that proposed a draft of ``proposed_len`` tokens of which the first
        ``accepted`` were accepted (0 <= accepted <= proposed_len). Positions >= ``k_max`` are not tracked."""
        if not (_is_int(proposed_len) and _is_int(accepted)):
            raise ValueError(f"proposed_len and accepted must be ints, got {proposed_len!r}, {accepted!r}")
        if not 0 <= accepted <= proposed_len:
            raise ValueError(f"need 0 <= accepted <= proposed_len, got accepted={accepted}, "
                             f"proposed_len={proposed_len}")
        self.proposed[:min(int(proposed_len), self.k_max)] += 1
        self.accepted[:min(int(accepted), self.k_max)] += 1

    def acceptance_rate(self) -> np.ndarray:
        """Per position i, the fraction of drafts reaching position i whose token i was accepted (float64, NaN where
        nothing was proposed). Not conditional on position i-1: token i is only accepted if all before it were."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.proposed > 0, self.accepted / np.maximum(self.proposed, 1), np.nan)

    def _buckets(self) -> Iterator[tuple[int, _VersionBucket]]:
        for v in sorted(self._versions):
            yield v, self._versions[v]


class DifficultyBook:
    """Difficulty histories by problem id, all with the same bounds.

    ``all_lengths()`` (the global prior of length prediction) is cached and recomputed only after a length
    changed anywhere in the book; ``revision`` says when that happens.
    """

    __slots__ = ("window", "max_per_version", "k_max", "_histories", "_clock", "_all", "_all_key")

    def __init__(self, *, window: int = DEFAULT_WINDOW, max_per_version: int = DEFAULT_MAX_PER_VERSION,
                 k_max: int = DEFAULT_K_MAX) -> None:
        self.window = _check_limit("window", window, MAX_WINDOW)
        self.max_per_version = _check_limit("max_per_version", max_per_version, MAX_PER_VERSION)
        self.k_max = _check_limit("k_max", k_max, MAX_K)
        self._histories: dict[str, DifficultyHistory] = {}
        self._clock = _Clock()
        self._all: np.ndarray = np.zeros(0, dtype=np.int64)
        self._all_key = -1

    @property
    def revision(self) -> int:
        """Increases whenever a length is added to any history of the book or a history is put in or removed."""
        return self._clock.ticks

    def __len__(self) -> int:
        return len(self._histories)

    def __contains__(self, problem_id: object) -> bool:
        return problem_id in self._histories

    def __iter__(self) -> Iterator[str]:
        return iter(self._histories)

    def get(self, problem_id: str) -> DifficultyHistory | None:
        """The history of a problem, or None if the book has none."""
        return self._histories.get(problem_id)

    def history(self, problem_id: str) -> DifficultyHistory:
        """The history of a problem, created empty if missing."""
        h = self._histories.get(problem_id)
        if h is None:
            h = DifficultyHistory(problem_id, window=self.window, max_per_version=self.max_per_version,
                                  k_max=self.k_max)
            self._adopt(h)
        return h

    def put(self, history: DifficultyHistory) -> None:
        """Install a history (e.g. from ``load_difficulty``), replacing that problem's. Its bounds must be the
        book's. The history then belongs to this book: its revision is the book's."""
        if (history.window, history.max_per_version, history.k_max) != (self.window, self.max_per_version,
                                                                        self.k_max):
            raise ValueError(f"history bounds (window={history.window}, max_per_version={history.max_per_version}, "
                             f"k_max={history.k_max}) differ from the book's ({self.window}, "
                             f"{self.max_per_version}, {self.k_max})")
        self._adopt(history)

    def remove(self, problem_id: str) -> None:
        """Forget a problem (no error if unknown)."""
        if self._histories.pop(problem_id, None) is not None:
            self._clock.ticks += 1

    def add_record(self, rec: RolloutRecord) -> bool:
        """Add the output length and finish reason of a finished rollout; see ``DifficultyHistory.add_length``."""
        return self.history(rec.problem_id).add_length(rec.policy_version, len(rec.output_token_ids),
                                                       rec.finish_reason)

    def add_records(self, records: Iterable[RolloutRecord]) -> int:
        """Add records in the given order (feed versions in increasing order: see the window rule of
        ``DifficultyHistory.add_length``). Returns how many were kept."""
        return sum(self.add_record(rec) for rec in records)

    def lengths(self, problem_id: str) -> np.ndarray:
        """Output lengths (tokens, int64) of a problem's held versions; empty for an unknown problem."""
        h = self._histories.get(problem_id)
        return h.lengths() if h is not None else _NO_LENGTHS

    def all_lengths(self) -> np.ndarray:
        """All held lengths of all problems (tokens, int64, read-only): the global prior. O(1) when nothing
        changed since the last call, else O(total lengths held)."""
        if self._all_key != self._clock.ticks:
            parts = [h.lengths() for h in self._histories.values()]
            self._all = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
            self._all.flags.writeable = False
            self._all_key = self._clock.ticks
        return self._all

    def _adopt(self, h: DifficultyHistory) -> None:
        h._clock = self._clock  # noqa: SLF001 -- the book and its histories share one change counter
        self._histories[h.problem_id] = h
        self._clock.ticks += 1


def dump_difficulty(h: DifficultyHistory) -> bytes:
    """Serialize one problem's history (layout in the module docstring). Deterministic: equal histories give
    equal bytes."""
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "problem_id": h.problem_id,
        "window": h.window,
        "max_per_version": h.max_per_version,
        "k_max": h.k_max,
        "versions": [{"policy_version": v, "lengths": np.asarray(b.lengths, dtype="<i4").tobytes(),
                      "finish_reasons": dict(sorted(b.reasons.items()))} for v, b in h._buckets()],  # noqa: SLF001
        "proposed": h.proposed.astype("<i8").tobytes(),
        "accepted": h.accepted.astype("<i8").tobytes(),
    }
    return msgpack.packb(doc, use_bin_type=True)


def load_difficulty(data: bytes) -> DifficultyHistory:
    """Parse and validate a blob from ``dump_difficulty``. Every invariant of ``DifficultyHistory`` and every
    hard limit of this module is checked; anything wrong raises ``DifficultyFormatError`` (never another
    exception) naming the part. The result is a standalone history (``DifficultyBook.put`` installs it)."""
    doc = _decode(data)
    problem_id = _field(doc, "problem_id", str)
    if not problem_id:
        raise DifficultyFormatError("problem_id must be a non-empty string")
    bounds = {name: _int_field(doc, name, 1, hi)
              for name, hi in (("window", MAX_WINDOW), ("max_per_version", MAX_PER_VERSION), ("k_max", MAX_K))}
    h = DifficultyHistory(problem_id, **bounds)
    entries = _field(doc, "versions", list)
    if len(entries) > h.window:
        raise DifficultyFormatError(f"versions holds {len(entries)} entries, more than window={h.window}")
    previous = -1
    for i, entry in enumerate(entries):
        where = f"versions[{i}]"
        if not isinstance(entry, dict):
            raise DifficultyFormatError(f"{where} must be a map, got {type(entry).__name__}")
        _exact_keys(entry, _VERSION_KEYS, where)
        version = _int_field(entry, "policy_version", 0, MAX_COUNT, f"{where}.")
        if version <= previous:
            raise DifficultyFormatError(f"{where}.policy_version {version} is not increasing")
        previous = version
        lengths = _array(entry, "lengths", "<i4", None, f"{where}.")
        if not 1 <= lengths.size <= h.max_per_version:
            raise DifficultyFormatError(f"{where}.lengths holds {lengths.size} lengths, need 1 to "
                                        f"max_per_version={h.max_per_version}")
        if int(lengths.min()) < 0:
            raise DifficultyFormatError(f"{where}.lengths holds a negative length")
        reasons = _field(entry, "finish_reasons", dict, f"{where}.")
        # The bound of _VersionBucket.count_reason, so that a loaded history can keep counting within it.
        if len(reasons) - (OTHER_REASON in reasons) > MAX_FINISH_REASONS - 1:
            raise DifficultyFormatError(f"{where}.finish_reasons holds more than {MAX_FINISH_REASONS - 1} reasons "
                                        f"besides {OTHER_REASON!r}")
        for reason, n in reasons.items():
            if not isinstance(reason, str) or not reason or len(reason) > MAX_REASON_CHARS:
                raise DifficultyFormatError(f"{where}.finish_reasons: key {reason!r} is not a string of 1 to "
                                            f"{MAX_REASON_CHARS} characters")
            if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_COUNT:
                raise DifficultyFormatError(f"{where}.finish_reasons[{reason!r}] must be an int count >= 0, "
                                            f"got {n!r}")
        bucket = h._versions[version] = _VersionBucket(h.max_per_version)  # noqa: SLF001
        bucket.lengths.extend(int(x) for x in lengths)
        bucket.reasons = dict(reasons)
    proposed = _array(doc, "proposed", "<i8", h.k_max)
    accepted = _array(doc, "accepted", "<i8", h.k_max)
    if int(proposed.min()) < 0 or int(accepted.min()) < 0:
        raise DifficultyFormatError("proposed/accepted hold a negative count")
    if np.any(accepted > proposed):
        raise DifficultyFormatError("accepted exceeds proposed at some draft position")
    if np.any(np.diff(proposed) > 0) or np.any(np.diff(accepted) > 0):
        # A draft reaching position i also reached every position before it; same for an accepted prefix.
        raise DifficultyFormatError("proposed/accepted must be non-increasing over draft positions")
    h.proposed[:] = proposed
    h.accepted[:] = accepted
    return h


def _decode(data: object) -> dict[str, Any]:
    doc = decode_document(data, FORMAT, VERSION, DifficultyFormatError)
    _exact_keys(doc, _TOP_KEYS, "document")
    return doc


def _exact_keys(doc: dict[Any, Any], expected: frozenset[str], where: str) -> None:
    missing = sorted(expected - doc.keys())
    if missing:
        raise DifficultyFormatError(f"{where}: missing field(s) {', '.join(missing)}")
    extra = [k for k in doc if k not in expected]
    if extra:
        raise DifficultyFormatError(f"{where}: unknown field(s) {', '.join(repr(k) for k in extra)}")


def _field(doc: dict[str, Any], name: str, kind: type, prefix: str = "") -> Any:
    return require_field(doc, name, kind, DifficultyFormatError, prefix)


def _int_field(doc: dict[str, Any], name: str, lo: int, hi: int, prefix: str = "") -> int:
    value = _field(doc, name, int, prefix)
    if not lo <= value <= hi:
        raise DifficultyFormatError(f"field {prefix}{name} = {value} outside [{lo}, {hi}]")
    return value


def _array(doc: dict[str, Any], name: str, dtype: str, size: int | None, prefix: str = "") -> np.ndarray:
    blob = _field(doc, name, bytes, prefix)
    width = np.dtype(dtype).itemsize
    if len(blob) % width or (size is not None and len(blob) != size * width):
        expected = f"{size} x {width}" if size is not None else f"a multiple of {width}"
        raise DifficultyFormatError(f"field {prefix}{name} must be {expected} bytes ({dtype}), got {len(blob)}")
    # Native-endian int64 copy: the stored bytes are little-endian whatever the machine.
    return np.frombuffer(blob, dtype=dtype).astype(np.int64)

