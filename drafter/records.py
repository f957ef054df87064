"""The rollout history file: the interchange format of the whole project.

JSON Lines, one rollout a line, gzipped when the name ends in ``.gz`` (readers detect gzip by its magic bytes, so
the suffix does not matter when reading)::

    {"problem_id": str, "policy_version": int, "sample_index": int,
     "prompt_token_ids": [int], "output_token_ids": [int],
     "finish_reason": str | null, "reward": float | null,       # the last three are optional
     "sample_key": int | null}

Every error names the file, the 1-based line and the field, so a bad line in a million-line trace is found at once.
"""

from __future__ import annotations

import gzip
import json
import math
import numbers
import os
import uuid
import zlib
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

MAX_TOKEN_ID = 2**31 - 1  # token ids must fit an int32 (the native index stores them so)
_GZIP_MAGIC = b"\x1f\x8b"
_REQUIRED = ("problem_id", "policy_version", "sample_index", "prompt_token_ids", "output_token_ids")
_OPTIONAL = ("finish_reason", "reward", "sample_key")


class RecordError(ValueError):
    """A rollout that breaks the format. ``str()`` reads ``FILE:LINE: field 'NAME'[INDEX]: REASON``; the location
    parts are left out when unknown (a record built in memory has no file or line)."""

    def __init__(self, reason: str, *, field: str | None = None, index: int | None = None,
                 line: int | None = None, path: str | None = None) -> None:
        self.reason, self.field, self.index, self.line, self.path = reason, field, index, line, path
        parts = []
        if path is not None:
            parts.append(path if line is None else f"{path}:{line}")
        elif line is not None:
            parts.append(f"line {line}")
        if field is not None:
            parts.append(f"field {field!r}" + (f"[{index}]" if index is not None else ""))
        super().__init__(": ".join([*parts, reason]))

    def located(self, *, line: int | None = None, path: str | None = None) -> RecordError:
        """The same error with the line and/or file filled in."""
        return RecordError(self.reason, field=self.field, index=self.index,
                           line=self.line if line is None else line, path=self.path if path is None else path)


def _is_int(v: object) -> bool:
    # bool is an int subclass in Python, but `true` is never a valid id, version or index.
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _tokens(name: str, ids: object, *, allow_empty: bool) -> tuple[int, ...]:
    if not isinstance(ids, (list, tuple, np.ndarray)):
        raise RecordError(f"expected a list of token ids, got {type(ids).__name__}", field=name)
    out = tuple(ids)
    # Fast path for the common case (JSON gives plain ints); the slow loop only runs to name the bad element.
    if not (out and all(type(t) is int for t in out) and 0 <= min(out) and max(out) <= MAX_TOKEN_ID):
        for i, t in enumerate(out):
            if not _is_int(t):
                raise RecordError(f"token id {t!r} is not an int", field=name, index=i)
            if not 0 <= t <= MAX_TOKEN_ID:
                raise RecordError(f"token id {t} outside [0, {MAX_TOKEN_ID}]", field=name, index=i)
        out = tuple(int(t) for t in out)
    if not out and not allow_empty:
        raise RecordError("must not be empty", field=name)
    return out


