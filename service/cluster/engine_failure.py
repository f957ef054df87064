"""What the coordinator keeps to survive an engine that dies (docs/design.md "Failure behaviour"). Pure
bookkeeping, no Ray, so it is tested without processes.

- `FailureConfig`: how many restarts an engine actor may have within a window, and how long a restart may take.
- `RestartWindow`: one engine actor's recent restarts; says whether one more is allowed.
- `Share`: the samples of one group that one engine owes a batch, and how the engine's sample indices map back to
  the batch's, with the tokens each sample in flight has delivered so far (its progress reports). When the engine
  dies, `remainder()` is the share of the samples that never arrived, which the coordinator sends to another engine
  (or the restarted one) as a group with n = their count, each sample resumed from the tokens it had delivered
  (GroupRequest.prefix_token_ids): only its prompt and prefix are computed again, and `take` puts the delivered
  logprobs and weight spans back in front of what the new engine returns. A share counts the
  engine deaths its group ran through: a group that kills every engine it reaches (a "query of death") is given
  up after `FailureConfig.max_group_deaths` of them instead of taking down one engine after another; each death is
  kept with the engine's name and its time, and the samples that ran through it carry them
  (SampleResult.engine_deaths: events on their spans, service/http/tracing.py).
- `GivenUpPrompts`: the prompts given up that way, refused at admission for `FailureConfig.given_up_hold_s`, so a
  client that retries the error does not crash the engines again.
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from dataclasses import dataclass, field


from das.service.config import FailureConfig
from das.service.wire.api import EngineDeath, GroupRequest, SampleResult
from das.service.wire.sample_progress import SampleProgress


class RestartWindow:
    """The restarts of one engine actor within the last `restart_window_s` seconds (monotonic clock)."""

    def __init__(self, config: FailureConfig) -> None:
        self._config = config
        self._times: deque[float] = deque()

    def allow(self, now: float) -> bool:
        """Whether a death at `now` may be followed by a restart; records the restart if so."""
        while self._times and self._times[0] <= now - self._config.restart_window_s:
            self._times.popleft()
        if len(self._times) >= self._config.max_restarts:
            return False
        self._times.append(now)
        return True


@dataclass
class Delivered:
    """What one sample in flight has delivered: its first tokens with their logprobs and text, and the weights they
    came from as [policy version, index of its first token] spans."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    spans: list[tuple[int, int]] = field(default_factory=list)

    def add(self, progress: SampleProgress) -> bool:
        """Appends a report that follows on (False, nothing changed: it does not start where these tokens end)."""
        if progress.offset != len(self.token_ids) or not progress.token_ids:
            return False
        if not self.spans or self.spans[-1][0] != progress.policy_version:
            self.spans.append((progress.policy_version, progress.offset))
        self.token_ids.extend(progress.token_ids)
        self.logprobs.extend(progress.logprobs)
        self.text += progress.text
        return True


