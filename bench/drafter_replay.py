"""`das bench drafter`: replay a rollout history through drafters, as a batch of a real engine would see it.

For each policy version v after the first, the drafter holds the versions before v (the first version is only
ingested, never measured); then all rollouts of v are decoded together, step by step, every sample of every problem
advancing once per step, so siblings feed each other's live history. Each step asks for a draft of up to K tokens
given the true context; accepted = longest prefix of the draft equal to the true continuation; the sample advances
by accepted + 1 tokens (exactly what exact speculative sampling accepts along a sampled path), or to its end.
Every arm sees the same traces, the same order, the same K.

Drafting more tokens per step buys tokens per step at a price (every draft token is verified), so arms are compared
at equal draft tokens per step too: `das`'s frontier replays it over a grid of its draft-length knobs (the cap K per
step, and a per-request floor on its tokens' calibrated probability at the full cap), keeps the upper envelope of
(draft tokens per step, tokens per step), anchored at (0, 1) (no drafts: one token per step), and reads it at each peer's draft tokens per
step by linear interpolation (`das_vs_peer[...]["tokens_per_step_at_equal_drafts"]`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from das.bench.peers import ReplayDrafter
from das.drafter.history import DrafterConfig, HistoryBank, accepted_prefix
from das.drafter.records import RolloutRecord, load_rollouts

DEFAULT_TRACES = "traces-smollm2.jsonl.gz"


def default_trace_path(name: str = DEFAULT_TRACES) -> Path:
    """A bundled trace set (tests/fixtures in the source tree; default: the default set)."""
    path = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / name
    if not path.exists():
        raise FileNotFoundError(f"bundled trace fixture not found at {path}; pass --traces FILE")
    return path


def trace_path(name: str) -> Path:
    """A bundled trace set by its name (tests/fixtures/traces-NAME.jsonl.gz), else `name` as a path."""
    bundled = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / f"traces-{name}.jsonl.gz"
    return bundled if bundled.exists() else Path(name)


class DasDrafter:
    """Our drafter behind the replay protocol: a HistoryBank with per-problem windowed history. `min_prob`: the
    per-request floor on a draft token's calibrated cumulative acceptance probability, as the service's budget sets
    it (its price of a draft token). `keyed`: each request's sampling key is its sample index (the last
    `/`-separated field of its id), as in a trace of coupled epochs, where sample i of a problem carries the same
    key at every visit; the bank then drafts from each key's latest sample too."""

    def __init__(self, config: DrafterConfig | None = None, name: str = "das", min_prob: float = 0.0,
                 keyed: bool = False) -> None:
        self.name = name
        self.bank = HistoryBank(config)
        self.min_prob = min_prob
        self.keyed = keyed
        self._version = 0

    def begin_version(self, policy_version: int) -> None:
        self._version = policy_version

    def start_request(self, request_id: str, problem_id: str, prompt: np.ndarray) -> None:
        key = int(request_id.rsplit("/", 1)[1]) if self.keyed else None
        self.bank.start_request(request_id, problem_id, prompt, self._version, sample_key=key)

    def propose(self, request_id: str, context: np.ndarray, max_tokens: int) -> np.ndarray:
        return self.bank.propose(request_id, context, max_tokens, self.min_prob).tokens

    def extend(self, request_id: str, tokens: np.ndarray) -> None:
        self.bank.extend(request_id, tokens)

    def finish_request(self, request_id: str) -> None:
        self.bank.finish_request(request_id)

    def end_version(self, policy_version: int) -> None:
        self.bank.seal(policy_version)

    def memory_bytes(self) -> int:
        return self.bank.memory_bytes()

    def stored_tokens(self) -> int:
        return self.bank.stored_tokens()


def _arm_factories(max_draft: int) -> dict[str, Callable[[], ReplayDrafter]]:
    from das.bench import peers

    return {
        "das": lambda: DasDrafter(DrafterConfig.for_drafts(max_draft)),
        "arctic-d24": lambda: peers.ArcticSuffixDrafter(max_depth=24),
        "arctic-d64": lambda: peers.ArcticSuffixDrafter(max_depth=64),
        "ngram": lambda: peers.NgramDrafter(),
    }