@dataclass(frozen=True, slots=True)
class RolloutRecord:
    """One finished rollout: sample ``sample_index`` of problem ``problem_id`` under policy ``policy_version``.

    ``sample_key``: the keyed-sampling key the sample drew with (service/wire/sample_keys.py), where the writer
    knows it: samples of one problem with the same key at different versions are coupled (the drafter's same-key
    source, drafter/history.py).

    Invariants (checked on construction, RecordError otherwise): ``problem_id`` non-empty; version and index ints
    >= 0; token ids ints in [0, 2**31-1], stored as tuples; the prompt is non-empty, the output may be empty;
    ``reward`` finite or None; ``sample_key`` an int64 or None. Lists and numpy ints are accepted and normalised
    to tuples of int.
    """

    problem_id: str
    policy_version: int
    sample_index: int
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    finish_reason: str | None = None
    reward: float | None = None
    sample_key: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.problem_id, str) or not self.problem_id:
            raise RecordError("must be a non-empty string", field="problem_id")
        for name in ("policy_version", "sample_index"):
            v = getattr(self, name)
            if not _is_int(v) or v < 0:
                raise RecordError(f"must be an int >= 0, got {v!r}", field=name)
            object.__setattr__(self, name, int(v))
        object.__setattr__(self, "prompt_token_ids", _tokens("prompt_token_ids", self.prompt_token_ids,
                                                             allow_empty=False))
        object.__setattr__(self, "output_token_ids", _tokens("output_token_ids", self.output_token_ids,
                                                             allow_empty=True))
        if self.finish_reason is not None and not isinstance(self.finish_reason, str):
            raise RecordError(f"must be a string or null, got {type(self.finish_reason).__name__}",
                              field="finish_reason")
        if self.reward is not None:
            r = self.reward
            try:  # float() of a huge int overflows: that is not a finite float either
                ok = isinstance(r, numbers.Real) and not isinstance(r, (bool, np.bool_)) and math.isfinite(float(r))
            except OverflowError:
                ok = False
            if not ok:
                raise RecordError(f"must be a finite number or null, got {r!r}", field="reward")
            object.__setattr__(self, "reward", float(r))
        if self.sample_key is not None:
            if not _is_int(self.sample_key) or not -2**63 <= self.sample_key < 2**63:
                raise RecordError(f"must be an int64 or null, got {self.sample_key!r}", field="sample_key")
            object.__setattr__(self, "sample_key", int(self.sample_key))

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of one line; optional fields are left out when None."""
        d: dict[str, Any] = {"problem_id": self.problem_id, "policy_version": self.policy_version,
                             "sample_index": self.sample_index, "prompt_token_ids": list(self.prompt_token_ids),
                             "output_token_ids": list(self.output_token_ids)}
        for name in _OPTIONAL:
            if getattr(self, name) is not None:
                d[name] = getattr(self, name)
        return d

    @classmethod
    def from_dict(cls, d: object, line: int | None = None) -> RolloutRecord:
        """Validate one parsed line; ``line`` (1-based) only goes into error messages. Unknown keys are errors."""
        try:
            if not isinstance(d, dict):
                raise RecordError(f"expected a JSON object, got {type(d).__name__}")
            for key in d:
                if key not in _REQUIRED and key not in _OPTIONAL:
                    raise RecordError("not a field of the format", field=key)
            for key in _REQUIRED:
                if key not in d:
                    raise RecordError("missing", field=key)
            return cls(**d)
        except RecordError as exc:
            raise exc.located(line=line) from None


def _lines(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as raw:
        gz = raw.read(2) == _GZIP_MAGIC
        raw.seek(0)
        if gz:
            with gzip.GzipFile(fileobj=raw, mode="rb") as text:
                yield from text
        else:
            yield from raw


def read_rollouts(path: str | os.PathLike[str]) -> Iterator[RolloutRecord]:
    """Stream the records of a history file (plain or gzipped), skipping blank lines. Raises RecordError naming
    file and line for bad JSON, bad records, non-UTF-8 text and truncated or corrupt gzip data."""
    path = Path(path)
    lineno = 0
    lines = _lines(path)
    while True:
        try:
            raw = next(lines)
        except StopIteration:
            return
        except (EOFError, zlib.error, gzip.BadGzipFile) as exc:  # truncated or corrupt gzip stream
            raise RecordError(f"corrupt gzip data: {exc}", line=lineno + 1, path=str(path)) from None
        lineno += 1
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except UnicodeDecodeError as exc:
            raise RecordError(f"not UTF-8: {exc.reason}", line=lineno, path=str(path)) from None
        except json.JSONDecodeError as exc:
            raise RecordError(f"invalid JSON: {exc.msg} (column {exc.colno})", line=lineno, path=str(path)) from None
        except ValueError as exc:  # e.g. an integer literal past Python's digit limit
            raise RecordError(f"invalid JSON: {exc}", line=lineno, path=str(path)) from None
        try:
            rec = RolloutRecord.from_dict(obj, line=lineno)
        except RecordError as exc:
            raise exc.located(path=str(path)) from None
        yield rec


def load_rollouts(path: str | os.PathLike[str]) -> list[RolloutRecord]:
    """All records of a history file, in file order."""
    return list(read_rollouts(path))


def write_rollouts(path: str | os.PathLike[str], records: Iterable[RolloutRecord]) -> int:
    """Write records one a line (gzipped when the name ends in ``.gz``) and return how many. Atomic: a reader sees
    the old file or the complete new one, never a partial one (temp file in the same directory, then os.replace)."""
    path = Path(path)
    # Our own temp name opened with "xb" (not mkstemp) so that the final file gets the umask's mode, not 0600.
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "xb") as raw:
            if path.name.endswith(".gz"):
                # Fixed header name and mtime=0: the same records give the same bytes (comparable by hash).
                with gzip.GzipFile(filename=path.name, fileobj=raw, mode="wb", mtime=0) as gz:
                    count = _write_lines(gz, records)
            else:
                count = _write_lines(raw, records)
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    # Sync the directory too, so the rename itself survives a crash (history snapshots rely on it).
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return count


def _write_lines(out: BinaryIO, records: Iterable[RolloutRecord]) -> int:
    count = 0
    for rec in records:
        if not isinstance(rec, RolloutRecord):
            raise TypeError(f"expected RolloutRecord, got {type(rec).__name__}")
        # ASCII-only JSON (non-ASCII escaped): any str, even with lone surrogates, encodes and reads back.
        out.write(json.dumps(rec.to_dict(), separators=(",", ":")).encode("ascii") + b"\n")
        count += 1
    return count


@dataclass(frozen=True, slots=True)
class LengthStats:
    """Output lengths (tokens) of a set of rollouts. Quantiles use numpy's default linear interpolation.
    ``straggler_ratio`` = max / median; None when the median is 0."""

    min: int
    p10: float
    p50: float
    p90: float
    p99: float
    max: int
    mean: float
    straggler_ratio: float | None

    @classmethod
    def of(cls, lengths: list[int]) -> LengthStats:
        """Summarise a non-empty list of lengths."""
        a = np.asarray(lengths, dtype=np.int64)
        p10, p50, p90, p99 = (float(q) for q in np.quantile(a, [0.1, 0.5, 0.9, 0.99]))
        hi = int(a.max())
        return cls(int(a.min()), p10, p50, p90, p99, hi, float(a.mean()), hi / p50 if p50 > 0 else None)


@dataclass(frozen=True, slots=True)
class VersionStats:
    """The rollouts of one policy version, which is one batch for the straggler ratio."""

    policy_version: int
    rollouts: int
    problems: int
    output_lengths: LengthStats
    mean_reward: float | None


@dataclass(frozen=True, slots=True)
class HistoryStats:
    """Summary of a history file. A *batch* is all rollouts of one policy version, so the per-version
    ``straggler_ratio`` (max / median output length) is the per-batch figure of the metrics; ``output_lengths``
    pools the whole file, and ``mean_straggler_ratio`` averages the per-batch ratios. Token counts are in tokens;
    ``finish_reasons`` counts only rollouts that have one; rewards average over the rollouts that have one."""

    path: str
    rollouts: int
    problems: int
    policy_versions: int
    prompt_tokens: int
    output_tokens: int
    output_lengths: LengthStats | None  # None for an empty file
    mean_straggler_ratio: float | None
    versions: tuple[VersionStats, ...]
    finish_reasons: dict[str, int]
    mean_reward: float | None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (versions as a list, in increasing version order)."""
        d = asdict(self)
        d["versions"] = list(d["versions"])
        return d

    def print(self, console: Console) -> None:
        """Render as rich tables."""
        # Path and finish reasons come from outside: escaped so that rich does not read them as markup.
        summary = Table(title="History", show_header=False, box=box.SIMPLE_HEAD)
        summary.add_row("file", escape(self.path))
        for key in ("rollouts", "problems", "policy_versions", "prompt_tokens", "output_tokens",
                    "mean_straggler_ratio", "mean_reward"):
            summary.add_row(key.replace("_", " "), _fmt(getattr(self, key), 3))
        console.print(summary)
        lengths = Table(title="Output length (tokens) per policy version = batch", box=box.SIMPLE_HEAD,
                        collapse_padding=True, pad_edge=False)
        for col in ("version", "n", "probs", "min", "p10", "p50", "p90", "p99", "max", "mean", "max/p50",
                    "reward"):
            lengths.add_column(col, justify="right")
        for v in self.versions:
            lengths.add_row(str(v.policy_version), str(v.rollouts), str(v.problems),
                            *_length_cells(v.output_lengths), _fmt(v.mean_reward, 3))
        if self.output_lengths is not None:
            lengths.add_section()
            lengths.add_row("all", str(self.rollouts), str(self.problems), *_length_cells(self.output_lengths),
                            _fmt(self.mean_reward, 3))
        console.print(lengths)
        if self.finish_reasons:
            reasons = Table(title="Finish reasons", box=box.SIMPLE_HEAD)
            reasons.add_column("reason")
            reasons.add_column("rollouts", justify="right")
            for reason, n in sorted(self.finish_reasons.items(), key=lambda kv: -kv[1]):
                reasons.add_row(escape(reason), str(n))
            console.print(reasons)


