"""`das bench drafter-loss`: where the drafter loses to the exact future, and what would have predicted the tokens it
missed.

The replay is `das bench drafter`'s (`drafter_replay`: the versions before v as history, the rollouts of v
decoded together in lockstep, K draft tokens a step, every draft verified). At every step the exact future would
have had min(K, tokens left - 1) accepted (the step samples one itself); ours had `a`. Where a is less, the step **missed** the token at draft
position a, and lost the difference. Each miss is classified

- by why: `no draft` (no source matched), `stopped` (the draft ended before the miss: its calibrated probability
  fell under the floor, or the source ran out), `wrong` (the draft had another token there);
- by draft position (0, 1-3, 4-7, 8+) and by the sample's length class (its batch's terciles of output length);
- by what held the missed token after the same `match` tokens of context (an (match + 1)-gram lookup, so "could
  have predicted", not "would have been chosen"): the problem's prompt, the sample's own text so far (`self`), its
  siblings' text so far (`live`, the same problem's other samples of this version, at this step), the problem's
  rollouts of policy age 1, 2, ... (`sealed-age-a`), other problems' rollouts (`global`), or `nowhere`. Shares are
  non-exclusive (a gram may be in several places) except `nowhere`.

Our own accepted tokens are counted by the source that drafted them. Pure Python over the replay's steps: a few set
lookups per miss.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from das.drafter.history import DrafterConfig, HistoryBank, accepted_prefix
from das.drafter.records import RolloutRecord, load_rollouts

WHY = ("no draft", "stopped", "wrong")
POSITIONS = ((0, 0), (1, 3), (4, 7), (8, 1 << 30))
LENGTH_CLASSES = ("short", "medium", "long")
PLACES_FIXED = ("prompt", "self", "live")
NOWHERE = "nowhere"
GLOBAL = "global"


def _grams(tokens: Sequence[int], n: int) -> set[tuple[int, ...]]:
    return {tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)}


def _position_label(position: int) -> str:
    lo, hi = next(b for b in POSITIONS if b[0] <= position <= b[1])
    return str(lo) if lo == hi else (f"{lo}-{hi}" if hi < 1 << 30 else f"{lo}+")


@dataclass
class LossReport:
    """One trace file's figures (module docstring). Counts are steps (misses) or tokens as named."""

    traces: str
    max_draft: int
    match: int
    steps: int = 0
    tokens: int = 0
    exact_steps: int = 0                      # steps the exact future would take (K + 1 tokens a step, or the rest)
    accepted_by_source: Counter[str] = field(default_factory=Counter)
    proposed_by_source: Counter[str] = field(default_factory=Counter)
    misses: Counter[tuple[str, str, str]] = field(default_factory=Counter)       # (why, position, length class)
    lost: Counter[tuple[str, str, str]] = field(default_factory=Counter)         # tokens, same keys
    predicted_by: Counter[str] = field(default_factory=Counter)                  # misses whose token is held there
    predicted_by_why: Counter[tuple[str, str]] = field(default_factory=Counter)  # (why, place)

    def total_misses(self) -> int:
        return sum(self.misses.values())

    def to_dict(self) -> dict[str, object]:
        misses = self.total_misses()
        return {
            "traces": self.traces, "max_draft": self.max_draft, "match": self.match, "steps": self.steps,
            "tokens": self.tokens, "tokens_per_step": self.tokens / self.steps if self.steps else 0.0,
            "exact_tokens_per_step": self.tokens / self.exact_steps if self.exact_steps else 0.0,
            "sources": {s: {"proposed": self.proposed_by_source[s], "accepted": self.accepted_by_source[s]}
                        for s in sorted(self.proposed_by_source)},
            "misses": misses,
            "lost_tokens": sum(self.lost.values()),
            "by_why": {w: {"misses": sum(v for k, v in self.misses.items() if k[0] == w),
                           "lost_tokens": sum(v for k, v in self.lost.items() if k[0] == w)} for w in WHY},
            "by_position": {p: sum(v for k, v in self.misses.items() if k[1] == p)
                            for p in (_position_label(b[0]) for b in POSITIONS)},
            "by_length_class": {c: {"misses": sum(v for k, v in self.misses.items() if k[2] == c),
                                    "lost_tokens": sum(v for k, v in self.lost.items() if k[2] == c)}
                                for c in LENGTH_CLASSES},
            "predicted_by": {place: n / misses if misses else 0.0 for place, n in self.predicted_by.most_common()},
            "predicted_by_why": {w: {place: n for (why, place), n in self.predicted_by_why.items() if why == w}
                                 for w in WHY},
        }


