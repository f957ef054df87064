"""The `das` command line. Each subcommand is a thin shell over a library function."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, Optional

import typer
from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from das.scheduler.cost_model import CostModel

# Results (tables, --json) go to stdout; vLLM logs to stdout unless told otherwise, and at INFO it logs every
# engine start in detail. Its processes inherit the environment, so this covers the engine core too.
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

app = typer.Typer(help="DAS rollout service: distribution-aware speculative decoding for RL rollouts.",
                  no_args_is_help=True, pretty_exceptions_show_locals=False)
bench_app = typer.Typer(help="Benchmarks that print their figures.", no_args_is_help=True)
history_app = typer.Typer(help="Rollout history files (JSONL, optionally gzipped).", no_args_is_help=True)
models_app = typer.Typer(help="Models that ship inside PyPI packages.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
app.add_typer(history_app, name="history")
app.add_typer(models_app, name="models")

console = Console(stderr=True)


def _fail(message: str) -> NoReturn:
    # Escaped: messages quote file contents (field names, paths) that may look like rich markup.
    console.print(f"[red]error:[/red] {escape(message)}")
    raise typer.Exit(code=2)


def _emit(result: Any, as_json: bool) -> None:
    """A bench result as one JSON object, or as its rich tables (wide: they have many columns)."""
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        result.print(Console(width=140))


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


@models_app.command("prepare")
def models_prepare(
    name: Annotated[str, typer.Argument(help="A known model name (see `das models list`) or a model directory.")],
) -> None:
    """Build (once) a ready-to-serve model directory and print its path."""
    from das.service.models import prepare_model

    try:
        path = prepare_model(name, progress=True)
    except (ValueError, OSError) as exc:
        _fail(str(exc))
    print(path)


@models_app.command("list")
def models_list() -> None:
    """Model names `--model` accepts besides a path."""
    from das.service.models import known_models

    for name in known_models():
        print(name)


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
    _emit(result, as_json)


@bench_app.command("verify")
def bench_verify(
    requests: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "8,32,128",
    drafts: Annotated[str, typer.Option(help="Comma-separated draft tokens per request.")] = "1,4",
    vocab: Annotated[int, typer.Option(min=2, help="Vocabulary size (SmolLM2: 49152).")] = 49152,
    temperature: Annotated[float, typer.Option(min=0.0, help="Sampling temperature (0: greedy).")] = 0.8,
    repeats: Annotated[int, typer.Option(min=1, help="Timed calls per case; figures are medians.")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """One verification step: vLLM's CPU rejection sampler against ours, and the plain sampler, side by side."""
    from das.drafter.bench_verify import run_verify_bench

    try:
        sizes = [int(x) for x in requests.split(",") if x.strip()]
        lengths = [int(x) for x in drafts.split(",") if x.strip()]
    except ValueError:
        _fail(f"--requests and --drafts take comma-separated integers, got {requests!r} and {drafts!r}")
    if not sizes or not lengths or min(sizes) < 1 or min(lengths) < 1:
        _fail("--requests and --drafts need at least one value each, all >= 1")
    try:
        result = run_verify_bench(sizes, lengths, vocab=vocab, temperature=temperature, repeats=repeats,
                                  progress=not as_json)
    except (ValueError, RuntimeError) as exc:
        _fail(str(exc))
    _emit(result, as_json)


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
    _emit(result, as_json)


def _budget_settings(spec: str) -> tuple[dict[str, Any], CostModel | None]:
    """`uniform`, `classes` or `das:COST_MODEL` as budget-hook settings, with the cost model (None for the first
    two)."""
    from das.scheduler.cost_model import load_cost_model

    policy, _, cost_name = spec.partition(":")
    if policy in ("uniform", "classes") and not cost_name:
        return {"policy": policy}, None
    if policy == "das" and cost_name:
        cost = load_cost_model(cost_name)
        return {"policy": "das", "c_base_s": cost.c_base_s, "c_tok_s": cost.c_tok_s}, cost
    raise ValueError(f"--budget {spec!r}: expected uniform, classes or das:COST_MODEL")