@dataclass
class ArmStats:
    """Figures of one arm over the measured versions. Times in microseconds, memory in bytes."""

    tokens_per_step: float
    draft_tokens_per_step: float  # draft tokens proposed (all verified) / steps
    draft_share: float        # steps with a non-empty draft / steps
    mean_draft_len: float     # mean draft length over steps with a draft
    acceptance_rate: float    # accepted draft tokens / proposed draft tokens
    speculate_us_p50: float
    speculate_us_p99: float
    append_us_per_token: float  # extend + end-of-version work, per committed token
    bytes_per_token: float    # history memory / stored tokens, at the end of the replay
    steps: int
    tokens: int
    wall_s: float


# The das frontier's grid: caps K (draft tokens per step, at most --max-draft) with no floor, and per-request floors
# on the calibrated cumulative acceptance probability (the budget's price of a draft token) at the full cap.
FRONTIER_CAPS = (1, 2, 3, 4, 6, 8, 12, 16)
FRONTIER_FLOORS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)


@dataclass(frozen=True)
class FrontierPoint:
    """One das replay: its knobs and what it reached."""

    max_draft: int
    min_prob: float
    draft_tokens_per_step: float
    tokens_per_step: float


def frontier_grid(max_draft: int) -> list[tuple[int, float]]:
    """(cap, floor) pairs of the frontier: every FRONTIER_CAPS entry below max_draft and max_draft itself at floor 0,
    then every FRONTIER_FLOORS entry at max_draft."""
    caps = sorted({k for k in FRONTIER_CAPS if k < max_draft} | {max_draft})
    return [(k, 0.0) for k in caps] + [(max_draft, p) for p in FRONTIER_FLOORS]


def upper_envelope(points: Sequence[FrontierPoint]) -> list[FrontierPoint]:
    """The points no other point beats with fewer or equal draft tokens per step, by draft tokens per step."""
    best = -np.inf
    envelope = []
    for p in sorted(points, key=lambda p: (p.draft_tokens_per_step, -p.tokens_per_step)):
        if p.tokens_per_step > best:
            envelope.append(p)
            best = p.tokens_per_step
    return envelope


def tokens_per_step_at(envelope: Sequence[FrontierPoint], draft_tokens_per_step: float) -> float:
    """The envelope's tokens per step at `draft_tokens_per_step`, linear between its points and from (0, 1) (no
    drafts, one token a step); beyond its last point, the last point's (fewer drafts than offered are a choice)."""
    xs = [0.0] + [p.draft_tokens_per_step for p in envelope]
    ys = [1.0] + [p.tokens_per_step for p in envelope]
    return float(np.interp(draft_tokens_per_step, xs, ys))


