"""`das bench coupled`: how much of a sample its same-key sample of the problem's previous visit predicts exactly.

Under keyed sampling a token's draw is a function of its sample's key and its position only (docs/design "Keyed
sampling"). A trainer that gives a problem the same seed every time it comes back (the GRPO example's `-coupled`
arms) draws sample i of each visit from the same noise, so it repeats the previous visit's sample i token for token
until the first position where the policy's updates flip the draw; after that the contexts differ. Each visit's
samples are still exact draws from the current policy: only their correlation across visits changes.

Two measurements on a trace file (the trace format, e.g. the GRPO example's OUT/<arm>/rollouts.jsonl.gz):

- **agreement**: for every sample with an earlier visit (the same problem and sample index at an earlier policy
  version, the latest one), the common prefix of the two outputs, by visit (2nd, 3rd, ...) and by the number of
  policy versions between them. Token-weighted shares: sum of prefixes / sum of the samples' tokens.
- **replay** (`das bench drafter`'s, K draft tokens a step, every draft verified): tokens a step of today's
  drafter without sampling keys (`das`), of the same-key sample alone (`same-key`: the previous visit's sample i
  from the current position while the output so far equals its prefix, nothing after), of both (`das+same-key`:
  the same-key draft while it is aligned, the drafter after), and of the drafter with each sample's key
  (`das-keyed`: the history bank's own "same-key" source, one more candidate its source chooser calibrates, as
  the service runs it). On traces with independent seeds the same-key arms find little; the difference between
  them and `das` is what coupling adds to the drafter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from das.bench.drafter_replay import ArmStats, DasDrafter, replay_arm
from das.drafter.history import DrafterConfig
from das.drafter.records import RolloutRecord, load_rollouts

ARMS = ("das", "same-key", "das+same-key", "das-keyed")


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Tokens at the start of `a` equal to those of `b`. O(min length), vectorised."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


@dataclass(frozen=True)
class Revisit:
    """A sample and its same-key sample of the problem's previous visit: `visit` counts the problem's versions up
    to this one (2: its first return); `gap` the policy versions between the two; `tokens` this sample's output
    length, `prefix` the tokens it shares with the earlier one from the start; `identical` both outputs equal."""

    problem_id: str
    sample_index: int
    policy_version: int
    visit: int
    gap: int
    tokens: int
    prefix: int
    identical: bool


def revisits(records: Sequence[RolloutRecord]) -> list[Revisit]:
    """Every sample whose problem has an earlier version with the same sample index, against the latest such one."""
    by_key: dict[tuple[str, int], list[RolloutRecord]] = {}
    for r in records:
        by_key.setdefault((r.problem_id, r.sample_index), []).append(r)
    out = []
    for (problem, index), visits in by_key.items():
        visits.sort(key=lambda r: r.policy_version)
        for n, (before, now) in enumerate(zip(visits, visits[1:]), start=2):
            if now.policy_version == before.policy_version:
                raise ValueError(f"problem {problem!r} has two samples of index {index} at policy version "
                                 f"{now.policy_version}: not a trace of one sample per key and visit")
            prefix = common_prefix(now.output_token_ids, before.output_token_ids)
            out.append(Revisit(problem, index, now.policy_version, n, now.policy_version - before.policy_version,
                               len(now.output_token_ids), prefix, now.output_token_ids == before.output_token_ids))
    return sorted(out, key=lambda v: (v.policy_version, v.problem_id, v.sample_index))


@dataclass(frozen=True)
class AgreementRow:
    """Revisits grouped by `by` (`visit` or `gap`) = `value`: `samples`, their `tokens`, the token-weighted
    `prefix_share` (sum of prefixes / sum of tokens), the mean per-sample share and the share of identical samples."""

    by: str
    value: int
    samples: int
    tokens: int
    prefix_share: float
    mean_sample_share: float
    identical_share: float


def agreement(visits: Sequence[Revisit], by: str) -> list[AgreementRow]:
    """One row per value of `by` ("visit" or "gap"), plus one for all (value 0)."""
    groups: dict[int, list[Revisit]] = {0: list(visits)}
    for v in visits:
        groups.setdefault(getattr(v, by), []).append(v)
    rows = []
    for value in sorted(groups):
        group = groups[value]
        tokens = sum(v.tokens for v in group)
        rows.append(AgreementRow(
            by, value, len(group), tokens, sum(v.prefix for v in group) / tokens if tokens else 0.0,
            float(np.mean([v.prefix / v.tokens if v.tokens else 1.0 for v in group])) if group else 0.0,
            float(np.mean([v.identical for v in group])) if group else 0.0))
    return rows


class SameKeyDrafter:
    """The previous visit's same-key sample as a drafter (replay protocol, `peers.ReplayDrafter`): while a
    request's output equals that sample's first tokens, it proposes the sample's next ones; after the first
    difference, nothing. With `fallback`, that drafter's proposal wherever this one has none. The sample index is
    the last `/`-separated field of the replay's request id (`drafter_replay.replay_arm`)."""

    def __init__(self, fallback: DasDrafter | None = None) -> None:
        self.name = "same-key" if fallback is None else f"{fallback.name}+same-key"
        self.fallback = fallback
        self._latest: dict[tuple[str, int], np.ndarray] = {}   # (problem, index) -> its latest finished output
        self._finished: list[tuple[tuple[str, int], np.ndarray]] = []
        self._requests: dict[str, tuple[tuple[str, int], np.ndarray | None, list[int], bool]] = {}

    def begin_version(self, policy_version: int) -> None:
        if self.fallback is not None:
            self.fallback.begin_version(policy_version)

    def start_request(self, request_id: str, problem_id: str, prompt: np.ndarray) -> None:
        key = (problem_id, int(request_id.rsplit("/", 1)[1]))
        self._requests[request_id] = (key, self._latest.get(key), [], True)
        if self.fallback is not None:
            self.fallback.start_request(request_id, problem_id, prompt)

    def propose(self, request_id: str, context: np.ndarray, max_tokens: int) -> np.ndarray:
        _, earlier, output, aligned = self._requests[request_id]
        if aligned and earlier is not None and len(output) < len(earlier):
            return earlier[len(output):len(output) + max_tokens]
        if self.fallback is not None:
            return self.fallback.propose(request_id, context, max_tokens)
        return np.zeros(0, np.int32)

    def extend(self, request_id: str, tokens: np.ndarray) -> None:
        key, earlier, output, aligned = self._requests[request_id]
        start = len(output)
        output.extend(int(t) for t in tokens)
        if aligned and (earlier is None or common_prefix(output[start:], earlier[start:]) < len(output) - start):
            self._requests[request_id] = (key, earlier, output, False)
        if self.fallback is not None:
            self.fallback.extend(request_id, tokens)

    def finish_request(self, request_id: str) -> None:
        key, _, output, _ = self._requests.pop(request_id)
        self._finished.append((key, np.asarray(output, np.int32)))
        if self.fallback is not None:
            self.fallback.finish_request(request_id)

    def end_version(self, policy_version: int) -> None:
        self._latest.update(self._finished)  # visible from the next version on, as a sealed history is
        self._finished.clear()
        if self.fallback is not None:
            self.fallback.end_version(policy_version)

    def memory_bytes(self) -> int:
        own = sum(a.nbytes for a in self._latest.values())
        return own + (self.fallback.memory_bytes() if self.fallback is not None else 0)

    def stored_tokens(self) -> int:
        own = sum(a.size for a in self._latest.values())
        return own + (self.fallback.stored_tokens() if self.fallback is not None else 0)


