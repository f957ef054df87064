"""The oracle drafter source: a request's own recorded future, for measuring what perfect drafts can do.

Under keyed sampling the tokens a sample draws depend only on its key, not on what was drafted, so the output the
`none` arm recorded for a key is exactly the output every arm generates for it. A request given that continuation
(`RequestTags.oracle`) drafts, at each step, the next K_i tokens of it (K_i: the budget's plan, as for any other
draft), never past the recorded end. The proposer consults this source instead of the history bank for such
requests; requests without a continuation never touch it.

Slot-indexed like `das.scheduler.request_columns` (slots are the proposer's request slots).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from das.drafter.history import accepted_prefix


class OracleDrafts:
    """Per slot: the recorded continuation (output tokens, int32) and the draft it gave last, awaiting
    verification. `active[slot]`: the slot has a continuation (bool column, grown with the slots)."""

    def __init__(self, capacity: int = 64) -> None:
        self.active = np.zeros(capacity, np.bool_)
        self._tokens: dict[int, np.ndarray] = {}
        self._pending: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        """Slots with a continuation now."""
        return len(self._tokens)

    def set(self, slot: int, continuation: Sequence[int] | None) -> None:
        """Slot `slot` (>= 0) starts a request with `continuation` (its whole recorded output, token ids; None:
        the request has none and drafts from the history bank as usual)."""
        if slot < 0:
            raise ValueError(f"slot must be >= 0, got {slot}")
        if slot >= self.active.size:
            self.active = np.concatenate([self.active, np.zeros(max(slot + 1, self.active.size), np.bool_)])
        self._pending.pop(slot, None)
        if continuation is None:
            self._tokens.pop(slot, None)
            self.active[slot] = False
            return
        tokens = np.asarray(continuation, np.int64)
        if tokens.ndim != 1 or (tokens.size and tokens.min() < 0):
            raise ValueError("an oracle continuation is a 1-D sequence of token ids >= 0")
        self._tokens[slot] = tokens.astype(np.int32)
        self.active[slot] = True

    def clear(self, slot: int) -> None:
        """The request in `slot` left."""
        self.set(slot, None)

    def draft(self, slots: np.ndarray, generated: np.ndarray, k: np.ndarray) -> list[list[int]]:
        """The drafts of requests in `slots` (each with a continuation) that generated generated[r] output tokens
        so far and may draft k[r] >= 0 tokens: continuation[generated : generated + k], cut at the recorded end.
        Each draft is kept until `settle` scores it."""
        out = []
        for slot, done, n in zip(slots.tolist(), generated.tolist(), k.tolist()):
            tokens = self._tokens[slot]
            draft = tokens[max(done, 0):max(done, 0) + max(n, 0)]
            if draft.size:
                self._pending[slot] = draft
            else:
                self._pending.pop(slot, None)
            out.append(draft.tolist())
        return out

    def settle(self, slots: np.ndarray, table: np.ndarray, starts: np.ndarray,
               ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Request slots[r] committed table[r, starts[r]:ends[r]] since its last draft: per request, the draft
        tokens verified (its pending draft's length; 0 without one or without new tokens) and the accepted ones,
        counted as the history bank counts them (common prefix with the committed tokens but the last, which is
        the verifier's own bonus or recovered token). int64 arrays."""
        drafted = np.zeros(slots.size, np.int64)
        accepted = np.zeros(slots.size, np.int64)
        for r, (slot, start, end) in enumerate(zip(slots.tolist(), starts.tolist(), ends.tolist())):
            if end <= start:
                continue
            draft = self._pending.pop(slot, None)
            if draft is None:
                continue
            drafted[r] = draft.size
            accepted[r] = accepted_prefix(draft, np.asarray(table[r, start:end - 1]))
        return drafted, accepted


def write_continuations(path: str | os.PathLike[str], continuations: Mapping[int, Sequence[int]]) -> None:
    """Writes recorded outputs by sample key (int64 keys, token-id lists) as JSON, for `das serve --oracle-file`."""
    Path(path).write_text(json.dumps({"continuations": {str(k): list(v) for k, v in continuations.items()}}),
                          encoding="utf-8")


def load_continuations(path: str | os.PathLike[str]) -> dict[int, list[int]]:
    """Reads what `write_continuations` wrote; ValueError naming the file where it is not such a file."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))["continuations"]
        out = {int(k): [int(t) for t in v] for k, v in raw.items()}
    except (OSError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"{path}: not an oracle continuations file ({type(exc).__name__}: {exc})") from None
    if any(t < 0 for v in out.values() for t in v):
        raise ValueError(f"{path}: token ids must be >= 0")
    return out
