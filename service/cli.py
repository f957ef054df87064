"""The `das` program: the service's commands (`serve`, `rollout`, `calibrate`, `history`, `models`), each a thin
shell over a library function, plus the command groups installed packages register under the entry-point group
`das.commands` (the benchmarks, the layer above the service: `das bench`, `das models perturb`; `program`)."""

from __future__ import annotations

import importlib.metadata
import json
import os
from pathlib import Path
from typing import Annotated, Any, NoReturn, Optional

import typer
from rich.console import Console
from rich.markup import escape

from das.scheduler.policies import GRAMMAR, parse_budget
from das.service.serve_flags import SERVE_FLAGS, FlagValues, with_config_flags

# Results (tables, --json) go to stdout; vLLM logs to stdout unless told otherwise, and at INFO it logs every
# engine start in detail. Its processes inherit the environment, so this covers the engine core too.
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

app = typer.Typer(help="DAS rollout service: distribution-aware speculative decoding for RL rollouts.",
                  no_args_is_help=True, pretty_exceptions_show_locals=False)
history_app = typer.Typer(help="Rollout history files (JSONL, optionally gzipped).", no_args_is_help=True)
models_app = typer.Typer(help="Models that ship inside PyPI packages.", no_args_is_help=True)
app.add_typer(history_app, name="history")
app.add_typer(models_app, name="models")

console = Console(stderr=True)

# Entry-point group of command groups other packages add to `das` (each entry: a function taking the program).
COMMANDS_GROUP = "das.commands"
_registered: list[str] = []


def program() -> typer.Typer:
    """The whole `das` program: `app` with every command group registered under `COMMANDS_GROUP` (once)."""
    if not _registered:
        for entry in importlib.metadata.entry_points(group=COMMANDS_GROUP):
            entry.load()(app)
            _registered.append(entry.name)
    return app


def main() -> None:
    """The `das` console script."""
    program()()


def fail(message: str) -> NoReturn:
    # Escaped: messages quote file contents (field names, paths) that may look like rich markup. One line, however
    # long: the last line of a command that failed says why (a log collector keeps lines apart).
    console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True)
    raise typer.Exit(code=2)


def emit(result: Any, as_json: bool) -> None:
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
    from das.drafter.records import RecordError
    from das.drafter.records import history_stats as compute

    try:
        stats = compute(file)
    except (RecordError, OSError) as exc:
        fail(str(exc))
    if as_json:
        print(json.dumps(stats.to_dict(), indent=2))
    else:
        stats.print(Console())


@models_app.command("prepare")
def models_prepare(
    name: Annotated[str, typer.Argument(help="A known model name (see `das models list`) or a model directory.")],
    dtype: Annotated[str, typer.Option(help="auto (the dtype `das serve --dtype auto` serves in on this machine), "
                                            "float32, bfloat16 or float16.")] = "auto",
) -> None:
    """Build (once) a ready-to-serve model directory in the dtype it will be served in and print its path."""
    from das.service.engine.serving_dtype import build_dtype
    from das.service.engine.vllm.models import prepare_model

    try:
        path = prepare_model(name, progress=True, dtype=build_dtype(dtype))
    except (ValueError, OSError) as exc:
        fail(str(exc))
    print(path)


@models_app.command("list")
def models_list() -> None:
    """Model names `--model` accepts besides a path."""
    from das.service.engine.vllm.models import known_models

    for name in known_models():
        print(name)


def merge_engine_options(flags: dict[str, Any], options: str) -> dict[str, Any]:
    """The engine settings of `das serve`'s flags (`flags`) with `--engine-options` (a JSON object) merged in, one
    level deep for nested settings (`budget`, `drafter`). A key a flag sets is refused, so one setting has one
    source. Raises ValueError naming the key or the JSON error."""
    try:
        extra = json.loads(options)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--engine-options is not JSON: {exc}") from None
    if not isinstance(extra, dict):
        raise ValueError("--engine-options must be a JSON object of engine settings")
    merged = dict(flags)
    for key, value in extra.items():
        if isinstance(flags.get(key), dict) and isinstance(value, dict):
            clash = sorted(set(value) & set(flags[key]))
            if clash:
                raise ValueError(f"--engine-options: {key}.{clash[0]} is set by a flag; use the flag")
            merged[key] = {**flags[key], **value}
        elif key in flags:
            raise ValueError(f"--engine-options: {key} is set by a flag; use the flag")
        else:
            merged[key] = value
    return merged


