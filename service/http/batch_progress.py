"""`ProgressLog`: a batch's opt-in stream of token progress (RolloutRequest.progress), for clients that watch long
samples as they are generated.

Kept apart from the batch's records (which a default stream reads and `resume_from` counts) so the default path
pays nothing for it: only a batch that asked for progress has a log. The log holds, in the order they happened, the
batch's `{"progress": ...}` frames (service/wire/sample_progress.py `SampleProgress.wire`) and its record frames (the
same bytes as the batch's records), so a reader sees each sample's progress before its record; `start(k)` is where a
reader that already has k records picks up. msgpack-encoded as the records are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from das.service.wire.sample_progress import SampleProgress


class ProgressLog:
    """Progress and record frames of one batch, in arrival order. `size`: bytes held."""

    def __init__(self, pack: Callable[[Any], bytes], logprobs: bool) -> None:
        self._pack = pack
        self._logprobs = logprobs
        self.frames: list[bytes] = []
        self._records_at: list[int] = []  # the log position of each record, in record order
        self.size = 0

    def progress(self, group_index: int, report: SampleProgress) -> None:
        frame = self._pack(report.wire(group_index, self._logprobs))
        self.frames.append(frame)
        self.size += len(frame)

    def record(self, frame: bytes) -> None:
        self._records_at.append(len(self.frames))
        self.frames.append(frame)
        self.size += len(frame)

    def start(self, records: int) -> int:
        """The log position after the first `records` records (and the progress that came before them)."""
        if records <= 0:
            return 0
        if records >= len(self._records_at):
            return len(self.frames)
        return self._records_at[records]
