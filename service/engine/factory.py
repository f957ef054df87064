"""Engines by configuration: `EngineSpec`, the one engine configuration the service takes (`kind: vllm` or `kind:
stub`), and the one place an engine is made from it (`prepare`, `create_engine`).

vLLM is imported here only inside `prepare` and `create_engine` of a vLLM engine, which run in the engine actor's
process (service/cluster/node_engine.py): the coordinator holds an `EngineSpec` without loading vLLM (the import
contract names this module as the service's one door into service/engine/vllm/).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Discriminator, Tag

from das.service.engine.config import EngineConfig
from das.service.engine.preflight import check_method_packages
from das.service.engine.protocol import Engine
from das.service.engine.stub_engine import StubEngine, StubEngineConfig


def _kind(value: Any) -> str:
    # `kind` may be left out of a vLLM engine's settings (what `das serve --engine-args` and older configs give)
    if isinstance(value, dict):
        return str(value.get("kind", "vllm"))
    return str(getattr(value, "kind", "vllm"))


EngineSpec = Annotated[Annotated[EngineConfig, Tag("vllm")] | Annotated[StubEngineConfig, Tag("stub")],
                       Discriminator(_kind)]
"""An engine's configuration: vLLM's (`EngineConfig`, the default kind) or the stub's (`StubEngineConfig`)."""


def prepare(config: EngineSpec) -> EngineSpec:
    """What fails at once, before minutes of loading (the speculative method's package), then the model directory
    this node serves (a known model name prepared here, in the engine's dtype: service/engine/vllm/models.py);
    returns the configuration naming it. A stub engine has nothing to prepare."""
    if isinstance(config, StubEngineConfig):
        return config
    check_method_packages(config.speculation)
    from das.service.engine.vllm.engine import engine_dtype
    from das.service.engine.vllm.models import prepare_model

    model = prepare_model(config.model, progress=False, dtype=engine_dtype(config.dtype))
    return config.model_copy(update={"model": str(model)})


async def create_engine(config: EngineSpec) -> Engine:
    """The engine `config` describes, loaded (seconds for a stub, minutes for vLLM with torch.compile)."""
    if isinstance(config, StubEngineConfig):
        return await StubEngine.create(config)
    from das.service.engine.vllm.engine import VllmEngine

    return await VllmEngine.create(config)