def check_budget_name(name: str) -> str:
    """A `--budget` option's callback: a name of the budget grammar (scheduler/policies.py), refused as the command
    line is read, before anything starts."""
    try:
        parse_budget(name)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    return name


@app.command("serve")
@with_config_flags(SERVE_FLAGS)
def serve(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    state_dir: Annotated[Optional[Path], typer.Option("--state-dir", help="History snapshots (restored at start, "
                                                      "written on a timer and at shutdown) and the journal of "
                                                      "accepted batches (an id an earlier run accepted gets "
                                                      "409, not a second run), and the open agent sessions "
                                                      "(continued after a restart).")] = None,
    budget: Annotated[str, typer.Option(callback=check_budget_name,
                                        help="Draft budget of --speculation das, a name: das (length-aware, on each "
                                             "engine's online step-cost fit), uniform (K every step), classes "
                                             f"(16/8/4 by predicted length), ...: {GRAMMAR}.")] = "das",
    oracle_file: Annotated[Optional[Path], typer.Option("--oracle-file", help="Benchmarks only (`das bench serve "
                                                        "--arms none,oracle`): recorded outputs by sample key that "
                                                        "those samples draft (--speculation das).")] = None,
    engine_options: Annotated[Optional[str], typer.Option("--engine-options", help="More engine settings as a "
                                                          "JSON object of EngineConfig fields no flag sets, e.g. "
                                                          "'{\"drafter\": {\"min_prob\": 0.05}, \"budget\": "
                                                          "{\"per_token\": true}}'.")] = None,
    stub_engine: Annotated[bool, typer.Option("--stub-engine", help="No model: engines emit fixed 16-token "
                                                                    "samples (load tests of the service).")]
        = False,
    *,
    config_flags: FlagValues,
) -> None:
    """Serve the rollout API: the gateway, the history store and one engine actor per node, over Ray.

    The port opens at once; /readyz answers 503 until every engine has loaded (about 3 minutes with
    torch.compile on the CPU, seconds with --eager). Ctrl-C (or SIGTERM, to this process or its whole process
    group) snapshots the history at once, then stops. A configuration no engine can load (a package the method
    needs, the model directory, the tensor parallel size) is refused before the engines start where this node can
    tell, else it ends the command once the engines fail to load it (exit status 2, the cause on the last line).
    """
    import asyncio
    import signal
    from types import FrameType

    import uvicorn
    from pydantic import ValidationError

    from das.service.cluster.coordinator import RayBackend
    from das.service.cluster.engine_layout import LayoutError
    from das.service.cluster.load_failure import classify
    from das.service.config import BatchJournalConfig, GatewayConfig, ServiceConfig, traces_url
    from das.service.engine.preflight import MissingPackage
    from das.service.http.gateway import create_app
    from das.service.http.request_guard import server_config
    from das.service.state_dir_lock import StateDirInUse, lock_state_dir

    gateway = config_flags.fields("gateway")
    engine = config_flags.fields("engine", stub=stub_engine)
    address = config_flags.values["address"]
    try:
        # held until the process ends: a second das serve on this state directory refuses to start
        state_lock = lock_state_dir(state_dir) if state_dir is not None else None
        if gateway["otlp_traces_endpoint"] is not None:
            # checked here for its own message: pydantic's would echo the URL, credentials and all
            gateway["otlp_traces_endpoint"] = traces_url(gateway["otlp_traces_endpoint"])
        try:
            settings = GatewayConfig.model_validate({
                **gateway, "freeze_gc": True,
                "batch_journal": BatchJournalConfig(state_dir=state_dir) if state_dir is not None else None})
        except ValidationError as exc:
            raise ValueError(config_flags.explain("gateway", exc)) from None
        if stub_engine:
            engine["kind"] = "stub"
            if engine_options is not None:
                raise ValueError("--engine-options: the stub engine takes none")
        else:
            # vLLM's own request spans go to the gateway's collector, under the sample spans (tracing.py)
            engine.update(kind="vllm", budget=parse_budget(budget).fields(),
                          otlp_traces_endpoint=settings.otlp_traces_endpoint)
            if oracle_file is not None:
                engine["oracle_file"] = str(oracle_file.resolve())
            if engine_options is not None:
                engine = merge_engine_options(engine, engine_options)
        try:
            config = ServiceConfig.model_validate({**config_flags.fields("service"), "engine": engine,
                                                   "state_dir": state_dir})
        except ValidationError as exc:
            raise ValueError(config_flags.explain("service", exc)) from None
        if not stub_engine:
            from das.service.engine.preflight import check_method_packages
            from das.service.engine.serving_dtype import build_dtype
            from das.service.engine.vllm.models import prepare_model
            from das.service.engine.vllm_version import check_vllm_version

            check_vllm_version()  # UnsupportedVllmVersion is a ValueError: refused below, before anything starts
            if address is None:  # this node runs the engines (a joined cluster's engine nodes check their own)
                check_method_packages(engine["speculation"])  # MissingPackage: vLLM imports it only once it loads
            if settings.tool_call_parser is not None:
                from das.service.engine.vllm.tool_calls import tool_parser_names

                if settings.tool_call_parser not in tool_parser_names():
                    raise ValueError(f"--tool-call-parser {settings.tool_call_parser!r} is not a vLLM tool-call "
                                     f"parser; vLLM has {', '.join(tool_parser_names())}")

            # here first, in the dtype the engines serve: they reuse it, and a bad name fails now
            try:
                prepare_model(engine["model"], progress=True, dtype=build_dtype(engine["dtype"]))
            except (OSError, ValueError) as exc:
                raise ValueError(f"{exc}; {classify(exc, 'model').remedy}") from None
    except (OSError, ValueError, MissingPackage, StateDirInUse) as exc:
        fail(str(exc))

    signals: list[int] = []

    def while_stopping(sig: int, frame: object) -> None:
        # uvicorn re-raises the signal that stopped it once it is done; the history snapshot must still run.
        # A second signal from the user forces the exit.
        signals.append(sig)
        if len(signals) > 1:
            console.print("[red]forced exit: the history was not snapshotted[/red]")
            os._exit(128 + sig)

    async def run() -> str | None:
        """Serves until a signal (None) or until no engine can ever load (why)."""
        # The processes of an embedded Ray cluster (GCS, raylet, the workers it starts) inherit the signal mask: with
        # SIGTERM blocked, a SIGTERM sent to the whole process group (a container stop) reaches only this process,
        # which snapshots the history and then stops Ray (whose shutdown kills what does not exit). Ray shields its
        # processes from the group's SIGINT (Ctrl-C) the same way.
        shielded = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}) if address is None else None
        try:
            backend = await RayBackend.start(config, progress=lambda m: console.print(f"[cyan]{escape(m)}[/cyan]"))
        except LayoutError as exc:  # a node's GPUs and --tensor-parallel-size
            fail(str(exc))
        finally:
            if shielded is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, shielded)
        loop = asyncio.get_running_loop()
        snapshots: list[asyncio.Future[None]] = []

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: FrameType | None) -> None:
                # The first signal snapshots the history now: the graceful stop waits for open streams, and
                # whatever sent the signal may follow it with SIGKILL before that is done.
                if not self.should_exit:
                    loop.call_soon_threadsafe(lambda: snapshots.append(asyncio.ensure_future(backend.snapshot())))
                super().handle_exit(sig, frame)

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, while_stopping)  # uvicorn puts these back when it stops
        fatal: list[str] = []
        try:
            app = create_app(backend, settings)
            console.print(f"[green]serving on http://{host}:{port}[/green] (auth: {'on' if settings.token else 'off'}; "
                          f"/readyz turns 200 once the engines have loaded)")
            server = Server(server_config(app, settings.header_timeout_s, host=host, port=port, log_level="warning"))

            async def stop_when_unrecoverable() -> None:
                # every engine failed without ever serving (/healthz answers 503), or, in the cluster started here,
                # one cannot load (the others, on this node with the same configuration, cannot either)
                fatal.append(await backend.unrecoverable())
                server.should_exit = True

            watcher = asyncio.create_task(stop_when_unrecoverable())
            try:
                await server.serve()
            finally:
                watcher.cancel()
        finally:
            console.print("[cyan]stopping: snapshotting the history, stopping the engines[/cyan]")
            for done in await asyncio.gather(*snapshots, return_exceptions=True):
                if isinstance(done, BaseException):
                    console.print(f"[red]history snapshot at the signal failed: {escape(str(done))}[/red]")
            await backend.close()
        return fatal[0] if fatal else None

    try:
        unrecoverable = asyncio.run(run())
    finally:
        if state_lock is not None:
            state_lock.close()  # the state directory is free for the next das serve
    if unrecoverable is not None:
        fail(f"no engine can load, so das serve stops: {unrecoverable}")


