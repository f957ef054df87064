"""The `das` command line. Each subcommand is a thin shell over a library function."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer
from rich.console import Console
from rich.markup import escape

app = typer.Typer(help="DAS rollout service: distribution-aware speculative decoding for RL rollouts.",
                  no_args_is_help=True, pretty_exceptions_show_locals=False)
bench_app = typer.Typer(help="Benchmarks that print their figures.", no_args_is_help=True)
history_app = typer.Typer(help="Rollout history files (JSONL, optionally gzipped).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
app.add_typer(history_app, name="history")

console = Console(stderr=True)


def _fail(message: str) -> NoReturn:
    # Escaped: messages quote file contents (field names, paths) that may look like rich markup.
    console.print(f"[red]error:[/red] {escape(message)}")
    raise typer.Exit(code=2)


@history_app.command("stats")
def history_stats(
    file: Annotated[Path, typer.Argument(help="History file (.jsonl or .jsonl.gz).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Counts, length quantiles per policy version, and straggler ratios."""
    from das.drafter.records import RecordError, history_stats as compute

    try:
        stats = compute(file)
    except (RecordError, OSError) as exc:
        _fail(str(exc))
    if as_json:
        print(json.dumps(stats.to_dict(), indent=2))
    else:
        stats.print(Console())


@bench_app.command("drafter")
def bench_drafter(
    traces: Annotated[Optional[Path], typer.Option(help="History file to replay (default: bundled fixture).")] = None,
    max_draft: Annotated[int, typer.Option("--max-draft", min=1, max=64, help="Draft budget K per step.")] = 16,
    arms: Annotated[str, typer.Option(help="Comma-separated arms: das, arctic-d24, arctic-d64, ngram.")] =
        "das,arctic-d24,arctic-d64,ngram",
    repeats: Annotated[int, typer.Option(min=1, help="Repeat every arm; figures are medians over repeats.")] = 3,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Replay a history file through each drafter and compare acceptance, latency and memory."""
    from das.drafter.records import RecordError
    from das.drafter.replay import default_trace_path, run_drafter_bench

    path = traces or default_trace_path()
    try:
        result = run_drafter_bench(path, max_draft=max_draft, arms=[a.strip() for a in arms.split(",") if a.strip()],
                                   repeats=repeats, progress=not as_json)
    except (RecordError, OSError, ValueError) as exc:
        _fail(str(exc))
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        result.print(Console(width=140))


@bench_app.command("simulate")
def bench_simulate(
    traces: Annotated[Optional[Path], typer.Option(help="History file to replay (default: bundled fixture).")] = None,
    cost_model: Annotated[str, typer.Option("--cost-model", help="Named model (h100-7b) or a calibrated one.")] =
        "h100-7b",
    engines: Annotated[int, typer.Option(min=1, help="Engines the batch is placed on.")] = 8,
    policy: Annotated[Optional[str], typer.Option(help="Run only this policy arm (default: all).")] = None,
    k_max: Annotated[int, typer.Option("--k-max", min=1, max=64, help="Largest draft per request per step.")] = 16,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Discrete-event replay of recorded batches under a cost model: every figure is SIMULATED."""
    from das.drafter.records import RecordError, load_rollouts
    from das.drafter.replay import default_trace_path
    from das.scheduler.cost_model import load_cost_model
    from das.scheduler.simulator import ARMS, run_simulation_bench

    path = traces or default_trace_path()
    try:
        model = load_cost_model(cost_model)
        records = load_rollouts(path)
        arms = [policy] if policy else list(ARMS)
        result = run_simulation_bench(records, str(path), model, engines, arms=arms,
                                      placement_policy=policy or "das", k_max=k_max, progress=not as_json)
    except (RecordError, OSError, ValueError) as exc:
        _fail(str(exc))
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        result.print(Console(width=140))