@dataclass
class DrafterBenchResult:
    config: dict[str, object]
    arms: dict[str, ArmStats] = field(default_factory=dict)
    frontier: list[FrontierPoint] = field(default_factory=list)  # das over frontier_grid, every point

    def to_dict(self) -> dict[str, object]:
        arms: dict[str, dict[str, object]] = {k: asdict(v) for k, v in self.arms.items()}
        if self.frontier and "das" in arms:
            arms["das"]["frontier"] = [asdict(p) for p in upper_envelope(self.frontier)]
            arms["das"]["frontier_points"] = [asdict(p) for p in self.frontier]
        return {"config": self.config, "arms": arms, "das_vs_peer": self.ratios()}

    def print(self, console: Console) -> None:
        table = Table(title=f"drafter replay: {self.config['traces']} (K={self.config['max_draft']}, "
                            f"versions measured {self.config['measured_versions']})")
        headers = {"tokens_per_step": "tok/step", "draft_share": "drafted", "mean_draft_len": "draft len",
                   "acceptance_rate": "accept", "speculate_us_p50": "spec p50 us", "speculate_us_p99": "spec p99 us",
                   "append_us_per_token": "append us/tok", "bytes_per_token": "bytes/tok"}
        cols = list(headers)
        table.add_column("arm", no_wrap=True)
        for c in cols:
            table.add_column(headers[c], justify="right")
        for name, s in self.arms.items():
            table.add_row(name, *[f"{getattr(s, c):.3g}" if isinstance(getattr(s, c), float) else str(getattr(s, c))
                                  for c in cols])
        console.print(table)
        if self.frontier:
            console.print("das frontier (draft tokens/step -> tokens/step): " + ", ".join(
                f"K={p.max_draft}{f' p>={p.min_prob:g}' if p.min_prob else ''}: {p.draft_tokens_per_step:.2f} -> "
                f"{p.tokens_per_step:.3f}" for p in upper_envelope(self.frontier)))
        for name, ratios in self.ratios().items():
            console.print(f"das / {name}: " + ", ".join(f"{k} x{v:.3f}" for k, v in ratios.items()))

    def ratios(self) -> dict[str, dict[str, float]]:
        """das / each Arctic arm, measured in the same run (the goals are stated against these ratios)."""
        if "das" not in self.arms:
            return {}
        d = self.arms["das"]
        keys = ("tokens_per_step", "speculate_us_p50", "speculate_us_p99", "append_us_per_token", "bytes_per_token")
        out = {name: {k: getattr(d, k) / getattr(a, k) for k in keys if getattr(a, k)}
               for name, a in self.arms.items() if name.startswith("arctic")}
        if self.frontier:
            envelope = upper_envelope(self.frontier)
            for name, ratios in out.items():
                peer = self.arms[name]
                ratios["tokens_per_step_at_equal_drafts"] = (
                    tokens_per_step_at(envelope, peer.draft_tokens_per_step) / peer.tokens_per_step)
        return out


def replay_arm(drafter: ReplayDrafter, records: Sequence[RolloutRecord], max_draft: int,
               on_version: Callable[[int], None] | None = None) -> ArmStats:
    """Runs one drafter over the traces; the first policy version is ingested, the others measured. Request ids
    are `problem/version/sample_index`."""
    by_version: dict[int, list[RolloutRecord]] = {}
    for r in sorted(records, key=lambda r: (r.policy_version, r.problem_id, r.sample_index)):
        by_version.setdefault(r.policy_version, []).append(r)
    versions = sorted(by_version)
    spec_ns: list[int] = []
    append_ns = append_tokens = steps = tokens = drafted = accepted_total = with_draft = 0
    start = time.perf_counter()
    for vi, version in enumerate(versions):
        batch = by_version[version]
        drafter.begin_version(version)
        ids = [f"{r.problem_id}/{version}/{r.sample_index}" for r in batch]
        prompts = [np.asarray(r.prompt_token_ids, np.int32) for r in batch]
        full = [np.concatenate([p, np.asarray(r.output_token_ids, np.int32)]) for p, r in zip(prompts, batch)]
        for rid, r, p in zip(ids, batch, prompts):
            drafter.start_request(rid, r.problem_id, p)
        if vi == 0:
            for rid, f, p in zip(ids, full, prompts):
                drafter.extend(rid, f[len(p):])
                drafter.finish_request(rid)
        else:
            pos = [len(p) for p in prompts]
            active = [i for i in range(len(batch)) if pos[i] < len(full[i])]
            for i in set(range(len(batch))) - set(active):
                drafter.finish_request(ids[i])
            while active:
                still = []
                for i in active:
                    seq, at = full[i], pos[i]
                    t0 = time.perf_counter_ns()
                    draft = drafter.propose(ids[i], seq[:at], max_draft)
                    spec_ns.append(time.perf_counter_ns() - t0)
                    acc = accepted_prefix(draft, seq[at:at + len(draft)])
                    adv = min(acc + 1, len(seq) - at)
                    t0 = time.perf_counter_ns()
                    drafter.extend(ids[i], seq[at:at + adv])
                    append_ns += time.perf_counter_ns() - t0
                    append_tokens += adv
                    steps += 1
                    tokens += adv
                    drafted += len(draft)
                    accepted_total += acc
                    with_draft += len(draft) > 0
                    pos[i] = at + adv
                    if pos[i] < len(seq):
                        still.append(i)
                    else:
                        drafter.finish_request(ids[i])
                active = still
        t0 = time.perf_counter_ns()
        drafter.end_version(version)
        if vi > 0:
            append_ns += time.perf_counter_ns() - t0  # history kept at the end of a batch is insertion work too
        if on_version:
            on_version(version)
    spec = np.asarray(spec_ns, np.float64) / 1e3
    return ArmStats(
        tokens_per_step=tokens / steps if steps else 0.0,
        draft_tokens_per_step=drafted / steps if steps else 0.0,
        draft_share=with_draft / steps if steps else 0.0,
        mean_draft_len=drafted / with_draft if with_draft else 0.0,
        acceptance_rate=accepted_total / drafted if drafted else 0.0,
        speculate_us_p50=float(np.percentile(spec, 50)) if spec.size else 0.0,
        speculate_us_p99=float(np.percentile(spec, 99)) if spec.size else 0.0,
        append_us_per_token=append_ns / 1e3 / append_tokens if append_tokens else 0.0,
        bytes_per_token=drafter.memory_bytes() / max(1, drafter.stored_tokens()),
        steps=steps, tokens=tokens, wall_s=time.perf_counter() - start,
    )