@app.command("rollout")
def rollout_cmd(
    server: Annotated[str, typer.Option(help="The rollout server's URL.")] = "http://127.0.0.1:8000",
    problems: Annotated[str, typer.Option(help="JSONL prompt file (problem_id + messages | prompt | "
                                               "prompt_token_ids), reasoning-gym:N, or code:N (the first N of "
                                               "the 12 bundled code tasks).")] = "reasoning-gym:8",
    samples: Annotated[int, typer.Option(min=1, help="Samples per problem.")] = 8,
    epochs: Annotated[int, typer.Option(min=1, help="Batches of all problems, one after the other.")] = 3,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1)] = 512,
    temperature: Annotated[float, typer.Option(min=0.0)] = 0.8,
    token: Annotated[Optional[str], typer.Option(envvar="DAS_TOKEN", show_default=False,
                                                 help="The server's bearer token (or $DAS_TOKEN).")] = None,
    out: Annotated[Optional[Path], typer.Option(help="History file to write (.jsonl or .jsonl.gz).")] = None,
    seed: Annotated[Optional[int], typer.Option(min=-(2**63), max=2**63 - 1, show_default=False,
                                                help="Draw the same samples as another run with this seed (any "
                                                     "server, any --speculation); default: fresh ones.")] = None,
    coupled: Annotated[bool, typer.Option(help="Coupled epochs (needs --seed): each sample keeps its key "
                                               "every epoch, so it repeats its previous epoch's sample until a "
                                               "weight update flips a draw, and drafts from it.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Multi-epoch rollouts against a server, like a trainer: makespan per epoch, results as a history file."""
    from das.service.client import RolloutClient, RolloutError
    from das.service.client.prompt_sets import PromptSetError, load_prompt_set
    from das.service.client.rollout_run import run_rollouts
    from das.service.wire.api import SamplingSpec

    try:
        problem_set = load_prompt_set(problems)
        sampling = SamplingSpec(max_tokens=max_tokens, temperature=temperature)
        with RolloutClient(server, token) as client:
            result = run_rollouts(client, problem_set, samples, epochs, sampling, out, console, seed,
                                  coupled=coupled)
    except (PromptSetError, RolloutError, OSError, ValueError) as exc:
        fail(str(exc))
    emit(result, as_json)


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
    """Measure the served engine's step time (speculation off) across tokens per step and the price of a prompt
    token; fit and store c_base + c_tok * n and c_prefill."""
    from das.scheduler.cost_model import prior_name, save_cost_model
    from das.service.engine.vllm.engine import engine_dtype
    from das.service.engine.vllm.cost_calibration import ServedEngineTimer, calibrate
    from das.service.engine.vllm.models import prepare_model

    try:
        sizes = [int(x) for x in batch_sizes.split(",") if x.strip()]
        model_dir = prepare_model(model, progress=not as_json, dtype=engine_dtype("auto"))
        label = name or prior_name(model_dir)  # the served directory: what the engine's prior is looked up by
        console.print(f"starting the served engine on {model_dir} (speculation off) ...")
        with ServedEngineTimer(model_dir, max(sizes), decode_tokens) as timer:
            result = calibrate(label, timer, sizes, repeats,
                               source=f"measured by das calibrate: the served engine on {model_dir.name}, "
                                      f"decode batches {sizes}",
                               on_point=lambda b, t: console.print(f"  {b:4d} tokens/step: {t * 1e3:8.2f} ms"),
                               prefill=timer.prefill_token_s)
        path = save_cost_model(result.model)
    except (ValueError, OSError) as exc:
        fail(str(exc))
    m = result.model
    if as_json:
        print(json.dumps({"model": m.__dict__, "points": result.points, "saved": str(path)}, indent=2))
    else:
        Console().print(f"{m.name}: c_base = {m.c_base_s * 1e3:.2f} ms, c_tok = {m.c_tok_s * 1e3:.3f} ms/token, "
                        f"c_prefill = {m.prefill_token_s * 1e3:.3f} ms per prompt token, "
                        f"fit error {m.fit_error:.1%} (relative RMS); crossover {m.crossover_tokens:.0f} tokens; "
                        f"saved to {path}")


if __name__ == "__main__":
    main()