@dataclass
class DrafterLossBench:
    reports: list[LossReport]

    def to_dict(self) -> dict[str, object]:
        return {"runs": [r.to_dict() for r in self.reports]}

    def print(self, console: Console) -> None:
        for report in self.reports:
            d = report.to_dict()
            console.print(f"[bold]{report.traces}[/] (K = {report.max_draft}): {d['tokens_per_step']:.3f} tokens a "
                          f"step, the exact future {d['exact_tokens_per_step']:.3f}; {d['misses']} misses, "
                          f"{d['lost_tokens']} tokens lost to the exact future")
            sources = Table(title="our drafts by source")
            for c in ("source", "proposed", "accepted", "rate"):
                sources.add_column(c, justify="right")
            for s, v in d["sources"].items():
                sources.add_row(s, str(v["proposed"]), str(v["accepted"]),
                                f"{v['accepted'] / v['proposed']:.3f}" if v["proposed"] else "-")
            console.print(sources)
            why = Table(title="misses: why, and the length class of the sample")
            for c in ("why", "misses", "lost tokens", *LENGTH_CLASSES):
                why.add_column(c, justify="right")
            for w in WHY:
                by_class = [str(sum(v for k, v in report.lost.items() if k[0] == w and k[2] == c))
                            for c in LENGTH_CLASSES]
                why.add_row(w, str(d["by_why"][w]["misses"]), str(d["by_why"][w]["lost_tokens"]), *by_class)
            console.print(why)
            console.print("misses by draft position: " + ", ".join(f"{p}: {n}" for p, n in d["by_position"].items()))
            console.print(f"the missed token after its {report.match} tokens of context was in (share of misses): "
                          + ", ".join(f"{p} {s:.3f}" for p, s in d["predicted_by"].items()))


