"""Why an engine failed to load, and whether loading it again could help (issue 59).

A load fails either for a reason no retry mends (a configuration vLLM refuses, a package or a model directory
missing on the node, a vLLM release we refuse, a tensor parallel size the node cannot run) or for one that a fresh
process may not meet again (the process killed, out of memory while loading). The two are told apart by the
error's kind: its type and the stage of the load it came from (`classify`), never by counting restarts. A
permanent failure fails the engine for good at once, with its cause and what to do; a transient one restarts it
as a death does (service/cluster/engine_supervisor.py).

The engine actor classifies its own error (`NodeEngine.start` raises `EngineLoadError`): vLLM's exception types
never have to be unpickled in the gateway's process, which loads no vLLM. Ray's own errors (the actor's process
died) are classified where Ray raises them, in the coordinator's engine supervisor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from das.service.cluster.engine_layout import LayoutError
from das.service.engine.contract import EngineConfigError
from das.service.engine.preflight import MissingPackage, package_of
from das.service.engine.vllm_version import UnsupportedVllmVersion

Stage = Literal["model", "engine"]  # preparing the model directory on the node, or starting the engine
Reason = Literal["missing_package", "missing_model", "vllm_version", "config", "tensor_parallel", "died",
                 "out_of_memory", "error"]

PERMANENT: frozenset[str] = frozenset({"missing_package", "missing_model", "vllm_version", "config",
                                        "tensor_parallel"})

_MODEL_REMEDY = ("--model must name a known model (das models list) or a model directory present on every engine "
                 "node")
# vLLM's ValueErrors when the device's memory is taken (by a process that died and has not released it yet)
_MEMORY_WORDS = ("out of memory", "free memory", "available memory", "not enough memory")
_CONFIG_REMEDY = "change the setting the error names (das serve's flags or --engine-options)"


@dataclass(frozen=True)
class LoadFailure:
    """One failed load: `reason` (the metric's label), `cause` (the error, one line), `remedy` (what to do; empty
    for a transient failure, which is retried)."""

    reason: Reason
    cause: str
    remedy: str = ""

    @property
    def permanent(self) -> bool:
        return self.reason in PERMANENT

    def describe(self) -> str:
        return f"{self.cause}; {self.remedy}" if self.remedy else self.cause


class EngineLoadError(RuntimeError):
    """What `NodeEngine.start` raises when its load fails: the failure as classified on the engine's node, in
    plain data that Ray carries to the coordinator."""

    def __init__(self, failure: LoadFailure) -> None:
        super().__init__(failure.describe())
        self.failure = failure

    def __reduce__(self) -> tuple[type[EngineLoadError], tuple[LoadFailure]]:
        return EngineLoadError, (self.failure,)


def one_line(exc: BaseException) -> str:
    """`exc`'s type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0].strip()}" if lines else type(exc).__name__


def _memory(exc: BaseException) -> bool:
    """Out of memory: Python's, torch's (CUDA and others: `OutOfMemoryError`), or vLLM's refusal to start while
    another process holds the device's memory (a ValueError naming memory)."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    return isinstance(exc, MemoryError) or "OutOfMemoryError" in names or (
        isinstance(exc, ValueError) and any(words in str(exc).lower() for words in _MEMORY_WORDS))


def classify(exc: BaseException, stage: Stage = "engine") -> LoadFailure:
    """The failure `exc` is, raised while loading an engine at `stage`, or by Ray around the load."""
    if isinstance(exc, EngineLoadError):
        return exc.failure
    ray_failure = _ray_failure(exc)
    if ray_failure is not None:
        return ray_failure
    cause = one_line(exc)
    if isinstance(exc, MissingPackage):  # the engine node's own check: its message says what to install
        return LoadFailure("missing_package", str(exc))
    if isinstance(exc, ImportError):
        package = package_of(str(exc), getattr(exc, "name", None))
        if package is not None:
            return LoadFailure("missing_package", cause, f"install {package.distribution} on every engine node "
                                                         f"with {package.install}, or serve another --speculation")
        missing = getattr(exc, "name", None)
        return LoadFailure("missing_package", cause, f"install the package that provides "
                                                     f"{missing or 'the module named'} on every engine node")
    if isinstance(exc, UnsupportedVllmVersion):
        return LoadFailure("vllm_version", cause, "install the vLLM release the message names on every engine node")
    if isinstance(exc, LayoutError):
        return LoadFailure("tensor_parallel", cause, "change --tensor-parallel-size")
    if isinstance(exc, EngineConfigError):
        return LoadFailure("config", cause, "change the setting the message names")
    if _memory(exc):
        return LoadFailure("out_of_memory", cause)
    if stage == "model" and isinstance(exc, (ValueError, OSError)):
        return LoadFailure("missing_model", cause, _MODEL_REMEDY)
    if isinstance(exc, (FileNotFoundError, NotADirectoryError)):
        return LoadFailure("missing_model", cause, _MODEL_REMEDY)
    if isinstance(exc, (ValueError, TypeError, NotImplementedError)):  # vLLM's configuration checks raise these
        return LoadFailure("config", cause, _CONFIG_REMEDY)
    # Anything else (vLLM's "Engine core initialization failed", whose cause is in the engine core's log only) may
    # be a process killed while loading: restarted, under the restart cap.
    return LoadFailure("error", cause)


def _ray_failure(exc: BaseException) -> LoadFailure | None:
    """Ray's word that the actor's process is gone (killed, crashed, out of memory) or that the call did not run:
    transient. An application error Ray wraps is classified by its cause."""
    try:
        import ray.exceptions as errors
    except ImportError:  # pragma: no cover -- the service always has Ray
        return None
    if isinstance(exc, errors.RayTaskError) and isinstance(exc.cause, BaseException) and exc.cause is not exc:
        return classify(exc.cause)
    if isinstance(exc, errors.OutOfMemoryError):
        return LoadFailure("out_of_memory", one_line(exc))
    if isinstance(exc, (errors.RayActorError, errors.WorkerCrashedError, errors.ObjectLostError,
                        errors.NodeDiedError)):
        return LoadFailure("died", one_line(exc))
    return None
