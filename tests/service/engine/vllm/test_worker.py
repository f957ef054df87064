"""The classes an engine names to vLLM by their dotted paths (worker_extension_cls, the custom_class proposer) exist
where the names say, with the methods the engine calls."""

from __future__ import annotations

import importlib

from das.service.engine.vllm.engine import WORKER_EXTENSION
from das.service.engine.config import PROPOSER_CLASS
from das.service.engine.vllm.proposer import DasProposer
from das.service.engine.vllm.step_profile import StepProfileExtension
from das.service.engine.vllm.worker import DasWorkerExtension


def _resolve(dotted: str) -> type:
    module, name = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def test_the_production_worker_extension_is_in_worker_py_with_the_proposers_methods_and_the_step_timers():
    extension = _resolve(WORKER_EXTENSION)
    assert extension.__module__ == "das.service.engine.vllm.worker"
    assert issubclass(extension, DasWorkerExtension) and issubclass(extension, StepProfileExtension)
    for method in ("das_attach", "das_stats", "das_output_counts", "das_profile_start", "das_profile_take"):
        assert callable(getattr(extension, method)), method


def test_the_proposer_class_name_resolves():
    assert _resolve(PROPOSER_CLASS) is DasProposer