def _default_budget(model: str) -> str | None:
    """das:cpu-<model> if that cost model was calibrated here, else das:cpu-smollm2 if that was, else None."""
    from das.scheduler.cost_model import cost_model_dir

    for name in (f"cpu-{Path(model).name}", "cpu-smollm2"):
        if (cost_model_dir() / f"{name}.json").exists():
            return f"das:{name}"
    return None


def _command_line(ctx: typer.Context) -> str:
    """The running command as a shell line: its path and every option that differs from its default (so a report
    says how to rerun it, whether it came from a shell or from a test runner)."""
    import shlex

    from typer.core import TyperOption

    words = ["das", *ctx.command_path.split()[1:]]  # the program name is the test runner's under CliRunner
    for param in ctx.command.params:
        value = ctx.params.get(param.name or "")
        if not isinstance(param, TyperOption) or value == param.default or value is None:
            continue
        flag = max(param.opts, key=len)
        if param.is_flag:
            words.append(flag if value else (param.secondary_opts or [flag])[0])
        else:
            words += [flag, str(value)]
    return shlex.join(words)


@models_app.command("perturb")
def models_perturb(
    src: Annotated[str, typer.Argument(help="A known model name or a model directory.")],
    dst: Annotated[Path, typer.Argument(help="Directory to write (must not exist, or be empty).")],
    scale: Annotated[float, typer.Option(min=0.0, help="Noise per tensor, relative to its RMS.")] = 0.01,
    seed: Annotated[int, typer.Option(help="Seed of the noise (same seed, same checkpoint).")] = 0,
) -> None:
    """Write a drifted checkpoint: every weight tensor plus Gaussian noise of `scale` x its RMS (for --drift)."""
    from das.service.checkpoints import perturb_checkpoint
    from das.service.models import prepare_model

    try:
        report = perturb_checkpoint(prepare_model(src, progress=True), dst, scale, seed)
    except (ValueError, OSError) as exc:
        _fail(str(exc))
    console.print(f"{report.tensors} tensors, {report.parameters:,} parameters, relative change "
                  f"{report.relative_change:.4f}")
    print(report.path)


