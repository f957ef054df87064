"""`das serve`'s configuration flags, declared once: each names the configuration field it sets (service/config.py
`ServiceConfig` and `GatewayConfig`, service/engine/config.py `EngineConfig`) and takes its type, default, bounds
and help from that field, so a flag cannot drift from what it sets. `with_config_flags` adds them to a command;
`FlagValues` maps what the command line gave onto the configurations' fields and names the flag of a field that
fails validation. Flags that are not one field (the listening address, `--budget`'s grammar, `--state-dir`,
`--stub-engine`, `--engine-options`, `--oracle-file`) stay declared on the command itself."""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import annotated_types
import typer
from pydantic import BaseModel, SecretStr, ValidationError
from pydantic.fields import FieldInfo

from das.service.config import GatewayConfig, ServiceConfig
from das.service.engine.config import EngineConfig

Root = Literal["service", "gateway", "engine"]
ROOTS: dict[str, type[BaseModel]] = {"service": ServiceConfig, "gateway": GatewayConfig, "engine": EngineConfig}

_FIELD_DEFAULT: Any = object()  # the flag's default is its field's


@dataclass(frozen=True)
class ConfigFlag:
    """A flag that sets one field: `name` ("--max-restarts"), `path` ("service.failure.max_restarts": a root of
    `ROOTS`, then field names). `default` overrides the field's (a required field needs one); `help` adds to its
    description; `stub`: an engine field the stub engine takes too (other engine flags leave it alone)."""

    name: str
    path: str
    default: Any = _FIELD_DEFAULT
    help: str = ""
    envvar: str | None = None
    stub: bool = False

    @property
    def parameter(self) -> str:
        """The command function's parameter (and click's) name: "--max-restarts" -> "max_restarts"."""
        return self.name.lstrip("-").replace("-", "_")

    @property
    def root(self) -> str:
        return self.path.split(".", 1)[0]

    def field(self) -> FieldInfo:
        """The pydantic field the flag sets. KeyError naming the path where it leads nowhere."""
        root, *names = self.path.split(".")
        model: type[BaseModel] | None = ROOTS[root]
        info: FieldInfo | None = None
        for name in names:
            if model is None or name not in model.model_fields:
                raise KeyError(f"{self.name}: {self.path} is not a configuration field")
            info = model.model_fields[name]
            model = _model_of(info.annotation)
        if info is None:
            raise KeyError(f"{self.name}: {self.path} names no field")
        return info

    def option(self) -> inspect.Parameter:
        """The typer option: the field's type (a secret read as text), default, inclusive bounds and description."""
        info = self.field()
        bounds: dict[str, Any] = {}
        for limit in info.metadata:
            if isinstance(limit, annotated_types.Ge):
                bounds["min"] = limit.ge
            elif isinstance(limit, annotated_types.Le):
                bounds["max"] = limit.le
        described = " ".join(part for part in (_sentence(info.description), self.help) if part)
        default = info.get_default(call_default_factory=True) if self.default is _FIELD_DEFAULT else self.default
        option = typer.Option(self.name, help=described or None, envvar=self.envvar,
                              show_default=self.envvar is None, **bounds)
        return inspect.Parameter(self.parameter, inspect.Parameter.KEYWORD_ONLY, default=default,
                                 annotation=Annotated[_cli_type(info.annotation), option])


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The configuration model a field holds (itself or as `Model | None`), else None."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _cli_type(annotation: Any) -> Any:
    """The field's type as the command line reads it: a secret as text, the rest as they are."""
    if annotation is SecretStr:
        return str
    args = typing.get_args(annotation)
    if SecretStr in args:
        return typing.Optional[str]
    return annotation


def _sentence(text: str | None) -> str:
    if not text:
        return ""
    if text[:2].islower():  # "vLLM's ..." keeps its case
        text = text[0].upper() + text[1:]
    return text if text.endswith(".") else text + "."