@dataclass
class Share:
    """The samples of the batch's group `group_index` that one engine was asked for. The engine draws
    len(indices) samples numbered 0.. by itself; its sample j is the batch's sample `indices[j]`. `received`: the
    batch's sample indices that have arrived (each is delivered once: a repeat is dropped). `died`: the engine
    deaths the group's samples ran through before this share, oldest first (none for the first engine it is sent
    to; `deaths` counts them).
    `delivered`: per batch sample index, the tokens it has delivered (progress reports and the prefix it was
    resumed from); `resumed`: the prefix lengths this share's request resumes them from."""

    group_index: int
    indices: tuple[int, ...]
    received: set[int] = field(default_factory=set)
    died: tuple[EngineDeath, ...] = ()
    delivered: dict[int, Delivered] = field(default_factory=dict)
    resumed: dict[int, int] = field(default_factory=dict)

    @property
    def deaths(self) -> int:
        return len(self.died)

    def request(self, group: GroupRequest) -> GroupRequest:
        """What the engine is sent: the group, with n = the samples of this share, drawn with their own keys, each
        resumed from the tokens it has delivered and under its own trace parent (when the group has them)."""
        prefixes = tuple(tuple(self.delivered[i].token_ids) if i in self.delivered else () for i in self.indices)
        self.resumed = {i: len(p) for i, p in zip(self.indices, prefixes) if p}
        if len(self.indices) == group.n and not self.resumed:
            return group
        keys = self.indices if group.key_indices is None else tuple(group.key_indices[i] for i in self.indices)
        parents = (None if group.trace_parents is None
                   else tuple(group.trace_parents[i] for i in self.indices))
        return group.model_copy(update={"n": len(self.indices), "key_indices": keys,
                                        "prefix_token_ids": prefixes if self.resumed else None,
                                        "trace_parents": parents})

    def progress(self, report: SampleProgress) -> SampleProgress | None:
        """The engine's progress report renumbered as the batch's sample (a new object), or None if it does not
        follow on what the sample delivered (a repeat, or a sample that has arrived)."""
        j = report.sample_index
        if not 0 <= j < len(self.indices) or self.indices[j] in self.received:
            return None
        index = self.indices[j]
        if not self.delivered.setdefault(index, Delivered()).add(report):
            return None
        return SampleProgress(index, report.offset, report.token_ids, report.logprobs, report.text,
                              report.policy_version)

    def take(self, sample: SampleResult) -> SampleResult | None:
        """The engine's sample renumbered as the batch's sample (in place, with the engine deaths it ran through as
        `redispatches` and `engine_deaths`), or None if that sample has already arrived. ValueError for an index the
        engine was not asked for."""
        j = sample.sample_index
        if not 0 <= j < len(self.indices):
            raise ValueError(f"sample index {j} of group {self.group_index}: the engine was asked for "
                             f"{len(self.indices)} samples")
        index = self.indices[j]
        if index in self.received:
            return None
        self.received.add(index)
        sample.sample_index = index
        sample.redispatches = self.deaths
        sample.engine_deaths = list(self.died) or None
        delivered = self.delivered.pop(index, None)
        resumed = self.resumed.get(index, 0)
        if resumed and delivered is not None:
            # The engine returned the whole output and the new tokens' logprobs; the prefix's came with its progress.
            sample.logprobs = delivered.logprobs[:resumed] + sample.logprobs
            spans = [span for span in delivered.spans if span[1] < resumed]
            for span in sample.policy_spans or ():
                if span[1] < len(sample.token_ids) and (not spans or spans[-1][0] != span[0]):
                    spans.append(span)
            sample.policy_version = spans[0][0] if spans else sample.policy_version
            sample.policy_spans = spans if len(spans) > 1 else None
            if sample.text is None and delivered.text:
                sample.text = delivered.text
        return sample

    def missing(self) -> tuple[int, ...]:
        """The batch's sample indices of this share that have not arrived, increasing."""
        return tuple(i for i in self.indices if i not in self.received)

    def remainder(self, engine: str, unix_s: float) -> Share | None:
        """After `engine`, running this share, died (seen at `unix_s`, Unix seconds): a share of the missing
        samples, that death counted (None: nothing is missing)."""
        missing = self.missing()
        if not missing:
            return None
        return Share(self.group_index, missing, died=(*self.died, EngineDeath(engine=engine, unix_s=unix_s)),
                     delivered={i: self.delivered[i] for i in missing if i in self.delivered})


def crash_digest(group: GroupRequest) -> str:
    """What identifies a group as one that crashed engines: its prompt (token ids, text or messages) and its
    sampling settings except the seed (sha256 hex)."""
    body = group.model_dump(mode="json", include={"prompt_token_ids", "prompt", "messages", "sampling"})
    body["sampling"].pop("seed", None)
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class GivenUpPrompts:
    """The groups given up after `max_group_deaths` engine deaths, by `crash_digest`, each held for
    `given_up_hold_s` seconds (monotonic clock) from its latest give-up."""

    def __init__(self, config: FailureConfig) -> None:
        self._config = config
        self._since: dict[str, float] = {}

    def add(self, group: GroupRequest, now: float) -> None:
        if self._config.given_up_hold_s > 0:
            self._since[crash_digest(group)] = now

    def refused(self, groups: list[GroupRequest], now: float) -> tuple[int, str] | None:
        """The first group whose prompt is held, as (index, message), or None."""
        hold = self._config.given_up_hold_s
        for digest in [d for d, since in self._since.items() if since <= now - hold]:
            del self._since[digest]
        if not self._since:
            return None
        for i, group in enumerate(groups):
            since = self._since.get(crash_digest(group))
            if since is not None:
                return i, (f"this prompt, with these sampling settings, was given up {now - since:.0f} s ago: its "
                           f"samples were running at {self._config.max_group_deaths} engine death(s) (it may "
                           f"crash the engine); it is refused for {hold:g} s after that "
                           f"(FailureConfig.given_up_hold_s)")
        return None
