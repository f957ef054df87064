"""`BatchJournal`: the gateway's record of the batches it accepted, so that a restart of the service does not run a
batch a second time when a trainer retries its id (docs/design.md, "Failure behaviour").

One file, `<state_dir>/batch-journal.jsonl`, append-only, one record a line: `<crc32 of the JSON, 8 hex> <JSON>`.
A batch gets an `accepted` record before it runs (batch id, sha256 digest of the request, samples asked for, time)
and an `ended` record when it ends (status, samples it produced, time). Nothing else: no prompts, no tokens, no
bearer token; the digest is of the request's groups and options, as the gateway fingerprints a batch. Each record is
written with one `write` and fsynced (`BatchJournalConfig.fsync`) before the gateway goes on, so an accepted batch
is on disk before its first sample is asked for.

Reading at start: a last record cut short or failing its checksum is a torn tail (the write the process died in):
dropped and counted (`torn_records`). Any other damage (a bad record followed by good ones, a first line that is not
this format's header) quarantines the file: it is renamed `<name>.bad-<reason>-<unix time>` and kept for inspection,
and the service starts with the records that check out (none from a file of another format or version). After
reading, the journal is rewritten compacted (one `accepted` and at most one `ended` record per batch, newest batches
only, to a temporary file, fsynced, renamed into place), so appends never follow a torn line; if that fails, nothing
is recorded in this run (logged and counted: batches run, unprotected). Bounded: when an append takes the file past
`max_bytes` it is compacted again, keeping the newest batches whose records fit in half of it (batches without an
end, running or cut off by a crash, are always kept); at ~300 bytes an ended batch (32-character ids) the default
remembers the newest ~7,000 batches at least.

A batch of an earlier run whose `ended` record is missing (the process was killed) or says it was cut off by the
shutdown reads back as `interrupted`, with the samples it produced unknown in the first case.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal


from das.service.config import BatchJournalConfig
from das.service.http.checksummed_lines import decode_line, encode_line, replace_file
from das.service.wire.api import BatchFromPreviousRun, EndStatus

log = logging.getLogger(__name__)

JOURNAL_FILE = "batch-journal.jsonl"
_FORMAT = "das-batch-journal"
_VERSION = 1

_END_STATUSES = frozenset({"done", "failed", "aborted", "interrupted"})


@dataclass(slots=True)
class JournalEntry:
    """One batch as the journal knows it. `status` "accepted": not ended (in this run: running)."""

    batch_id: str
    digest: str
    samples_expected: int
    accepted_unix_s: float
    previous_run: bool
    status: Literal["accepted", "done", "failed", "aborted", "interrupted"] = "accepted"
    samples: int | None = None
    ended_unix_s: float | None = None

    def refusal(self, digest: str) -> BatchFromPreviousRun:
        """What the gateway answers a request for this earlier run's batch, whose digest is `digest`."""
        status: EndStatus = "interrupted" if self.status == "accepted" else self.status
        produced = "an unknown number" if self.samples is None else str(self.samples)
        how = {"done": "ended done", "failed": "ended failed", "aborted": "was aborted",
               "interrupted": "was cut off by the restart"}[status]
        return BatchFromPreviousRun(
            message=f"batch {self.batch_id} was accepted by an earlier run of the service and {how} after "
                    f"{produced} of {self.samples_expected} samples; it is not run again: resubmit the samples "
                    f"you still need under a new batch_id",
            batch_id=self.batch_id, status=status, samples_delivered=self.samples,
            samples_expected=self.samples_expected, same_request=digest == self.digest,
            accepted_unix_s=self.accepted_unix_s, ended_unix_s=self.ended_unix_s)


@dataclass(frozen=True, slots=True)
class JournalCounters:
    """What went wrong with the journal file, in this process (exported as Prometheus counters)."""

    torn_records: int  # unreadable records at the end of the file at start (a write cut short)
    quarantined_files: int  # files set aside at start as damaged
    write_failures: int  # records or compactions that could not be written
    compactions: int
    previous_run_batches: int  # batches of earlier runs known at start


class _Damaged(ValueError):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _parse(line: bytes) -> dict[str, Any]:
    """A record line (without its newline) checked; ValueError if its checksum, JSON or shape is wrong."""
    record = decode_line(line)
    op = record.get("op")
    if op == "header":
        return record
    if not isinstance(record.get("id"), str) or not isinstance(record.get("t"), (int, float)):
        raise ValueError("id or t")
    if op == "accepted":
        if not isinstance(record.get("digest"), str) or type(record.get("expected")) is not int:
            raise ValueError("digest or expected")
    elif op == "ended":
        if record.get("status") not in _END_STATUSES or type(record.get("samples")) is not int:
            raise ValueError("status or samples")
    else:
        raise ValueError(f"op {op!r}")
    return record