def _fmt(v: float | int | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _length_cells(s: LengthStats) -> list[str]:
    # Lengths in whole tokens (enough for a glance; --json has the exact values), the ratio to 2 decimals.
    return [*(_fmt(x) for x in (s.min, s.p10, s.p50, s.p90, s.p99, s.max, s.mean)), _fmt(s.straggler_ratio, 2)]


def history_stats(path: str | os.PathLike[str]) -> HistoryStats:
    """Stream a history file once and summarise it (see HistoryStats). Memory: one int per rollout plus the
    problem ids."""
    lengths: defaultdict[int, list[int]] = defaultdict(list)
    problems: defaultdict[int, set[str]] = defaultdict(set)
    rewards: defaultdict[int, list[float]] = defaultdict(list)
    reasons: Counter[str] = Counter()
    prompt_tokens = 0
    for rec in read_rollouts(path):
        lengths[rec.policy_version].append(len(rec.output_token_ids))
        problems[rec.policy_version].add(rec.problem_id)
        prompt_tokens += len(rec.prompt_token_ids)
        if rec.reward is not None:
            rewards[rec.policy_version].append(rec.reward)
        if rec.finish_reason is not None:
            reasons[rec.finish_reason] += 1
    versions = tuple(
        VersionStats(v, len(lengths[v]), len(problems[v]), LengthStats.of(lengths[v]),
                     float(np.mean(rewards[v])) if rewards[v] else None)
        for v in sorted(lengths))
    pooled = [n for v in sorted(lengths) for n in lengths[v]]
    ratios = [v.output_lengths.straggler_ratio for v in versions if v.output_lengths.straggler_ratio is not None]
    all_rewards = [r for v in sorted(rewards) for r in rewards[v]]
    return HistoryStats(
        path=str(path), rollouts=len(pooled), problems=len(set().union(*problems.values())),
        policy_versions=len(versions), prompt_tokens=prompt_tokens, output_tokens=sum(pooled),
        output_lengths=LengthStats.of(pooled) if pooled else None,
        mean_straggler_ratio=float(np.mean(ratios)) if ratios else None, versions=versions,
        finish_reasons=dict(reasons), mean_reward=float(np.mean(all_rewards)) if all_rewards else None)
