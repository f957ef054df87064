"""The line format of the gateway's journals (batch_journal.py, session_journal.py): one JSON object a line,
prefixed by the CRC-32 of its body in 8 hex digits, so a torn or corrupted line is told apart from a record; and
the atomic replacement both journals compact with."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any


def encode_line(record: dict[str, Any]) -> bytes:
    """`<crc32 hex8> <compact JSON>\\n` (ensure_ascii: the line is ASCII)."""
    body = json.dumps(record, separators=(",", ":")).encode()
    return b"%08x %s\n" % (zlib.crc32(body), body)


def decode_line(line: bytes) -> dict[str, Any]:
    """A line (without its newline) back to its record; ValueError if its checksum or JSON is wrong or it holds no
    object. Each journal checks its records' shape itself."""
    crc, _, body = line.partition(b" ")
    if len(crc) != 8 or int(crc, 16) != zlib.crc32(body):
        raise ValueError("checksum")
    record = json.loads(body)
    if not isinstance(record, dict):
        raise ValueError("not an object")
    return record


def replace_file(path: Path, body: bytes, fsync: bool) -> None:
    """Replaces `path` by `body` atomically (a temporary file beside it, then a rename; with `fsync`, the file and
    the directory synced), so appends never follow a torn line. OSError on failure, the old file kept and the
    temporary one removed."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(body)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        fd = os.open(path.parent, os.O_RDONLY)  # the rename is durable once the directory is
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
