"""`das bench budgets`: the default budget against every fixed policy, drafts free and the exact drafts, on several
trace sets, under several cost models, host prices and engine counts, one row each (`das bench simulate` per cell).
Every figure is SIMULATED.

A row passes where das is at most each fixed policy's makespan (uniform-1..K_max, classes, das-token,
das-lengths) and at most `FREE_SLACK` times the drafts-free reference's. Cells run in parallel processes (`jobs`);
each is deterministic, so the table does not depend on the machine's load.

Why engine counts: a trace set replays one batch per policy version, and on a small set (40 samples on 8 engines:
five an engine) which groups share an engine decides which sample ends last, so one cell's ratio moves by several
percent with the engine count alone. Over several counts, `Summary` gives each ratio's geometric mean: what a
policy is worth on batches like this one, not on this one placement.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from das.bench.drafter_replay import default_trace_path

# The bundled trace sets (tests/fixtures/traces-NAME.jsonl.gz) and the shipped CPU calibration of the model that
# recorded each (`cost_model.SHIPPED`): what cost model "cpu" means for that set.
TRACE_SETS: dict[str, str] = {
    "smollm2": "cpu-smollm2",
    "qwen2.5-coder-0.5b": "cpu-qwen2.5-coder-0.5b",
    "smollm2-66x16": "cpu-smollm2",
    "heldout-qwen2.5-coder-code": "cpu-qwen2.5-coder-0.5b",
    "smollm2-code": "cpu-smollm2",
    "heldout-smollm2-rg": "cpu-smollm2",
}
CPU = "cpu"
FREE_SLACK = 1.10  # issue 55: das within 1.10x of drafts free


@dataclass(frozen=True)
class Cell:
    """One simulation: a trace set (bundled name or path), a cost model (name or path; `cpu`: the set's CPU fit),
    the host's price a drafting step (milliseconds) and the engines the batch is placed on."""

    traces: str
    cost_model: str
    host_ms: float
    engines: int = 8

    def trace_path(self) -> Path:
        if self.traces in TRACE_SETS:
            return default_trace_path(f"traces-{self.traces}.jsonl.gz")
        return Path(self.traces)

    def model_name(self) -> str:
        if self.cost_model != CPU:
            return self.cost_model
        if self.traces not in TRACE_SETS:
            raise ValueError(f"cost model {CPU!r} needs a bundled trace set ({sorted(TRACE_SETS)}); for "
                             f"{self.traces} name its calibration instead")
        return TRACE_SETS[self.traces]


@dataclass(frozen=True)
class Row:
    """One cell's figures (simulated seconds and ratios): das's makespan and its ratio to none, to each fixed policy
    (`against`: arm -> das / arm), to drafts free and the exact drafts' ratio to none; `loses_to`: the fixed
    policies faster than das; `passes`: das beats every fixed policy and stays within FREE_SLACK of drafts free."""

    traces: str
    cost_model: str
    host_ms: float
    engines: int
    das_s: float
    das_over_none: float
    best_fixed: str
    das_over_best_fixed: float
    das_over_drafts_free: float
    drafts_free_over_none: float
    exact_over_none: float
    against: dict[str, float]
    loses_to: list[str]
    passes: bool


def run_cell(cell: Cell, k_max: int = 16) -> Row:
    """Simulates none, every fixed policy and das on one cell (`simulator.run_simulation_bench`)."""
    from das.drafter.records import load_rollouts
    from das.scheduler.cost_model import load_cost_model
    from das.scheduler.simulator import arm_list, run_simulation_bench

    model = load_cost_model(cell.model_name())
    bench = run_simulation_bench(load_rollouts(cell.trace_path()), cell.traces, model, cell.engines,
                                 arms=arm_list("none,fixed,das", k_max), k_max=k_max, progress=False,
                                 host_s=cell.host_ms / 1e3, references=("drafts_free", "exact_drafts"),
                                 placements=False)
    arms = {name: result.makespan_s for name, result in bench.arms.items()}
    das = arms["das"]
    fixed = {name: s for name, s in arms.items() if name not in ("none", "das")}
    against = {name: das / s for name, s in fixed.items()}
    best = min(fixed, key=fixed.__getitem__)
    free = bench.references["drafts_free"].makespan_s
    loses_to = sorted((n for n, r in against.items() if r > 1.0), key=against.__getitem__, reverse=True)
    return Row(cell.traces, model.name, cell.host_ms, cell.engines, das, das / arms["none"], best, das / fixed[best], das / free,
               free / arms["none"], bench.references["exact_drafts"].makespan_s / arms["none"], against, loses_to,
               not loses_to and das <= FREE_SLACK * free)


def _run(args: tuple[Cell, int]) -> Row:
    return run_cell(*args)


@dataclass(frozen=True)
class Summary:
    """One trace set, cost model and host price over several engine counts (`engines`): the geometric mean over
    them of das / none, das / each fixed policy (`against`), das / drafts free; `loses_to`: the fixed policies whose
    mean is under das's; `passes` as a row's, on the means."""

    traces: str
    cost_model: str
    host_ms: float
    engines: list[int]
    das_over_none: float
    das_over_drafts_free: float
    against: dict[str, float]
    loses_to: list[str]
    passes: bool

    @classmethod
    def of(cls, rows: Sequence[Row]) -> Summary:
        def mean(values: Sequence[float]) -> float:
            return math.exp(sum(math.log(v) for v in values) / len(values))

        first = rows[0]
        against = {arm: mean([r.against[arm] for r in rows]) for arm in first.against}
        loses_to = sorted((n for n, r in against.items() if r > 1.0), key=against.__getitem__, reverse=True)
        free = mean([r.das_over_drafts_free for r in rows])
        return cls(first.traces, first.cost_model, first.host_ms, [r.engines for r in rows],
                   mean([r.das_over_none for r in rows]), free, against, loses_to,
                   not loses_to and free <= FREE_SLACK)


@dataclass
class BudgetTable:
    rows: list[Row]

    def summaries(self) -> list[Summary]:
        """A summary per trace set, cost model and host price simulated at more than one engine count."""
        by_cell: dict[tuple[str, str, float], list[Row]] = {}
        for row in self.rows:
            by_cell.setdefault((row.traces, row.cost_model, row.host_ms), []).append(row)
        return [Summary.of(rows) for rows in by_cell.values() if len(rows) > 1]

    def to_dict(self) -> dict[str, Any]:
        summaries = self.summaries()
        return {"simulated": True, "free_slack": FREE_SLACK, "rows": [asdict(r) for r in self.rows],
                "passed": all(r.passes for r in self.rows),
                "over_engines": [asdict(s) for s in summaries],
                "passed_over_engines": all(s.passes for s in summaries) if summaries else None}

    def print(self, console) -> None:  # noqa: ANN001 - rich Console
        from rich.table import Table

        table = Table(title="SIMULATED: das against every fixed policy (uniform-1..K_max, classes, das-token, "
                            f"das-lengths), drafts free and the exact drafts; passes: das <= each fixed policy and "
                            f"<= {FREE_SLACK}x drafts free")
        for col in ("traces", "cost model", "host ms", "engines", "das / none", "das / best fixed",
                    "das / drafts free", "drafts free / none", "exact / none", "loses to (das / arm)", "passes"):
            table.add_column(col, justify="left" if col in ("traces", "cost model", "loses to (das / arm)")
                             else "right")
        for r in self.rows:
            table.add_row(r.traces, r.cost_model, f"{r.host_ms:g}", str(r.engines), f"{r.das_over_none:.3f}",
                          f"{r.das_over_best_fixed:.3f} ({r.best_fixed})", f"{r.das_over_drafts_free:.3f}",
                          f"{r.drafts_free_over_none:.3f}", f"{r.exact_over_none:.3f}", _losses(r),
                          "yes" if r.passes else "NO")
        console.print(table)
        summaries = self.summaries()
        if not summaries:
            return
        table = Table(title="SIMULATED: the same, geometric means over engine counts")
        for col in ("traces", "cost model", "host ms", "engines", "das / none", "das / best fixed",
                    "das / drafts free", "loses to (das / arm)", "passes"):
            table.add_column(col, justify="left" if col in ("traces", "cost model", "loses to (das / arm)")
                             else "right")
        for s in summaries:
            best = max(s.against, key=s.against.__getitem__)  # the fastest fixed policy
            table.add_row(s.traces, s.cost_model, f"{s.host_ms:g}", ",".join(map(str, s.engines)),
                          f"{s.das_over_none:.3f}", f"{s.against[best]:.3f} ({best})", f"{s.das_over_drafts_free:.3f}",
                          _losses(s), "yes" if s.passes else "NO")
        console.print(table)


def _losses(r: Row | Summary) -> str:
    """The fixed policies das loses to, worst first (four at most), with das / arm."""
    return ", ".join(f"{n} {r.against[n]:.3f}" for n in r.loses_to[:4]) + (" ..." if len(r.loses_to) > 4 else "") \
        or "-"


def budget_table(traces: Sequence[str], cost_models: Sequence[str], host_ms: Sequence[float], *,
                 engines: Sequence[int] = (8,), k_max: int = 16, jobs: int = 1, progress: bool = True) -> BudgetTable:
    """Every traces x cost model x host price x engine count cell (a CPU fit only at host 0: its steps were measured
    whole, the host's work included), `jobs` at a time; with `progress`, a line on stderr as each cell ends (a cell
    takes minutes)."""
    import time

    from rich.console import Console

    if not engines or min(engines) < 1:
        raise ValueError(f"engine counts must be at least 1, got {list(engines)}")
    cells = [Cell(t, m, h, e) for t in traces for m in cost_models for h in host_ms for e in engines
             if not (m == CPU and h)]
    for cell in cells:  # refuse bad names before any work
        cell.model_name()
        if not cell.trace_path().exists():
            raise ValueError(f"trace set {cell.traces}: no file at {cell.trace_path()}")
    work = [(cell, k_max) for cell in cells]
    err = Console(stderr=True, soft_wrap=True)
    start = time.monotonic()

    def done(i: int, row: Row) -> Row:
        if progress:
            err.print(f"[{i}/{len(cells)}] {row.traces} under {row.cost_model}, host {row.host_ms:g} ms, "
                      f"{row.engines} engines: das / none "
                      f"{row.das_over_none:.3f}, das / best fixed {row.das_over_best_fixed:.3f} ({row.best_fixed}) "
                      f"[{time.monotonic() - start:.0f} s]", highlight=False)
        return row

    if progress:
        err.print(f"simulating {len(cells)} cells, {jobs} at a time", highlight=False)
    if jobs <= 1:
        return BudgetTable([done(i, _run(args)) for i, args in enumerate(work, 1)])
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(_run, args) for args in work]
        return BudgetTable([done(i, future.result()) for i, future in enumerate(futures, 1)])
