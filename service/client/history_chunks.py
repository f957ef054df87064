"""`history_bodies`: a history import cut into request bodies the gateway accepts (GatewayConfig.max_body_bytes,
max_history_records), for `RolloutClient.add_history`: a trainer hands over any number of records in one call, and
each request stays under the limits instead of being refused whole with 413."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

_OPEN, _CLOSE = b'{"records":[', b"]}"


def history_bodies(records: Sequence[dict[str, Any]], max_body_bytes: int, max_records: int) -> Iterator[bytes]:
    """JSON bodies `{"records": [...]}` of at most `max_body_bytes` bytes and `max_records` records each, holding
    `records` in order. ValueError, before any body is made, for a record that alone is over the byte limit (no
    request could carry it); nothing is yielded then."""
    encoded = [json.dumps(r, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode() for r in records]
    room = max_body_bytes - len(_OPEN) - len(_CLOSE)
    for i, body in enumerate(encoded):
        if len(body) > room:
            raise ValueError(f"history record {i} is {len(body)} bytes of JSON: over the body limit of "
                             f"{max_body_bytes} bytes alone, no request can carry it")
    part: list[bytes] = []
    size = 0
    for body in encoded:
        extra = len(body) + (1 if part else 0)  # the comma before it
        if part and (size + extra > room or len(part) >= max_records):
            yield _OPEN + b",".join(part) + _CLOSE
            part, size, extra = [], 0, len(body)
        part.append(body)
        size += extra
    if part:
        yield _OPEN + b",".join(part) + _CLOSE
