"""The gateway's backend in tests without a model: `EngineBackend` over a `StubEngine`, as `stub_backend` makes it
(`RecordingBackend`: it also keeps the batches it was given, and can start unready)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Any

from das.service.cluster.group_aborts import GroupAborts
from das.service.cluster.rollout_backend import EngineBackend, ProgressSink
from das.service.engine.stub_engine import StubEngine, StubEngineConfig, ToolParsing, stub_tokens
from das.service.wire.api import GroupRequest, SampleResult


class RecordingBackend(EngineBackend):
    """`EngineBackend` over a `StubEngine` that keeps the groups of every batch it was asked to run (`received`, in
    call order; `runs` of them) and answers /readyz 503 until `mark_ready` when made unready (an engine still
    loading)."""

    engine: StubEngine

    def __init__(self, engine: StubEngine, ready: bool = True) -> None:
        super().__init__(engine)
        self.received: list[list[GroupRequest]] = []
        self._ready = ready

    @property
    def runs(self) -> int:
        return len(self.received)

    def mark_ready(self) -> None:
        self._ready = True

    async def ready(self) -> bool:
        return self._ready

    def generate(self, groups: Sequence[GroupRequest], on_progress: ProgressSink | None = None,
                 aborts: GroupAborts | None = None) -> AsyncGenerator[tuple[int, SampleResult], None]:
        self.received.append(list(groups))
        return super().generate(groups, on_progress, aborts)


def stub_backend(*, ready: bool = True, tool_parsing: ToolParsing | None = None, **config: Any) -> RecordingBackend:
    """A `RecordingBackend` over `StubEngine(StubEngineConfig(**config), tool_parsing)`."""
    return RecordingBackend(StubEngine(StubEngineConfig(**config), tool_parsing), ready)


def sample_tokens(group: GroupRequest, index: int, length: int) -> list[int]:
    """The `length` tokens a default stub engine draws for sample `index` of `group` (seeded, as the gateway sends
    every group)."""
    key = group.sample_key(index)
    assert key is not None, "an unseeded group: the gateway seeds every group it sends"
    return stub_tokens(key, 0, length, StubEngineConfig().vocab_size)
