"""Sample keys of the client tests' batches (`keys`; `ALL_12`: every key of the standard 3 x 4 batch)."""

from __future__ import annotations

from typing import Any


def keys(records: list[Any]) -> list[tuple[int, int]]:
    return sorted((r.group_index, r.sample_index) for r in records)


ALL_12 = [(g, s) for g in range(3) for s in range(4)]
