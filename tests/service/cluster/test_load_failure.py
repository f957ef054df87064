"""An engine's load failure told permanent or transient by the error's kind (service/cluster/load_failure.py), with
what to do for a permanent one; no Ray cluster (Ray's exception types only)."""

from __future__ import annotations

import pickle

import pytest
import ray.exceptions
from pydantic import BaseModel, ValidationError, field_validator

from das.service.cluster.engine_layout import cpu_engine_error
from das.service.cluster.load_failure import EngineLoadError, LoadFailure, classify
from das.service.engine.contract import EngineConfigError
from das.service.engine.preflight import MissingPackage
from das.service.engine.vllm_version import UnsupportedVllmVersion


class OutOfMemoryError(RuntimeError):
    """Named as torch's (torch.cuda.OutOfMemoryError and the others share the name)."""


class _VllmLikeConfig(BaseModel):
    max_model_len: int

    @field_validator("max_model_len")
    @classmethod
    def _fits(cls, value: int) -> int:
        raise ValueError(f"max_model_len {value} is greater than the model's 2048")


def _validation_error() -> ValidationError:
    try:
        _VllmLikeConfig(max_model_len=9999)
    except ValidationError as exc:
        return exc
    raise AssertionError("no error")


@pytest.mark.parametrize(("error", "stage", "reason", "remedy"), [
    # vLLM's own words for `--speculation suffix` without ArcticInference
    (ImportError("Arctic Inference is required for suffix decoding. Install via `pip install "
                 "arctic-inference==0.1.1`."), "engine", "missing_package", "arctic-inference"),
    (ModuleNotFoundError("No module named 'flashinfer'", name="flashinfer"), "engine", "missing_package",
     "flashinfer"),
    (UnsupportedVllmVersion("vllm 0.33.0 is not a vLLM release this service is tested with"), "engine",
     "vllm_version", "vLLM release"),
    (EngineConfigError("keyed sampling is implemented for vLLM's cuda and cpu samplers, not rocm's"), "engine",
     "config", "setting"),
    (cpu_engine_error(3, 2, 1, "node n1"), "engine", "tensor_parallel", "--tensor-parallel-size"),
    (ValueError("unknown model '/no/such/dir': not a directory"), "model", "missing_model", "--model"),
    (FileNotFoundError(2, "No such file or directory", "/models/m/config.json"), "engine", "missing_model",
     "--model"),
    (_validation_error(), "engine", "config", "setting"),
    (NotImplementedError("speculative decoding is not supported on this platform"), "engine", "config", "setting"),
])
def test_an_error_no_retry_mends_is_permanent_with_what_to_do(error: BaseException, stage: str, reason: str,
                                                             remedy: str) -> None:
    failure = classify(error, stage)  # type: ignore[arg-type]
    assert failure.reason == reason and failure.permanent, failure
    assert failure.cause.startswith(type(error).__name__)
    assert remedy in failure.remedy and failure.describe() == f"{failure.cause}; {failure.remedy}"


@pytest.mark.parametrize(("error", "reason"), [
    (MemoryError(), "out_of_memory"),
    (OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "out_of_memory"),
    (ValueError("Free memory on device (3.1/79.2 GiB) on startup is less than desired GPU memory utilization"),
     "out_of_memory"),
    # vLLM's word when its engine core process ended while starting; the cause is in the core's own log only
    (RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}"), "error"),
    (ray.exceptions.ActorDiedError(), "died"),
    (ray.exceptions.ActorUnavailableError("the actor's node is unreachable", None), "died"),
    (ray.exceptions.OutOfMemoryError("Task was killed due to the node running low on memory"), "out_of_memory"),
])
def test_a_process_killed_or_out_of_memory_while_loading_is_transient(error: BaseException, reason: str) -> None:
    failure = classify(error)
    assert failure.reason == reason and not failure.permanent and failure.remedy == ""
    assert failure.describe() == failure.cause


def test_the_engine_nodes_classification_crosses_ray_as_it_was_made() -> None:
    """NodeEngine.start raises EngineLoadError with the failure classified on its node: Ray pickles it and hands it
    over as a RayTaskError that is also an EngineLoadError; the coordinator reads the same failure."""
    failure = classify(ImportError("Arctic Inference is required for suffix decoding."))
    error = EngineLoadError(failure)
    assert pickle.loads(pickle.dumps(error)).failure == failure
    wrapped = ray.exceptions.RayTaskError("NodeEngine.start", "Traceback ...", error).as_instanceof_cause()
    assert classify(wrapped) == failure and classify(wrapped, "model") == failure
    # an error of the engine node's own check names its remedy once
    missing = MissingPackage("--speculation suffix needs arctic-inference, which cannot be imported here: install it")
    assert classify(missing) == LoadFailure("missing_package", str(missing))


def test_the_cpu_rule_follows_vllms_binding_of_workers_to_cpus_and_numa_nodes() -> None:
    assert cpu_engine_error(1, 1, 1) is None
    assert cpu_engine_error(2, 8, 2) is None and cpu_engine_error(2, 2, None) is None  # bound by hand: CPUs only
    assert "2 CPU(s), too few for --tensor-parallel-size 3" in str(cpu_engine_error(3, 2, None, "node n1"))
    assert "use --tensor-parallel-size 1 there" in str(cpu_engine_error(3, 2, 1))
    numa = str(cpu_engine_error(4, 64, 2))
    assert "2 NUMA node(s)" in numa and "--tensor-parallel-size 2 or less" in numa
    assert "VLLM_CPU_OMP_THREADS_BIND" in numa
