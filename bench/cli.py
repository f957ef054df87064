"""The `das` program: the service's commands (`das.service.cli`) plus `das bench ...` and `das models perturb`.

Benchmarks sit above the service in the layering, so the program is assembled here, in the top layer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from das.service.cli import check_budget_name, console, emit, fail, models_app


bench_app = typer.Typer(help="Benchmarks that print their figures.", no_args_is_help=True)


def register(program: typer.Typer) -> None:
    """Adds `das bench ...` and `das models perturb` to the `das` program (entry point `bench` of the group
    `das.commands`: service/cli.py `program`)."""
    program.add_typer(bench_app, name="bench")
    models_app.command("perturb")(models_perturb)


@bench_app.command("drafter")
def bench_drafter(
    traces: Annotated[Optional[Path], typer.Option(help="History file to replay (default: bundled fixture).")] = None,
    max_draft: Annotated[int, typer.Option("--max-draft", min=1, max=64, help="Draft budget K per step.")] = 16,
    arms: Annotated[str, typer.Option(help="Comma-separated arms: das, arctic-d24, arctic-d64, ngram.")] =
        "das,arctic-d24,arctic-d64,ngram",
    repeats: Annotated[int, typer.Option(min=1, help="Repeat every arm; figures are medians over repeats.")] = 3,
    frontier: Annotated[bool, typer.Option(help="Also replay das over a grid of draft caps and probability floors "
                                                "and compare it with each peer at the peer's draft tokens per step.")]
        = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Replay a history file through each drafter and compare acceptance, latency and memory."""
    from das.bench.drafter_replay import default_trace_path, run_drafter_bench
    from das.drafter.records import RecordError

    path = traces or default_trace_path()
    try:
        result = run_drafter_bench(path, max_draft=max_draft, arms=[a.strip() for a in arms.split(",") if a.strip()],
                                   repeats=repeats, progress=not as_json, frontier=frontier)
    except (RecordError, OSError, ValueError) as exc:
        fail(str(exc))
    emit(result, as_json)


@bench_app.command("drafter-loss")
def bench_drafter_loss(
    traces: Annotated[str, typer.Option(help="Trace sets, comma-separated: bundled names (tests/fixtures/"
                                             "traces-NAME.jsonl.gz) or paths.")] = "smollm2",
    max_draft: Annotated[int, typer.Option("--max-draft", min=1, max=64, help="Draft tokens a step.")] = 16,
    match: Annotated[int, typer.Option(min=1, max=16, help="Context tokens a missed token is looked up after.")]
        = 4,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Where the drafter loses to the exact future (why, draft position, length class, our drafts by source) and
    which place held each token it missed (prompt, own text, siblings, history by policy age, other problems)."""
    from das.bench.drafter_loss import drafter_loss_bench
    from das.bench.drafter_replay import trace_path
    from das.drafter.records import RecordError

    try:
        result = drafter_loss_bench([trace_path(t.strip()) for t in traces.split(",") if t.strip()],
                                    max_draft=max_draft, match=match, console=Console(stderr=True))
    except (RecordError, OSError, ValueError) as exc:
        fail(str(exc))
    emit(result, as_json)


@bench_app.command("coupled")
def bench_coupled(
    traces: Annotated[str, typer.Option(help="Trace files, comma-separated (e.g. the GRPO example's "
                                             "OUT/<arm>/rollouts.jsonl.gz).")],
    max_draft: Annotated[int, typer.Option("--max-draft", min=1, max=64, help="Draft tokens a step.")] = 16,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """How much of each sample the same-key sample of its problem's previous visit predicts exactly (coupled seeds
    across epochs), by visit and by policy versions between them, and the drafter replayed with it and without."""
    from das.bench.coupled_epochs import coupled_bench
    from das.drafter.records import RecordError

    try:
        result = coupled_bench([Path(t.strip()) for t in traces.split(",") if t.strip()], max_draft=max_draft,
                               console=Console(stderr=True))
    except (RecordError, OSError, ValueError) as exc:
        fail(str(exc))
    emit(result, as_json)


@bench_app.command("scale")
def bench_scale(
    engines: Annotated[str, typer.Option(help="Comma-separated engine counts (each a multiple of --nodes).")] =
        "8,64,256,1024",
    samples: Annotated[str, typer.Option(help="Comma-separated samples per batch (whole groups).")] = "1024,16384",
    nodes: Annotated[int, typer.Option(min=1, help="Ray nodes of the test cluster on this machine.")] = 4,
    engines_per_actor: Annotated[int, typer.Option("--engines-per-actor", min=1,
                                                   help="Stub engines one NodeEngine actor hosts.")] = 64,
    group_size: Annotated[int, typer.Option("--group-size", min=1, help="Samples per group (n).")] = 16,
    token_ms: Annotated[float, typer.Option("--token-ms", min=0.0, help="The stub's milliseconds per output "
                                            "token (16 tokens a sample).")] = 1.0,
    repeats: Annotated[int, typer.Option(min=1, help="Batches measured per configuration; every figure is "
                                                     "their median.")] = 1,
    profile: Annotated[Optional[Path], typer.Option(help="Also profile one more batch per configuration with "
                                                         "cProfile (the event loop's thread), written here.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Batches through the gateway and coordinator over many stub engines on a multi-node Ray test cluster on
    this machine: samples/s, the coordinator process's CPU per sample and per engine event, placement time, memory,
    and a sample's time from its engine to the client. Progress on stderr."""
    from das.bench.cluster_scale import ScaleConfig, run_scale_bench

    try:
        config = ScaleConfig(engines=tuple(int(x) for x in engines.split(",") if x.strip()),
                             samples=tuple(int(x) for x in samples.split(",") if x.strip()), nodes=nodes,
                             engines_per_actor=engines_per_actor, group_size=group_size, token_s=token_ms / 1e3,
                             repeats=repeats, profile_dir=profile)
        config.check()
    except ValueError as exc:
        fail(str(exc))
    emit(run_scale_bench(config), as_json)