@bench_app.command("e2e")
def bench_e2e(
    ctx: typer.Context,
    model: Annotated[str, typer.Option(help="Model name (see `das models list`) or a model directory.")] = "smollm2",
    prompts: Annotated[str, typer.Option(help="Prompts JSONL file, or reasoning-gym:N for N generated problems.")]
        = "reasoning-gym:8",
    samples: Annotated[int, typer.Option(min=1, help="Samples per problem (the group size n).")] = 8,
    epochs: Annotated[int, typer.Option(min=1, help="Times the same prompts are run.")] = 3,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Output tokens per sample, at most.")] =
        1024,
    temperature: Annotated[float, typer.Option(min=0.0, help="Sampling temperature (0: greedy, then outputs are "
                                                             "compared token by token).")] = 0.8,
    arms: Annotated[str, typer.Option(help="Comma-separated arms: none, ngram, suffix, suffix-t, das-uniform, das, "
                                           "das-service.")] = "none,ngram,suffix,suffix-t,das-uniform,das,das-service",
    k: Annotated[int, typer.Option("--k", min=1, max=64, help="num_speculative_tokens of every arm.")] = 8,
    dtype: Annotated[str, typer.Option(help="bfloat16 or float32.")] = "bfloat16",
    max_model_len: Annotated[int, typer.Option("--max-model-len", min=16, help="Context length.")] = 2048,
    eager: Annotated[bool, typer.Option(help="Skip torch.compile (fast start, slower decode).")] = False,
    budget: Annotated[Optional[str], typer.Option(
        help="das and das-service's draft budget: uniform, classes, or das:COST_MODEL (length-aware); default "
             "das:cpu-<model> or das:cpu-smollm2, whichever was calibrated here.")] = None,
    drift: Annotated[Optional[str], typer.Option(
        help="Comma-separated checkpoint directories, one loaded before each epoch after the first, in every arm "
             "(make them with `das models perturb`).")] = None,
    repeats: Annotated[int, typer.Option(min=1, help="Independent runs (fresh engines each); tables show medians.")]
        = 1,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Every sample runs to --max-tokens (the "
                                                                  "compute-bound check).")] = False,
    seed: Annotated[int, typer.Option(help="Engine seed (repeat r uses seed + r).")] = 0,
    kv_cache_gib: Annotated[int, typer.Option("--kv-cache-gib", min=1, help="CPU KV cache of each engine.")] = 2,
    sequential: Annotated[bool, typer.Option("--sequential", help="One engine alive at a time: each arm runs all "
                                                                  "its epochs, then stops (less memory; arms "
                                                                  "measured at different times).")] = False,
    profile: Annotated[bool, typer.Option("--profile", help="Time every engine step of the in-process arms: "
                                                            "forward, sampling, drafter, engine loop.")] = False,
    plot: Annotated[Optional[Path], typer.Option(help="Write a PNG: makespan per epoch, length distributions.")]
        = None,
    markdown: Annotated[Optional[Path], typer.Option(help="Write the tables as markdown.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Real engines, real model, several epochs: makespan, throughput, acceptance, rewards and output tests per
    arm and epoch (drafters keep their history)."""
    import asyncio

    from das.service.bench_e2e import E2EConfig, E2EFailed, run_e2e, suffix_tuned_options
    from das.service.bench_report import markdown as render_markdown, plot as render_plot
    from das.service.models import prepare_model
    from das.service.prompt_sets import PromptSetError, load_prompt_set

    arm_names = tuple(a.strip() for a in arms.split(",") if a.strip())
    try:
        problems = load_prompt_set(prompts)
        spec = budget or _default_budget(model)
        if spec is None:
            if {"das", "das-service", "suffix-t"} & set(arm_names):
                raise ValueError("no cost model calibrated here for the das budget and suffix-t: run `das calibrate` "
                                 "or pass --budget")
            spec = "uniform"
        budget_settings, cost = _budget_settings(spec)
        if cost is None and "suffix-t" in arm_names:
            fallback = _default_budget(model)
            if fallback is None:
                raise ValueError("suffix-t is tuned from a cost model: run `das calibrate` or pass --budget das:NAME")
            cost = _budget_settings(fallback)[1]
        suffix_tuned = suffix_tuned_options(cost, len(problems) * samples) if cost is not None else {}
        model_dir = prepare_model(model, progress=True)
        config = E2EConfig(model=str(model_dir), prompts=prompts, samples=samples, epochs=epochs,
                           max_tokens=max_tokens, temperature=temperature, arms=arm_names, num_speculative_tokens=k,
                           dtype=dtype, max_model_len=max_model_len, seed=seed, enforce_eager=eager,
                           ignore_eos=ignore_eos, repeats=repeats,
                           drift=tuple(d.strip() for d in drift.split(",") if d.strip()) if drift else (),
                           budget=budget_settings, suffix_tuned=suffix_tuned if "suffix-t" in arm_names else {},
                           kv_cache_gib=kv_cache_gib, sequential=sequential, profile=profile)
    except (PromptSetError, OSError, ValueError) as exc:
        _fail(str(exc))
    console.print(f"[cyan]das budget {escape(spec)}; suffix-t {suffix_tuned or '-'}[/cyan]")
    try:
        result = asyncio.run(run_e2e(config, problems,
                                     progress=lambda m: console.print(f"[cyan]{escape(m)}[/cyan]")))
    except E2EFailed as exc:
        if as_json:
            print(json.dumps({"failed": str(exc), "completed": exc.completed}, indent=2))
        hint = ("" if sequential else " If an engine process was killed (exit code -9, the kernel's out-of-memory "
                "killer), run one engine at a time with --sequential or give each a smaller --kv-cache-gib.")
        console.print(f"[red]error:[/red] das bench e2e stopped at {escape(str(exc))}. The {len(exc.completed)} "
                      f"arm-epochs that finished are in the progress lines above"
                      f"{' and in the JSON' if as_json else ''}.{hint}")
        raise typer.Exit(code=1) from None
    if plot is not None:
        render_plot(result, plot)
    if markdown is not None:
        markdown.parent.mkdir(parents=True, exist_ok=True)
        markdown.write_text(render_markdown(result, _command_line(ctx)) + "\n")
    _emit(result, as_json)


@app.command("serve")
def serve(
    model: Annotated[str, typer.Option(help="Model name (see `das models list`) or a model directory on every "
                                            "node.")] = "smollm2",
    address: Annotated[Optional[str], typer.Option(help="Ray cluster to join ('auto' or HOST:PORT); default: an "
                                                        "embedded single-node cluster.")] = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    token: Annotated[Optional[str], typer.Option(envvar="DAS_TOKEN", show_default=False,
                                                 help="Bearer token every API call must carry (or $DAS_TOKEN).")]
        = None,
    weights_root: Annotated[Optional[Path], typer.Option("--weights-root",
                                                         help="POST /v1/weights paths must lie under it.")] = None,
    state_dir: Annotated[Optional[Path], typer.Option("--state-dir", help="History snapshots: restored at start, "
                                                      "written on a timer and at shutdown.")] = None,
    speculation: Annotated[str, typer.Option(help="das, none, ngram or suffix.")] = "das",
    k: Annotated[int, typer.Option("--k", min=1, max=64, help="num_speculative_tokens.")] = 8,
    dtype: Annotated[str, typer.Option(help="bfloat16 or float32.")] = "bfloat16",
    max_model_len: Annotated[int, typer.Option("--max-model-len", min=16, help="Context length.")] = 2048,
    eager: Annotated[bool, typer.Option(help="Skip torch.compile (fast start, slower decode).")] = False,
    history_shards: Annotated[int, typer.Option("--history-shards", min=1, help="HistoryStore actors.")] = 2,
    stub_engine: Annotated[bool, typer.Option("--stub-engine", help="No model: engines emit fixed 16-token "
                                                                    "samples (load tests of the service).")]
        = False,
) -> None:
    """Serve the rollout API: the gateway, the history store and one engine actor per node, over Ray.

    The port opens at once; /readyz answers 503 until every engine has loaded (about 3 minutes with
    torch.compile on the CPU, seconds with --eager). Ctrl-C (or SIGTERM) stops it and snapshots the history.
    """
    import asyncio
    import signal

    import uvicorn
    from pydantic import ValidationError

    from das.service.coordinator import RayBackend, ServiceConfig
    from das.service.gateway import GatewaySettings, create_app

    try:
        settings = GatewaySettings(token=token, weights_root=weights_root, freeze_gc=True)
        engine = ({"stub_engine": {}} if stub_engine else {"engine": {
            "model": model, "speculation": speculation, "num_speculative_tokens": k, "dtype": dtype,
            "max_model_len": max_model_len, "enforce_eager": eager}})
        config = ServiceConfig.model_validate({**engine, "address": address, "state_dir": state_dir,
                                               "history": {"shards": history_shards}})
        if not stub_engine:
            from das.service.models import prepare_model

            prepare_model(model, progress=True)  # here first: the engines reuse it, and a bad name fails now
    except (ValidationError, OSError, ValueError) as exc:
        _fail(str(exc))

    signals: list[int] = []

    def while_stopping(sig: int, frame: object) -> None:
        # uvicorn re-raises the signal that stopped it once it is done; the history snapshot must still run.
        # A second signal from the user forces the exit.
        signals.append(sig)
        if len(signals) > 1:
            console.print("[red]forced exit: the history was not snapshotted[/red]")
            os._exit(128 + sig)

    async def run() -> None:
        backend = await RayBackend.start(config, progress=lambda m: console.print(f"[cyan]{escape(m)}[/cyan]"))
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, while_stopping)  # uvicorn puts these back when it stops
        try:
            app = create_app(backend, settings)
            console.print(f"[green]serving on http://{host}:{port}[/green] (auth: {'on' if token else 'off'}; "
                          f"/readyz turns 200 once the engines have loaded)")
            await uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning")).serve()
        finally:
            console.print("[cyan]stopping: snapshotting the history, stopping the engines[/cyan]")
            await backend.close()

    asyncio.run(run())


@app.command("rollout")
def rollout_cmd(
    server: Annotated[str, typer.Option(help="The rollout server's URL.")] = "http://127.0.0.1:8000",
    problems: Annotated[str, typer.Option(help="JSONL prompt file (problem_id + messages | prompt | "
                                               "prompt_token_ids) or reasoning-gym:N.")] = "reasoning-gym:8",
    samples: Annotated[int, typer.Option(min=1, help="Samples per problem.")] = 8,
    epochs: Annotated[int, typer.Option(min=1, help="Batches of all problems, one after the other.")] = 3,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1)] = 512,
    temperature: Annotated[float, typer.Option(min=0.0)] = 0.8,
    token: Annotated[Optional[str], typer.Option(envvar="DAS_TOKEN", show_default=False,
                                                 help="The server's bearer token (or $DAS_TOKEN).")] = None,
    out: Annotated[Optional[Path], typer.Option(help="History file to write (.jsonl or .jsonl.gz).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Multi-epoch rollouts against a server, like a trainer: makespan per epoch, results as a history file."""
    from das.service.api_types import SamplingSpec
    from das.service.client import RolloutClient, RolloutError
    from das.service.prompt_sets import PromptSetError, load_prompt_set
    from das.service.rollout_run import run_rollouts

    try:
        problem_set = load_prompt_set(problems)
        sampling = SamplingSpec(max_tokens=max_tokens, temperature=temperature)
        with RolloutClient(server, token) as client:
            result = run_rollouts(client, problem_set, samples, epochs, sampling, out, console)
    except (PromptSetError, RolloutError, OSError, ValueError) as exc:
        _fail(str(exc))
    _emit(result, as_json)


@app.command("calibrate")
def calibrate_cmd(
    model: Annotated[str, typer.Option(help="Model name (smollm2) or a model directory.")] = "smollm2",
    name: Annotated[Optional[str], typer.Option(help="Name to store the cost model under (default: cpu-<model>).")]
        = None,
    batch_sizes: Annotated[str, typer.Option("--batch-sizes", help="Comma-separated batch sizes to time.")] =
        "1,4,16,32,64,128",
    decode_tokens: Annotated[int, typer.Option("--decode-tokens", min=2, help="Decode steps timed per point.")] = 16,
    repeats: Annotated[int, typer.Option(min=1, help="Timings per batch size (median).")] = 3,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Measure a real vLLM engine's step time across tokens per step; fit and store c_base + c_tok * n."""
    from das.scheduler.calibrate import calibrate, vllm_step_timer
    from das.scheduler.cost_model import save_cost_model
    from das.service.models import prepare_model

    try:
        sizes = [int(x) for x in batch_sizes.split(",") if x.strip()]
        model_dir = prepare_model(model, progress=not as_json)
        label = name or f"cpu-{Path(model).name if Path(model).exists() else model}"
        console.print(f"loading {model_dir} into vLLM ...")
        timer = vllm_step_timer(model_dir, max(sizes), decode_tokens)
        result = calibrate(label, timer, sizes, repeats,
                           source=f"measured by das calibrate: vLLM {model_dir.name}, decode batches {sizes}",
                           on_point=lambda b, t: console.print(f"  {b:4d} tokens/step: {t * 1e3:8.2f} ms"))
        path = save_cost_model(result.model)
    except (ValueError, OSError) as exc:
        _fail(str(exc))
    m = result.model
    if as_json:
        print(json.dumps({"model": m.__dict__, "points": result.points, "saved": str(path)}, indent=2))
    else:
        Console().print(f"{m.name}: c_base = {m.c_base_s * 1e3:.2f} ms, c_tok = {m.c_tok_s * 1e3:.3f} ms/token, "
                        f"fit error {m.fit_error:.1%} (relative RMS); crossover {m.crossover_tokens:.0f} tokens; "
                        f"saved to {path}")
