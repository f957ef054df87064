"""`SampleProgress`: the tokens a sample in flight made since its last report, as they travel from an engine up to
the gateway (engine -> NodeEngine -> coordinator -> gateway -> a client that asked for them).

A sample's progress reports are contiguous: report k+1's `offset` is report k's offset plus its token count, the
first one's 0 (or the tokens a resumed sample already had), and the sample's result, when it finishes, holds every
token they carried (and possibly more: the last tokens of a sample travel with its result only). Reports are
batched (`ProgressBatcher`): an engine's samples report at most every `interval_s` seconds together, so progress
costs one message per engine per interval, not one per token. Plain dataclasses: they cross Ray by pickle and
the gateway's hot path by attribute, never by pydantic validation.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict


@dataclass(slots=True)
class SampleProgress:
    """Tokens `token_ids` (with `logprobs`, one a token, and `text`, their detokenized text as the engine streams
    it, "" without a tokenizer) of sample `sample_index` at positions offset .. offset + len(token_ids) - 1 of its
    output, drawn from weights `policy_version`."""

    sample_index: int
    offset: int
    token_ids: list[int]
    logprobs: list[float]
    text: str = ""
    policy_version: int = 0

    def end(self) -> int:
        """The position after the last token reported."""
        return self.offset + len(self.token_ids)

    def extend(self, later: SampleProgress) -> None:
        """Appends the next report of the same sample (its offset must be this one's `end`)."""
        if later.offset != self.end():
            raise ValueError(f"sample {self.sample_index}: progress at offset {later.offset} does not follow "
                             f"tokens up to {self.end()}")
        self.token_ids.extend(later.token_ids)
        self.logprobs.extend(later.logprobs)
        self.text += later.text
        self.policy_version = later.policy_version

    def wire(self, group_index: int, logprobs: bool) -> dict[str, Any]:
        """The batch API's progress object (`{"progress": ...}` in a batch stream that asked for progress)."""
        body: dict[str, Any] = {"group_index": group_index, "sample_index": self.sample_index,
                                "offset": self.offset, "token_ids": self.token_ids, "text": self.text,
                                "policy_version": self.policy_version}
        if logprobs:
            body["logprobs"] = self.logprobs
        return {"progress": body}


@dataclass
class ProgressBatcher:
    """Accumulates progress reports by key (a sample's identity, e.g. (group, sample index)) until taken:
    consecutive reports of one sample merge into one. `take()` returns what accumulated, keys in first-report
    order; `drop(key)` forgets a sample's pending report (its result is on its way and carries its tokens)."""

    pending: dict[Hashable, SampleProgress] = field(default_factory=dict)

    def add(self, key: Hashable, report: SampleProgress) -> None:
        held = self.pending.get(key)
        if held is None:
            self.pending[key] = SampleProgress(report.sample_index, report.offset, list(report.token_ids),
                                               list(report.logprobs), report.text, report.policy_version)
        else:
            held.extend(report)

    def drop(self, key: Hashable) -> None:
        self.pending.pop(key, None)

    def take(self) -> list[tuple[Hashable, SampleProgress]]:
        taken = list(self.pending.items())
        self.pending.clear()
        return taken


class ProgressRecord(BaseModel):
    """One progress object of a batch stream that asked for progress (RolloutRequest.progress), as the client
    yields it: sample (group_index, sample_index)'s tokens at positions offset .. offset + len(token_ids) - 1."""

    model_config = ConfigDict(extra="forbid")

    group_index: int
    sample_index: int
    offset: int
    token_ids: list[int]
    text: str
    policy_version: int
    logprobs: list[float] | None = None