@dataclass
class CoupledResult:
    """One trace file's agreement (by visit and by version gap) and its replay arms (tokens a step at K)."""

    traces: str
    max_draft: int
    by_visit: list[AgreementRow] = field(default_factory=list)
    by_gap: list[AgreementRow] = field(default_factory=list)
    arms: dict[str, ArmStats] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        return {"traces": self.traces, "max_draft": self.max_draft,
                "by_visit": [asdict(r) for r in self.by_visit], "by_gap": [asdict(r) for r in self.by_gap],
                "arms": {name: asdict(s) for name, s in self.arms.items()}}


@dataclass
class CoupledBench:
    results: list[CoupledResult]

    def to_dict(self) -> dict[str, object]:
        return {"runs": [r.to_dict() for r in self.results]}

    def print(self, console: Console) -> None:
        for r in self.results:
            table = Table(title=f"same-key agreement: {r.traces} (0 = all revisits)")
            for column in ("by", "value", "samples", "tokens", "prefix share", "mean sample share", "identical"):
                table.add_column(column, justify="right")
            for row in r.by_visit + r.by_gap:
                table.add_row(row.by, str(row.value), str(row.samples), str(row.tokens), f"{row.prefix_share:.3f}",
                              f"{row.mean_sample_share:.3f}", f"{row.identical_share:.3f}")
            console.print(table)
            arms = Table(title=f"replay at K = {r.max_draft} (every version after the first)")
            for column in ("arm", "tok/step", "draft tok/step", "accept"):
                arms.add_column(column, justify="right")
            for name, s in r.arms.items():
                arms.add_row(name, f"{s.tokens_per_step:.3f}", f"{s.draft_tokens_per_step:.2f}",
                             f"{s.acceptance_rate:.3f}")
            console.print(arms)


def _arm(name: str, max_draft: int) -> DasDrafter | SameKeyDrafter:
    if name == "das":
        return DasDrafter(DrafterConfig.for_drafts(max_draft))
    if name == "same-key":
        return SameKeyDrafter()
    if name == "das+same-key":
        return SameKeyDrafter(DasDrafter(DrafterConfig.for_drafts(max_draft)))
    if name == "das-keyed":
        return DasDrafter(DrafterConfig.for_drafts(max_draft), name="das-keyed", keyed=True)
    raise ValueError(f"unknown arm {name!r}; known: {list(ARMS)}")


def coupled_bench(traces: Sequence[Path], max_draft: int = 16, arms: Sequence[str] = ARMS,
                  console: Console | None = None) -> CoupledBench:
    """Agreement and replay per trace file (module docstring); a line per file and arm on `console`."""
    results = []
    for path in traces:
        records = load_rollouts(path)
        visits = revisits(records)
        result = CoupledResult(str(path), max_draft, agreement(visits, "visit"), agreement(visits, "gap"))
        for name in arms:
            if console is not None:
                console.print(f"{path.name}: replaying {name}")
            result.arms[name] = replay_arm(_arm(name, max_draft), records, max_draft)
        results.append(result)
    return CoupledBench(results)