def _median_stats(runs: list[ArmStats]) -> ArmStats:
    """Field-wise median over repeats (the acceptance figures are deterministic; the timings are not)."""
    fields = asdict(runs[0])
    return ArmStats(**{k: type(v)(np.median([getattr(r, k) for r in runs])) for k, v in fields.items()})


def run_drafter_bench(traces: Path, max_draft: int = 16, arms: Sequence[str] = ("das",), repeats: int = 1,
                      progress: bool = True, frontier: bool = False) -> DrafterBenchResult:
    """Every arm `repeats` times (medians); with `frontier` and the das arm, das once more per frontier_grid point
    (tokens per step do not depend on timing, so once is enough)."""
    factories = _arm_factories(max_draft)
    unknown = [a for a in arms if a not in factories]
    if unknown:
        raise ValueError(f"unknown arm(s) {unknown}; known: {sorted(factories)}")
    if max_draft < 1:
        raise ValueError("max_draft must be >= 1")
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    records = load_rollouts(traces)
    versions = sorted({r.policy_version for r in records})
    if len(versions) < 2:
        raise ValueError(f"{traces}: the replay needs at least two policy versions, found {versions}")
    result = DrafterBenchResult(config={"traces": str(traces), "max_draft": max_draft, "rollouts": len(records),
                                        "measured_versions": versions[1:], "repeats": repeats})
    runs: dict[str, list[ArmStats]] = {name: [] for name in arms}
    grid = frontier_grid(max_draft) if frontier and "das" in arms else []
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("replaying", total=(repeats * len(arms) + len(grid)) * len(versions))
        for rep in range(repeats):
            for name in arms:  # arms interleaved, so a noisy spell on the machine hits them alike
                bar.update(task, description=f"replaying {name} ({rep + 1}/{repeats})")
                runs[name].append(replay_arm(factories[name](), records, max_draft,
                                             on_version=lambda _v: bar.advance(task)))
        for cap, floor in grid:
            bar.update(task, description=f"das frontier: K={cap}, floor {floor:g}")
            stats = replay_arm(DasDrafter(DrafterConfig.for_drafts(max_draft), min_prob=floor), records, cap,
                               on_version=lambda _v: bar.advance(task))
            result.frontier.append(FrontierPoint(cap, floor, stats.draft_tokens_per_step, stats.tokens_per_step))
    result.arms = {name: _median_stats(r) for name, r in runs.items()}
    return result
