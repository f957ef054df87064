"""Versioned msgpack documents, `{"format": str, "version": int, ...}`: the checks every loader makes.

Each format passes its own ValueError subclass, so callers keep catching the error type of their format.
"""

from __future__ import annotations

from typing import Any

import msgpack


def decode_document(data: object, fmt: str, version: int, error: type[ValueError]) -> dict[str, Any]:
    """The decoded map, after checking it is msgpack, of format `fmt`, at exactly `version`."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise error(f"expected bytes, got {type(data).__name__}")
    try:
        doc = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # noqa: BLE001 -- msgpack raises several unrelated types; all mean "not msgpack"
        raise error(f"not a msgpack document: {type(exc).__name__}: {exc}") from exc
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        raise error(f"not a {fmt} document")
    found = doc.get("version")
    if type(found) is not int or found != version:
        raise error(f"unsupported {fmt} version {found!r} (this build reads {version})")
    return doc


def require_field(doc: dict[str, Any], name: str, kind: type, error: type[ValueError], prefix: str = "") -> Any:
    """doc[name], which must exist and be a `kind` (a bool never passes for an int)."""
    if name not in doc:
        raise error(f"missing field {prefix}{name}")
    value = doc[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise error(f"field {prefix}{name} must be {kind.__name__}, got {type(value).__name__}")
    return value
