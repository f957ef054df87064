"""The proposer's numbers per running request, as columns indexed by the request's slot (its row in the proposer's
`AcceptanceCounts`), so a decode step reads or updates the whole batch's values with one fancy index each instead
of visiting every request in Python. Slots are small reused ints; the columns grow by doubling."""

from __future__ import annotations

import numpy as np

from das.scheduler.length import LengthCurve, LengthCurveTable

# name -> dtype; `bank_slot` is int32 as the bank's batch calls take it, so a step passes its gather as it is
_COLUMNS = {"fed": np.int64, "prompt_len": np.int64, "max_tokens": np.int64, "bank_slot": np.int32,
            "steps": np.int64, "proposed": np.int64, "accepted": np.int64, "probe_drafted": np.int64,
            "may_draft": np.bool_, "cost_probe": np.bool_, "explored": np.bool_}


class RequestColumns:
    """By slot: `fed` (tokens of prompt + output fed to the bank), `prompt_len`, `max_tokens` (output cap),
    `bank_slot` (the request's slot in the HistoryBank; int32), `steps` (decode steps it took), `proposed` /
    `accepted` (its verified draft tokens and the accepted ones), `probe_drafted` (a cost probe's junk draft tokens
    awaiting verification), int64; `predicted` (predicted total output length, NaN unknown), float64; `may_draft`
    (RequestTags.draft), `cost_probe` (RequestTags.cost_probe), `explored` (its last draft was exploration's), bool;
    and `curves`, the requests' length curves. A slot's values are meaningful between `start` and its reuse."""

    def __init__(self, capacity: int = 64) -> None:
        for name, dtype in _COLUMNS.items():
            setattr(self, name, np.zeros(capacity, dtype))
        self.predicted = np.full(capacity, np.nan)
        self.curves = LengthCurveTable()

    def start(self, slot: int, *, prompt_len: int, max_tokens: int, bank_slot: int, predicted: float | None,
              curve: LengthCurve | None, may_draft: bool, cost_probe: bool) -> None:
        """A new request in `slot` (>= 0): its fixed values, and zero counts."""
        if slot >= self.fed.size:
            self._grow(max(slot + 1, 2 * self.fed.size))
        for name in _COLUMNS:
            getattr(self, name)[slot] = 0
        self.fed[slot] = self.prompt_len[slot] = prompt_len
        self.max_tokens[slot] = max_tokens
        self.bank_slot[slot] = bank_slot
        self.predicted[slot] = np.nan if predicted is None else predicted
        self.may_draft[slot] = may_draft
        self.cost_probe[slot] = cost_probe
        self.curves.set(slot, curve)

    def _grow(self, capacity: int) -> None:
        extra = capacity - self.fed.size
        for name in _COLUMNS:
            column = getattr(self, name)
            setattr(self, name, np.concatenate([column, np.zeros(extra, column.dtype)]))
        self.predicted = np.concatenate([self.predicted, np.full(extra, np.nan)])