@bench_app.command("history")
def bench_history(
    problems: Annotated[int, typer.Option(min=1, help="Problems imported.")] = 100_000,
    tokens: Annotated[int, typer.Option(min=1, help="Output tokens imported in all.")] = 10_000_000,
    rollouts: Annotated[int, typer.Option(min=1, help="Rollouts per problem.")] = 2,
    shards: Annotated[int, typer.Option(min=1, help="History shard actors.")] = 4,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """The history store at a dataset's scale: import throughput, resident memory per token, a lookup's latency
    while the import runs, snapshot and restore times. Progress on stderr."""
    from das.bench.history_scale import HistoryScaleConfig, run_history_bench

    config = HistoryScaleConfig(problems=problems, tokens=tokens, rollouts_per_problem=rollouts, shards=shards)
    try:
        config.check()
    except ValueError as exc:
        fail(str(exc))
    emit(run_history_bench(config), as_json)


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
    from das.bench.verify import run_verify_bench

    try:
        sizes = [int(x) for x in requests.split(",") if x.strip()]
        lengths = [int(x) for x in drafts.split(",") if x.strip()]
    except ValueError:
        fail(f"--requests and --drafts take comma-separated integers, got {requests!r} and {drafts!r}")
    if not sizes or not lengths or min(sizes) < 1 or min(lengths) < 1:
        fail("--requests and --drafts need at least one value each, all >= 1")
    try:
        result = run_verify_bench(sizes, lengths, vocab=vocab, temperature=temperature, repeats=repeats,
                                  progress=not as_json)
    except (ValueError, RuntimeError) as exc:
        fail(str(exc))
    emit(result, as_json)


@bench_app.command("gpu-cost", context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                                                  "help_option_names": []})
def bench_gpu_cost(ctx: typer.Context) -> None:
    """The keyed draw on the device and a 7B-shaped decode step-cost surface, with torch and transformers only
    (no vLLM): a --cost-model for the simulator. Options: `das bench gpu-cost --help`."""
    from das.bench.gpu_cost import main

    main(ctx.args)