class _Corpus:
    """The (match + 1)-grams every place holds for one version's batch (module docstring)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.history: dict[str, dict[int, set[tuple[int, ...]]]] = {}   # problem -> version -> grams
        self.global_grams: dict[tuple[int, ...], set[str]] = {}         # gram -> problems whose history holds it

    def add_history(self, records: Sequence[RolloutRecord]) -> None:
        for r in records:
            grams = _grams(r.output_token_ids, self.n)
            self.history.setdefault(r.problem_id, {}).setdefault(r.policy_version, set()).update(grams)
            for g in grams:
                self.global_grams.setdefault(g, set()).add(r.problem_id)

    def places(self, gram: tuple[int, ...], problem: str, version: int) -> list[str]:
        out = [f"sealed-age-{version - v}" for v, grams in sorted(self.history.get(problem, {}).items(),
                                                                   reverse=True) if v < version and gram in grams]
        holders = self.global_grams.get(gram)
        if holders and (len(holders) > 1 or problem not in holders):
            out.append(GLOBAL)
        return out


def drafter_loss(records: Sequence[RolloutRecord], traces: str = "", max_draft: int = 16, match: int = 4,
                 window: int = 4) -> LossReport:
    """The replay with the loss attribution (module docstring); the drafter holds `window` versions."""
    report = LossReport(traces, max_draft, match)
    bank = HistoryBank(DrafterConfig.for_drafts(max_draft, window=window))
    corpus = _Corpus(match + 1)
    by_version: dict[int, list[RolloutRecord]] = {}
    for r in sorted(records, key=lambda r: (r.policy_version, r.problem_id, r.sample_index)):
        by_version.setdefault(r.policy_version, []).append(r)
    versions = sorted(by_version)
    for vi, version in enumerate(versions):
        batch = by_version[version]
        ids = [f"{r.problem_id}/{version}/{r.sample_index}" for r in batch]
        prompts = [np.asarray(r.prompt_token_ids, np.int32) for r in batch]
        outputs = [np.asarray(r.output_token_ids, np.int32) for r in batch]
        for rid, r, p in zip(ids, batch, prompts):
            bank.start_request(rid, r.problem_id, p, version)
        if vi == 0:
            for rid, o in zip(ids, outputs):
                bank.extend(rid, o)
                bank.finish_request(rid)
        else:
            _measure_batch(report, bank, corpus, batch, ids, prompts, outputs, version)
        bank.seal(version)
        corpus.add_history(batch)
    return report


def _add_output_grams(grams: set[tuple[int, ...]], prompt: np.ndarray, out: np.ndarray, start: int, end: int,
                      n: int) -> None:
    """Adds the n-grams of prompt + out that end at output positions start..end-1 (the tokens just committed).
    O(end - start + n): only the committed tokens and the n - 1 before them are read."""
    out_from = max(start - (n - 1), 0)
    head = prompt[max(len(prompt) - (n - 1 - start), 0):] if start < n - 1 else prompt[:0]
    text = np.concatenate([head, out[out_from:end]]).tolist()   # text[len(head) + j - out_from] is out[j]
    for j in range(start, end):
        at = len(head) + j - out_from
        if at + 1 >= n:
            grams.add(tuple(text[at + 1 - n:at + 1]))


def _measure_batch(report: LossReport, bank: HistoryBank, corpus: _Corpus, batch: Sequence[RolloutRecord],
                   ids: list[str], prompts: list[np.ndarray], outputs: list[np.ndarray], version: int) -> None:
    k, n = report.max_draft, corpus.n
    lengths = np.array([len(o) for o in outputs])
    lo, hi = np.quantile(lengths, (1 / 3, 2 / 3)) if len(lengths) else (0, 0)
    length_class = [LENGTH_CLASSES[int(x >= lo) + int(x >= hi)] for x in lengths]
    prompt_grams = {}
    for r, p in zip(batch, prompts):
        prompt_grams.setdefault(r.problem_id, set()).update(_grams(p.tolist(), n))
    own: list[set[tuple[int, ...]]] = [set() for _ in batch]   # grams ending in each sample's output so far
    siblings: dict[str, list[int]] = {}
    for i, r in enumerate(batch):
        siblings.setdefault(r.problem_id, []).append(i)
    pos = [0] * len(batch)
    for i in range(len(batch)):
        report.tokens += len(outputs[i])
        report.exact_steps += -(-len(outputs[i]) // (k + 1))
        if not len(outputs[i]):
            bank.finish_request(ids[i])
    active = [i for i in range(len(batch)) if len(outputs[i])]
    while active:
        still = []
        for i in active:
            out, at, problem = outputs[i], pos[i], batch[i].problem_id
            context = np.concatenate([prompts[i], out[:at]])
            proposal = bank.propose(ids[i], context, k)
            draft = proposal.tokens
            accepted = accepted_prefix(draft, out[at:at + len(draft)])
            left = len(out) - at
            if len(draft):
                report.proposed_by_source[proposal.source] += len(draft)
                report.accepted_by_source[proposal.source] += accepted
            need = min(k, left - 1)  # what the exact future has accepted: the step samples the last token itself
            if accepted < need:
                why = WHY[0] if not len(draft) else WHY[1] if accepted == len(draft) else WHY[2]
                key = (why, _position_label(accepted), length_class[i])
                report.misses[key] += 1
                report.lost[key] += need - accepted
                miss = at + accepted
                text = np.concatenate([prompts[i], out[:miss + 1]]).tolist()
                gram = tuple(text[-n:]) if len(text) >= n else None
                places = []
                if gram is not None:
                    if gram in prompt_grams[problem]:
                        places.append("prompt")
                    if gram in own[i]:
                        places.append("self")
                    if any(gram in own[s] for s in siblings[problem] if s != i):
                        places.append("live")
                    places += corpus.places(gram, problem, version)
                for place in places or [NOWHERE]:
                    report.predicted_by[place] += 1
                    report.predicted_by_why[(why, place)] += 1
            advance = min(accepted + 1, left)
            bank.extend(ids[i], out[at:at + advance])
            pos[i] = at + advance
            _add_output_grams(own[i], prompts[i], out, at, pos[i], n)
            report.steps += 1
            if pos[i] < len(out):
                still.append(i)
            else:
                bank.finish_request(ids[i])
        active = still


def drafter_loss_bench(traces: Sequence[Path], max_draft: int = 16, match: int = 4,
                       console: Console | None = None) -> DrafterLossBench:
    reports = []
    for path in traces:
        if console is not None:
            console.print(f"{path.name}: replaying")
        reports.append(drafter_loss(load_rollouts(path), str(path), max_draft, match))
    return DrafterLossBench(reports)