class BatchJournal:
    """The journal of one service's state directory; see the module docstring. Called from the gateway's event loop
    only (each record is one short write and fsync, well under a millisecond on a local disk)."""

    def __init__(self, config: BatchJournalConfig) -> None:
        self.config = config
        self.path = config.state_dir / JOURNAL_FILE
        self._entries: OrderedDict[str, JournalEntry] = OrderedDict()  # oldest accepted first
        self._torn = self._quarantined = self._failures = self._compactions = 0
        self._fd: int | None = None
        self._size = 0
        config.state_dir.mkdir(parents=True, exist_ok=True)
        self._load()
        self._previous = sum(e.previous_run for e in self._entries.values())
        self._compact()

    # ---- the gateway's calls ----

    def previous(self, batch_id: str) -> JournalEntry | None:
        """The batch an earlier run of the service accepted under `batch_id`, if the journal remembers one."""
        entry = self._entries.get(batch_id)
        return entry if entry is not None and entry.previous_run else None

    def accepted(self, batch_id: str, digest: str, samples_expected: int) -> None:
        """Records a batch before it runs. A failure to write is logged and counted, not raised: the batch runs,
        and only its protection against a second run after a restart is lost."""
        now = time.time()
        self._entries.pop(batch_id, None)  # an id the journal had forgotten the end of is new again
        self._entries[batch_id] = JournalEntry(batch_id, digest, samples_expected, now, previous_run=False)
        self._append({"op": "accepted", "id": batch_id, "digest": digest, "expected": samples_expected, "t": now})

    def ended(self, batch_id: str, status: EndStatus, samples: int) -> None:
        """Records the end of a batch this run accepted (others are ignored); failures as `accepted`."""
        entry = self._entries.get(batch_id)
        if entry is None or entry.previous_run or entry.status != "accepted":
            return
        entry.status, entry.samples, entry.ended_unix_s = status, samples, time.time()
        self._append({"op": "ended", "id": batch_id, "status": status, "samples": samples, "t": entry.ended_unix_s})

    def counters(self) -> JournalCounters:
        return JournalCounters(self._torn, self._quarantined, self._failures, self._compactions, self._previous)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # ---- the file ----

    def _append(self, record: dict[str, Any]) -> None:
        line = encode_line(record)
        try:
            if self._fd is None:
                raise OSError("the journal file is not open (its last compaction failed)")
            os.write(self._fd, line)
            if self.config.fsync:
                os.fsync(self._fd)
        except OSError as exc:
            self._failures += 1
            log.error("batch journal %s: could not record %s of batch %s: %s", self.path, record["op"],
                      record["id"], exc)
            return
        self._size += len(line)
        if self._size > self.config.max_bytes:
            self._compact()

    def _load(self) -> None:
        for tmp in self.path.parent.glob(f"{self.path.name}.tmp-*"):
            tmp.unlink(missing_ok=True)  # a compaction a crash cut short: never renamed into place
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        lines = data.split(b"\n")
        tail = lines.pop()  # b"" when the file ends with a newline, else a line cut short
        records: list[dict[str, Any] | None] = []
        for line in lines:
            try:
                records.append(_parse(line))
            except ValueError:
                records.append(None)
        # Each record is one write: a process that died in one leaves at most the last record torn.
        if tail or (records and records[-1] is None):
            if not tail:
                records.pop()
            self._torn += 1
            log.warning("batch journal %s: dropped a torn record at its end", self.path)
        if not records:
            return  # empty, or nothing but a torn first write: nothing to read or set aside
        try:
            header = records[0]
            if all(r is None for r in records):
                raise _Damaged("format", "no record in it is readable")
            if header is None:
                raise _Damaged("record", "its header is unreadable")
            if header.get("op") != "header" or header.get("format") != _FORMAT:
                raise _Damaged("format", "the first record is not a batch journal header")
            if header.get("version") != _VERSION:
                raise _Damaged("version", f"version {header.get('version')!r}, this build reads {_VERSION}")
            if None in records:
                raise _Damaged("record", f"{records.count(None)} unreadable record(s) before the end")
        except _Damaged as exc:
            self._quarantined += 1
            bad = self.path.with_name(f"{self.path.name}.bad-{exc.reason}-{int(time.time())}")
            log.error("batch journal %s damaged (%s); renamed to %s, its readable records kept", self.path, exc,
                      bad.name)
            self.path.rename(bad)
            if exc.reason != "record":
                return  # not this format (or not this version): nothing in it can be trusted
        for record in records:
            if record is None or record["op"] == "header":
                continue
            if record["op"] == "accepted":
                self._entries.pop(record["id"], None)
                self._entries[record["id"]] = JournalEntry(record["id"], record["digest"], record["expected"],
                                                           float(record["t"]), previous_run=True)
            elif (entry := self._entries.get(record["id"])) is not None:
                entry.status, entry.samples, entry.ended_unix_s = record["status"], record["samples"], \
                    float(record["t"])

    def _entry_lines(self, entry: JournalEntry) -> bytes:
        out = encode_line({"op": "accepted", "id": entry.batch_id, "digest": entry.digest,
                           "expected": entry.samples_expected, "t": entry.accepted_unix_s})
        if entry.status != "accepted":
            out += encode_line({"op": "ended", "id": entry.batch_id, "status": entry.status,
                                "samples": entry.samples, "t": entry.ended_unix_s})
        return out

    def _compact(self) -> None:
        """Rewrites the file as the entries it should keep: the newest that fit in half of `max_bytes`, and those of
        batches without an end. On failure the old file (and appends to it) stay."""
        header = encode_line({"op": "header", "format": _FORMAT, "version": _VERSION})
        budget = self.config.max_bytes // 2 - len(header)
        kept: list[bytes] = []
        forgotten: list[str] = []
        for entry in reversed(self._entries.values()):
            lines = self._entry_lines(entry)
            # A batch without an end stays however old: running here, or cut off by a crash (what a retry most
            # needs to be told about); at most max_batches_in_flight of them per run.
            if budget - len(lines) < 0 and entry.status != "accepted":
                forgotten.append(entry.batch_id)  # too old to remember
                continue
            budget -= len(lines)
            kept.append(lines)
        for batch_id in forgotten:
            del self._entries[batch_id]
        body = header + b"".join(reversed(kept))
        try:
            replace_file(self.path, body, self.config.fsync)
            self.close()
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        except OSError as exc:
            self._failures += 1
            log.error("batch journal %s: compaction failed: %s", self.path, exc)
            return
        self._size = len(body)
        self._compactions += 1