@bench_app.command("simulate")
def bench_simulate(
    traces: Annotated[Optional[Path], typer.Option(help="History file to replay (default: bundled fixture).")] = None,
    cost_model: Annotated[str, typer.Option("--cost-model", help="Named model (h100-7b) or a calibrated one.")] =
        "h100-7b",
    engines: Annotated[int, typer.Option(min=1, help="Engines the batch is placed on.")] = 8,
    policy: Annotated[Optional[str], typer.Option(help="Run only this policy arm (default: all).")] = None,
    arms: Annotated[Optional[str], typer.Option(help="Arms to run, comma-separated: policy names, uniform-A..B, "
                                                     "`fixed` (uniform-1..K_max, classes, das-token, das-lengths); "
                                                     "default: none, uniform-4/8/16, classes, das-token, "
                                                     "das-lengths, das.")] = None,
    k_max: Annotated[int, typer.Option("--k-max", min=1, max=64, help="Largest draft per request per step.")] = 16,
    host_ms: Annotated[str, typer.Option("--host-ms", help="Host work a step of an engine that drafts (vLLM runs it "
                                                          "without async scheduling; none keeps it hidden): "
                                                          "milliseconds, or a `das bench gpu-check --json` / `das "
                                                          "bench serve --profile --json` report to read das's "
                                                          "measured figure from.")] = "0",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Discrete-event replay of recorded batches under a cost model: every figure is SIMULATED."""
    from das.bench.drafter_replay import default_trace_path
    from das.bench.server_profile import host_ms_from
    from das.drafter.records import RecordError, load_rollouts
    from das.scheduler.cost_model import load_cost_model
    from das.scheduler.simulator import ARMS, arm_list, run_simulation_bench

    if policy and arms:
        fail("give --policy (one arm, also placed both ways) or --arms, not both")
    path = traces or default_trace_path()
    try:
        model = load_cost_model(cost_model)
        records = load_rollouts(path)
        run_arms = [policy] if policy else arm_list(arms, k_max) if arms else list(ARMS)
        result = run_simulation_bench(records, str(path), model, engines, arms=run_arms,
                                      placement_policy=policy or "das", k_max=k_max, progress=not as_json,
                                      host_s=host_ms_from(host_ms) / 1e3)
    except (RecordError, OSError, ValueError) as exc:
        fail(str(exc))
    emit(result, as_json)


@bench_app.command("budgets")
def bench_budgets(
    traces: Annotated[str, typer.Option(help="Trace sets, comma-separated: bundled names or paths.")] =
        "smollm2,qwen2.5-coder-0.5b,smollm2-66x16,heldout-qwen2.5-coder-code",
    cost_models: Annotated[str, typer.Option("--cost-models", help="Cost models, comma-separated: `cpu` (each "
                                             "bundled set's own CPU calibration), named ones, paths.")] =
        "cpu,h100-7b,h200-7b",
    host_ms: Annotated[str, typer.Option("--host-ms", help="Host prices a drafting step, comma-separated ms (a CPU "
                                                          "fit runs at 0 only: its steps include the host).")] = "0,2.5",
    engines: Annotated[str, typer.Option(help="Engines each batch is placed on, comma-separated counts; with more "
                                              "than one, a second table gives each ratio's geometric mean over "
                                              "them.")] = "8",
    k_max: Annotated[int, typer.Option("--k-max", min=1, max=64, help="Largest draft per request per step.")] = 16,
    jobs: Annotated[int, typer.Option(min=1, help="Cells simulated at once (processes).")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """The default budget against every fixed policy (uniform-1..K_max, classes, das-token, das-lengths), drafts
    free and the exact drafts, per trace set, cost model, host price and engine count: every figure is SIMULATED.
    Exits 1 where das loses to a fixed policy or is over 1.10x drafts free (with several engine counts: on their
    geometric means)."""
    from das.bench.budget_table import budget_table

    try:
        hosts = [float(h) for h in host_ms.split(",") if h.strip()]
        counts = [int(e) for e in engines.split(",") if e.strip()]
        table = budget_table([t.strip() for t in traces.split(",") if t.strip()],
                             [m.strip() for m in cost_models.split(",") if m.strip()], hosts, engines=counts,
                             k_max=k_max, jobs=jobs)
    except (OSError, ValueError) as exc:
        fail(str(exc))
    emit(table, as_json)
    result = table.to_dict()
    if not (result["passed"] if result["passed_over_engines"] is None else result["passed_over_engines"]):
        raise typer.Exit(1)


@bench_app.command("validate")
def bench_validate(
    rollouts: Annotated[Path, typer.Argument(help="A `das bench e2e --rollouts-out` file (its .runs.json beside it).")],
    cost: Annotated[str, typer.Option(help="profile: each arm's step cost fit from its step profile (runs with "
                                      "--profile), else the live fit; live: the das engine's live fit.")] = "profile",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """The simulator against a measured run: every epoch of every arm it can model (none, das, das-uniform,
    das-service) replayed on the run's engines under the run's own cost fit; SIMULATED against measured makespan."""
    from das.bench.e2e_report import validate_rollouts
    from das.drafter.records import RecordError

    if cost not in ("profile", "live"):
        fail(f"--cost must be profile or live, not {cost!r}")
    try:
        result = validate_rollouts(rollouts, cost_source="live" if cost == "live" else "profile")
    except (RecordError, OSError, ValueError, KeyError, TypeError) as exc:
        fail(str(exc))
    emit(result, as_json)


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


def models_perturb(
    src: Annotated[str, typer.Argument(help="A known model name or a model directory.")],
    dst: Annotated[Path, typer.Argument(help="Directory to write (must not exist, or be empty).")],
    scale: Annotated[float, typer.Option(min=0.0, help="Noise per tensor, relative to its RMS.")] = 0.01,
    seed: Annotated[int, typer.Option(help="Seed of the noise (same seed, same checkpoint).")] = 0,
) -> None:
    """Write a drifted checkpoint: every weight tensor plus Gaussian noise of `scale` x its RMS (for --drift)."""
    from das.bench.checkpoints import perturb_checkpoint
    from das.service.engine.vllm.models import prepare_model

    try:
        report = perturb_checkpoint(prepare_model(src, progress=True), dst, scale, seed)
    except (ValueError, OSError) as exc:
        fail(str(exc))
    console.print(f"{report.tensors} tensors, {report.parameters:,} parameters, relative change "
                  f"{report.relative_change:.4f}")
    print(report.path)


@bench_app.command("e2e")
def bench_e2e(
    ctx: typer.Context,
    model: Annotated[str, typer.Option(help="Model name (see `das models list`) or a model directory.")] = "smollm2",
    prompts: Annotated[str, typer.Option(help="Prompts JSONL file, reasoning-gym:N for N generated problems, "
                                              "or code:N for the first N of the 12 bundled code tasks.")]
        = "reasoning-gym:8",
    samples: Annotated[int, typer.Option(min=1, help="Samples per problem (the group size n).")] = 8,
    epochs: Annotated[int, typer.Option(min=1, help="Times the same prompts are run.")] = 3,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Output tokens per sample, at most.")] =
        1024,
    temperature: Annotated[float, typer.Option(min=0.0, help="Sampling temperature (0: greedy, then outputs are "
                                                             "compared token by token).")] = 0.8,
    arms: Annotated[str, typer.Option(help="Comma-separated arms: none, ngram, suffix, suffix-t, das-uniform, das, "
                                           "das-service, none-service, oracle (drafts the exact future none "
                                           "generated; after none), oracle-k (the same at a uniform K).")] =
        "none,ngram,suffix,suffix-t,das-uniform,das,das-service",
    k: Annotated[int, typer.Option("--k", min=1, max=64, help="num_speculative_tokens of every arm.")] = 8,
    dtype: Annotated[str, typer.Option(help="auto (bfloat16 where the hardware computes in it natively, else "
                                            "float32), bfloat16, float32 or float16.")] = "auto",
    max_model_len: Annotated[int, typer.Option("--max-model-len", min=16, help="Context length.")] = 2048,
    eager: Annotated[bool, typer.Option(help="Skip torch.compile (fast start, slower decode).")] = False,
    budget: Annotated[str, typer.Option(
        callback=check_budget_name,
        help="das and das-service's draft budget, a name: das (the default, on each engine's online cost fit from "
             "the model's prior), das-lengths (das's K_i from acceptance counts), either as NAME:COST_MODEL (from "
             "that prior), uniform, classes, ... (scheduler/policies.py GRAMMAR).")] = "das",
    drift: Annotated[Optional[str], typer.Option(
        help="Comma-separated checkpoint directories, one loaded before each epoch after the first, in every arm "
             "(make them with `das models perturb`).")] = None,
    repeats: Annotated[int, typer.Option(min=1, help="Independent runs (fresh engines each); tables show medians.")]
        = 1,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Every sample runs to --max-tokens (the "
                                                                  "compute-bound check).")] = False,
    seed: Annotated[int, typer.Option(min=-(2**63), max=2**63 - 1,
                                      help="Sampling and engine seed (repeat r uses seed + r; keyed sampling "
                                           "draws group g of epoch e with derive(derive(seed + r, e), g); the "
                                           "engine's 32-bit seed is (seed + r) mod 2^32).")] = 0,
    same_seeds: Annotated[bool, typer.Option("--same-seeds", help="Every epoch draws with epoch 1's seeds (then "
                                                                  "noise_floor: the share of none's samples that "
                                                                  "differ between its epochs 1 and 2, at any "
                                                                  "temperature).")] = False,
    kv_cache_gib: Annotated[int, typer.Option("--kv-cache-gib", min=1, help="CPU KV cache of each engine.")] = 2,
    sequential: Annotated[bool, typer.Option("--sequential", help="One engine alive at a time: each arm runs all "
                                                                  "its epochs, then stops (less memory; arms "
                                                                  "measured at different times).")] = False,
    profile: Annotated[bool, typer.Option("--profile", help="Time every engine step of the in-process arms: "
                                                            "forward, sampling, drafter, engine loop.")] = False,
    plot: Annotated[Optional[Path], typer.Option(help="Write a PNG: makespan per epoch, length distributions.")]
        = None,
    markdown: Annotated[Optional[Path], typer.Option(help="Write the tables as markdown.")] = None,
    rollouts_out: Annotated[Optional[Path], typer.Option(
        "--rollouts-out", help="Write every arm's samples as a history file (problem ids `<arm>/r<repeat>/<id>`, "
                               "policy version = epoch) and FILE.runs.json (measured makespans, cost fits), for "
                               "`das bench validate`.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Real engines, real model, several epochs: makespan, throughput, acceptance, rewards and output tests per
    arm and epoch (drafters keep their history)."""
    import asyncio

    from das.bench.e2e import E2EConfig, E2EFailed, run_e2e, suffix_tuned_options, write_rollouts_file
    from das.bench.e2e_report import markdown as render_markdown
    from das.bench.e2e_report import plot as render_plot
    from das.bench.e2e_report import print_tables
    from das.scheduler.cost_model import prior_cost_model
    from das.scheduler.policies import parse_budget
    from das.service.client.prompt_sets import PromptSetError, load_prompt_set
    from das.service.engine.vllm.engine import engine_dtype
    from das.service.engine.vllm.models import prepare_model

    arm_names = tuple(a.strip() for a in arms.split(",") if a.strip())
    try:
        problems = load_prompt_set(prompts)
        das_budget = parse_budget(budget)
        model_dir = prepare_model(model, progress=True, dtype=engine_dtype(dtype))
        # the budget's own cost model, else the prior of the directory the engines serve (a cast copy,
        # `<name>-<dtype>`, has its own): suffix-t is tuned from a cost model whichever budget das uses
        cost = das_budget.cost_prior() if das_budget.names_cost_model() else prior_cost_model(str(model_dir))
        suffix_tuned = suffix_tuned_options(cost, len(problems) * samples)
        config = E2EConfig(model=str(model_dir), prompts=prompts, samples=samples, epochs=epochs,
                           max_tokens=max_tokens, temperature=temperature, arms=arm_names, num_speculative_tokens=k,
                           dtype=dtype, max_model_len=max_model_len, seed=seed, enforce_eager=eager,
                           ignore_eos=ignore_eos, repeats=repeats,
                           drift=tuple(d.strip() for d in drift.split(",") if d.strip()) if drift else (),
                           budget=das_budget.fields(), suffix_tuned=suffix_tuned if "suffix-t" in arm_names else {},
                           kv_cache_gib=kv_cache_gib, sequential=sequential, profile=profile,
                           same_seeds=same_seeds)
    except (PromptSetError, OSError, ValueError) as exc:
        fail(str(exc))
    console.print(f"[cyan]das budget {escape(budget)} (prior {escape(cost.name)}); suffix-t {suffix_tuned}[/cyan]")
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
    if rollouts_out is not None:
        written = write_rollouts_file(result, rollouts_out)
        console.print(f"[cyan]{written} samples written to {escape(str(rollouts_out))} (+ .runs.json)[/cyan]")
    if plot is not None:
        render_plot(result, plot)
    if markdown is not None:
        markdown.parent.mkdir(parents=True, exist_ok=True)
        markdown.write_text(render_markdown(result, _command_line(ctx)) + "\n")
    if as_json:
        emit(result, as_json)
    else:
        print_tables(result, Console(width=140))


@bench_app.command("serve")
def bench_serve(
    arms: Annotated[str, typer.Option(help="Comma-separated `das serve --speculation` values; the first is the "
                                           "baseline of the ratios; oracle / oracle-k (with none): das drafting "
                                           "none's exact outputs, with the bound; ARM@2 runs ARM's server again "
                                           "(none,das,none@2: the noise floor).")] = "none,das",
    problems: Annotated[str, typer.Option(help="JSONL prompt file, reasoning-gym:N or code:N.")] = "reasoning-gym:8",
    samples: Annotated[int, typer.Option(min=1, help="Samples per problem.")] = 8,
    epochs: Annotated[int, typer.Option(min=1)] = 3,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1)] = 512,
    temperature: Annotated[float, typer.Option(min=0.0)] = 0.8,
    repeats: Annotated[int, typer.Option(min=1, help="Fresh servers per arm; tables show medians.")] = 3,
    seed: Annotated[int, typer.Option(min=-(2**63), max=2**63 - 1,
                                      help="Repeat r of every arm runs `das rollout --seed derive(seed, r)`: the "
                                           "arms draw the same samples.")] = 0,
    port: Annotated[int, typer.Option(help="Port of the servers (one at a time).")] = 8123,
    serve_args: Annotated[str, typer.Option("--serve-args", help="More `das serve` flags for every arm, as one "
                                                                  "string (e.g. '--eager').")] = "",
    log_dir: Annotated[Path, typer.Option("--log-dir", help="Where each server's log goes.")] = Path("bench-logs"),
    markdown: Annotated[Optional[Path], typer.Option(help="Write the table as markdown.")] = None,
    profile: Annotated[bool, typer.Option("--profile", help="Every server with --profile-steps: each arm's forward "
                                                           "pass and host time a step, by part (the JSON's `arms`: "
                                                           "what `das bench simulate --host-ms` reads); each "
                                                           "server's last /metrics kept in the log dir.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """The quick start's run as the benchmark: `das serve` per arm, `das rollout`'s epochs against it, medians of
    repeats and ratios to the first arm."""
    import shlex

    from das.bench.user_run import UserRunConfig, run_user_bench
    from das.service.client.prompt_sets import PromptSetError, load_prompt_set

    try:
        problem_set = load_prompt_set(problems)
        config = UserRunConfig(arms=tuple(a.strip() for a in arms.split(",") if a.strip()), repeats=repeats,
                               samples=samples, epochs=epochs, max_tokens=max_tokens, temperature=temperature,
                               port=port, serve_args=tuple(shlex.split(serve_args)), seed=seed,
                               k=_serve_k(shlex.split(serve_args)), profile=profile)
        result = run_user_bench(config, problem_set, problems, log_dir,
                                progress=lambda m: console.print(f"[cyan]{escape(m)}[/cyan]"))
    except (PromptSetError, OSError, ValueError, RuntimeError, TimeoutError) as exc:
        fail(str(exc))
    if markdown is not None:
        markdown.write_text(result.markdown())
    emit(result, as_json)


@bench_app.command("agent")
def bench_agent(
    arms: Annotated[str, typer.Option(help="Comma-separated `das serve --speculation` values; the first is the "
                                           "baseline of the ratios.")] = "none,das,suffix",
    model: Annotated[str, typer.Option(help="Model name (see `das models list`).")] = "smollm2",
    tasks: Annotated[int, typer.Option(min=1, help="The first N bundled code tasks, a trajectory each.")] = 12,
    epochs: Annotated[int, typer.Option(min=1)] = 3,
    turns: Annotated[int, typer.Option(min=1, help="Most model turns of a trajectory.")] = 4,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Per turn.")] = 512,
    temperature: Annotated[float, typer.Option(min=0.0)] = 0.7,
    seed: Annotated[int, typer.Option(min=-(2**63), max=2**63 - 1, help="The arms draw the same trajectories.")] = 0,
    port: Annotated[int, typer.Option(help="Port of the servers (one at a time).")] = 8124,
    serve_args: Annotated[str, typer.Option("--serve-args", help="More `das serve` flags for every arm, as one "
                                                                  "string (e.g. '--eager').")] = "",
    log_dir: Annotated[Path, typer.Option("--log-dir", help="Where each server's log goes.")] = Path("bench-logs"),
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """A multi-turn code-repair agent (write, run the tests, fix) per arm on a fresh `das serve`: per epoch
    makespan, tokens/s, prefix-cache hit rate, turns and acceptance by source, at identical trajectories."""
    import shlex

    from das.bench.agent import AgentBenchConfig, run_agent_bench
    from das.service.engine.vllm.models import prepare_model

    try:
        config = AgentBenchConfig(arms=tuple(a.strip() for a in arms.split(",") if a.strip()), model=model,
                                  tasks=tasks, epochs=epochs, turns=turns, max_tokens=max_tokens,
                                  temperature=temperature, seed=seed, port=port,
                                  serve_args=tuple(shlex.split(serve_args)))
        result = run_agent_bench(config, prepare_model(model, progress=not as_json), log_dir,
                                 progress=lambda m: console.print(f"[cyan]{escape(m)}[/cyan]"))
    except (OSError, ValueError, RuntimeError, TimeoutError) as exc:
        fail(str(exc))
    emit(result, as_json)


def _serve_k(args: list[str]) -> int:
    """The `--k` among `das serve` flags (its default 8 where absent)."""
    for i, arg in enumerate(args):
        if arg == "--k" and i + 1 < len(args):
            return int(args[i + 1])
        if arg.startswith("--k="):
            return int(arg.split("=", 1)[1])
    return 8


@bench_app.command("architecture")
def bench_architecture(
    root: Annotated[Path, typer.Option(help="Repository root (holds pyproject.toml).")] = Path("."),
    out: Annotated[Optional[Path], typer.Option(help="The .dot file to write (default ROOT/docs/architecture.dot); "
                                                     "the .svg goes beside it.")] = None,
    svg: Annotated[bool, typer.Option(help="Also render the .svg with Graphviz's `dot`, when installed.")] = True,
    depth: Annotated[int, typer.Option(min=2, help="Dotted names a room keeps (3: das.service.engine).")] = 3,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Regenerate the architecture picture from the code's imports: one box per package folder, arrows between."""
    from das.bench.architecture import ArchitectureError, write_architecture

    try:
        result = write_architecture(root, out or root / "docs" / "architecture.dot", svg=svg, depth=depth)
    except (ArchitectureError, OSError) as exc:
        fail(str(exc))
    emit(result, as_json)


@bench_app.command("weight-sync")
def bench_weight_sync(
    checkpoint: Annotated[Path, typer.Argument(help="A model directory whose safetensors carry the served model's "
                                                    "names and shapes (e.g. `das models perturb` of it).")],
    weights_root: Annotated[Path, typer.Option("--weights-root", help="The server's --weights-root, as this "
                                               "process sees it: the checkpoint arm writes there.")],
    url: Annotated[str, typer.Option(help="A running `das serve` with weight transfer on (no trainer using it: "
                                          "every sync moves its policy version).")] = "http://127.0.0.1:8000",
    token: Annotated[Optional[str], typer.Option(envvar="DAS_TOKEN", show_default=False)] = None,
    repeats: Annotated[int, typer.Option(min=1, help="Syncs per arm; figures are medians.")] = 3,
    packed: Annotated[bool, typer.Option("--packed", help="Also push over a gloo group that packs tensors into "
                                                         "256 MiB broadcasts: what packing changes.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Time a weight push (vLLM's weight transfer, no disk) against a checkpoint write + reload, same tensors."""
    from das.bench.weight_sync import time_weight_sync
    from das.service.client.weights import WeightPushError

    try:
        times = time_weight_sync(url, token, checkpoint, weights_root, repeats, packed)
    except (ValueError, OSError, WeightPushError) as exc:
        fail(str(exc))
    if as_json:
        print(json.dumps({"bytes": times.bytes, "repeats": times.repeats, "push_s": times.push_s,
                          "write_s": times.write_s, "reload_s": times.reload_s,
                          "push_packed_s": times.push_packed_s,
                          "push_gb_s": times.bytes / times.push_s / 1e9,
                          "checkpoint_gb_s": times.bytes / times.checkpoint_s / 1e9}))
        return
    console.print(f"{times.bytes / 1e6:.1f} MB of tensors, medians of {times.repeats} repeat(s)")
    for arm, seconds, rate in times.rows():
        console.print(f"{arm:<28} {seconds:8.3f} s {rate:8.3f} GB/s")


@bench_app.command("gpu-check")
def bench_gpu_check(
    arms: Annotated[Optional[str], typer.Option(help="Compared arms (keyed, identical samples expected), "
                                                     "comma-separated, none and das among them: none, das, suffix, "
                                                     "ngram. Default: none,das, plus suffix where arctic-inference "
                                                     "imports.")] = None,
    plain: Annotated[bool, typer.Option(help="Also run plain vLLM (--speculation none --model-runner auto: on a "
                                             "GPU model runner V2 with async scheduling) and compare das's speed "
                                             "with it.")] = True,
    model: Annotated[str, typer.Option(help="Model name (`das models list`) or directory.")] = "smollm2",
    problems: Annotated[str, typer.Option(help="JSONL prompt file, reasoning-gym:N or code:N.")] = "code:4",
    samples: Annotated[int, typer.Option(min=1, help="Samples per problem.")] = 2,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1)] = 128,
    temperature: Annotated[float, typer.Option(min=0.01, help="> 0: the identity check is of random sampling.")]
        = 0.8,
    dtype: Annotated[str, typer.Option(help="float32: the arms' logits agree bit for bit, so their keyed samples "
                                            "must be identical.")] = "float32",
    seed: Annotated[int, typer.Option(help="Batch seed (the same for every arm).")] = 1,
    port: Annotated[int, typer.Option(help="Port of the servers (one at a time).")] = 8124,
    serve_args: Annotated[str, typer.Option("--serve-args", help="More `das serve` flags for every server, as "
                                                                  "one string (e.g. '--eager').")] = "",
    log_dir: Annotated[Path, typer.Option("--log-dir", help="Where each server's log goes.")] = Path("bench-logs"),
    out: Annotated[Path, typer.Option("--out", help="The report as JSON.")] = Path("gpu-check.json"),
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON (progress goes to stderr).")]
        = False,
) -> None:
    """The acceptance run on one GPU: `das serve` per arm (keyed, one runner) and plain vLLM; identical samples at
    T > 0, each arm's runner and host time a step, a short e2e, the RL control plane (pause, update_weights,
    resume) and an engine kill. Exits 1 if a check fails."""
    import shlex

    from das.bench.gpu_check import GpuCheckConfig, default_arms, run_gpu_check
    from das.service.client.prompt_sets import PromptSetError, load_prompt_set

    chosen, skipped = default_arms() if arms is None else (tuple(a.strip() for a in arms.split(",") if a.strip()), [])
    try:
        config = GpuCheckConfig(arms=chosen, plain=plain, model=model, problems=problems, samples=samples,
                                max_tokens=max_tokens, temperature=temperature, dtype=dtype, seed=seed, port=port,
                                serve_args=tuple(shlex.split(serve_args)))
        report = run_gpu_check(config, load_prompt_set(problems), log_dir,
                               progress=lambda m: console.print(f"[cyan]{escape(m)}[/cyan]"), skipped=skipped)
    except (PromptSetError, OSError, ValueError) as exc:
        fail(str(exc))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    emit(report, as_json)
    console.print(f"report: {out}")
    if not report.passed:
        raise typer.Exit(1)