@dataclass(frozen=True)
class FlagValues:
    """What the configuration flags were given, by root: `fields(root)` is the nested field values one root's
    model validates; `flag_of(loc)` the flag behind a pydantic error location."""

    flags: Sequence[ConfigFlag]
    values: Mapping[str, Any]  # by ConfigFlag.parameter
    _by_loc: dict[tuple[str, ...], str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_loc", {tuple(f.path.split(".")): f.name for f in self.flags})

    def fields(self, root: Root, stub: bool = False) -> dict[str, Any]:
        """The nested field values of `root` (for the engine root and `stub`, only the flags the stub takes)."""
        tree: dict[str, Any] = {}
        for flag in self.flags:
            if flag.root != root or (stub and not flag.stub):
                continue
            *parents, leaf = flag.path.split(".")[1:]
            node = tree
            for parent in parents:
                node = node.setdefault(parent, {})
            node[leaf] = self.values[flag.parameter]
        return tree

    def flag_of(self, root: Root, loc: Iterable[Any]) -> str | None:
        """The flag that set the field at `loc` (a pydantic error location under `root`; an engine kind's tag in
        it skipped), or None."""
        path = [root, *(str(part) for part in loc if part not in ("vllm", "stub"))]
        if root == "service" and path[1:2] == ["engine"]:
            path = path[1:]
        return self._by_loc.get(tuple(path))

    def explain(self, root: Root, error: ValidationError) -> str:
        """`error` in one line, each problem under the flag that set it (the input is not echoed: a value may be a
        secret)."""
        parts = []
        for problem in error.errors(include_input=False, include_url=False):
            message = problem["msg"].removeprefix("Value error, ")  # a validator's own message says it all
            where = self.flag_of(root, problem["loc"]) or ".".join(str(part) for part in problem["loc"])
            parts.append(f"{where}: {message}" if where else message)
        return "; ".join(parts)


def with_config_flags(flags: Sequence[ConfigFlag]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Adds `flags` to a typer command: the command function keeps its own parameters and gets the flags' values
    as `config_flags: FlagValues`. Each flag's path is checked when the command is declared (KeyError)."""
    for flag in flags:
        flag.field()

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        own = [p for name, p in inspect.signature(command, eval_str=True).parameters.items() if name != "config_flags"]
        names = {flag.parameter for flag in flags}

        @functools.wraps(command)
        def wrapper(**given: Any) -> Any:
            values = {name: given.pop(name) for name in names}
            return command(**given, config_flags=FlagValues(flags, values))

        parameters = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + [f.option() for f in flags]
        wrapper.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
        return wrapper

    return decorate


SERVE_FLAGS: tuple[ConfigFlag, ...] = (
    ConfigFlag("--model", "engine.model", default="smollm2",
               help="A model name (see `das models list`) or a model directory on every node."),
    ConfigFlag("--address", "service.address"),
    ConfigFlag("--token", "gateway.token", envvar="DAS_TOKEN", help="Or $DAS_TOKEN."),
    ConfigFlag("--weights-root", "gateway.weights_root"),
    ConfigFlag("--speculation", "engine.speculation"),
    ConfigFlag("--k", "engine.num_speculative_tokens"),
    ConfigFlag("--dtype", "engine.dtype"),
    ConfigFlag("--max-model-len", "engine.max_model_len"),
    ConfigFlag("--eager", "engine.enforce_eager"),
    ConfigFlag("--model-runner", "engine.model_runner"),
    ConfigFlag("--profile-steps", "engine.profile_steps"),
    ConfigFlag("--weight-transfer", "engine.weight_transfer"),
    ConfigFlag("--tensor-parallel-size", "engine.tensor_parallel_size", stub=True),
    ConfigFlag("--engines-per-node", "service.engines_per_node"),
    ConfigFlag("--target-engines", "service.target_engines"),
    ConfigFlag("--history-shards", "service.history.shards"),
    ConfigFlag("--snapshot-interval", "service.history.snapshot_interval_s", help="With --state-dir."),
    ConfigFlag("--max-restarts", "service.failure.max_restarts"),
    ConfigFlag("--restart-window", "service.failure.restart_window_s"),
    ConfigFlag("--max-group-deaths", "service.failure.max_group_deaths"),
    ConfigFlag("--header-timeout", "gateway.header_timeout_s"),
    ConfigFlag("--body-timeout", "gateway.body_timeout_s"),
    ConfigFlag("--max-body-bytes", "gateway.max_body_bytes"),
    ConfigFlag("--tool-call-parser", "gateway.tool_call_parser"),
    ConfigFlag("--enable-auto-tool-choice", "gateway.enable_auto_tool_choice"),
    ConfigFlag("--otlp-traces-endpoint", "gateway.otlp_traces_endpoint"),
    ConfigFlag("--otlp-traces-sample-ratio", "gateway.otlp_traces_sample_ratio"),
)
"""`das serve`'s flags that set one configuration field each."""

