"""`Engine`: what the service may call on an engine, whichever kind runs (vLLM's, service/engine/vllm/engine.py
`VllmEngine`; the stub, service/engine/stub_engine.py `StubEngine`). The engine actors (service/cluster/node_engine.py)
and the in-process backend (service/cluster/rollout_backend.py `EngineBackend`) hold engines by this type only;
service/engine/factory.py makes them from their configuration.

Free of vLLM and torch: the coordinator and the gateway import it.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from das.service.engine.contract import EngineTally, StepPartTotals
from das.service.engine.runner_choice import RunnerChoice
from das.service.wire.api import GroupRequest, PauseMode, SampleResult
from das.service.wire.sample_progress import SampleProgress


class Engine(Protocol):
    """One engine serving groups of samples on an asyncio loop.

    `policy_version`: the weights served (0 before any update; bumped once per reload or push). `tally`: its
    counters, updated as it steps. `dead`: its engine core died (nothing it runs will finish). `runner`: what
    vLLM runs (None: no model runner, the stub)."""

    policy_version: int
    tally: EngineTally
    runner: RunnerChoice | None

    @property
    def dead(self) -> bool: ...

    def prompt_token_ids(self, group: GroupRequest) -> list[int]:
        """The group's prompt as token ids; EngineInputError (a ValueError) for what this engine refuses."""
        ...

    def generate(self, group: GroupRequest,
                 on_progress: Callable[[SampleProgress], None] | None = None) -> AsyncIterator[SampleResult]:
        """Each of the group's samples as it finishes; `on_progress` hears of every token but each sample's last.
        A resumed sample (`group.prefix_token_ids`) continues from its prefix."""
        ...

    # Control verbs: a route reaches them only through service/engine/control.py `apply_control`, by the verb of a
    # control message (service/wire/engine_control.py) that names the method and its keyword arguments.

    # vLLM's RL control plane (docs/design.md "vLLM's RL control plane")
    async def pause(self, mode: PauseMode = "abort", clear_cache: bool = True) -> None: ...

    async def resume(self) -> None: ...

    async def is_paused(self) -> bool: ...

    async def abort_samples(self) -> int:
        """Ends the samples in flight with finish_reason "abort"; returns how many."""
        ...

    async def reload_weights(self, checkpoint: str | os.PathLike[str], version: int | None = None) -> int:
        """Loads a checkpoint directory; returns the new policy version."""
        ...

    # vLLM's weight transfer (service/engine/vllm/weight_transfer.py); an engine without it raises EngineInputError
    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None: ...

    async def start_weight_update(self) -> None: ...

    async def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None: ...

    async def finish_weight_update(self, version: int | None = None, keep: bool = False) -> int:
        """Loads the transfer and serves it as `version`; `keep`: its tensors are kept for `save_weight_update`."""
        ...

    async def save_weight_update(self, root: str, version: int) -> str:
        """Saves the tensors kept from the last finished transfer as the checkpoint `<root>/v<version>`; its
        path."""
        ...

    async def abort_weight_update(self) -> None: ...

    async def shutdown_weight_transfer(self) -> None: ...

    async def add_history(self, rollouts: list[dict[str, Any]]) -> int:
        """Installs finished rollouts in the drafter; returns how many it kept (also what an engine actor calls on
        its engine with the history it pulled)."""
        ...

    async def drafter_stats(self) -> dict[str, Any]:
        """The proposer's figures (DasProposer.stats); empty when the engine runs no proposer of ours."""
        ...

    async def read_step_parts(self) -> StepPartTotals: ...

    async def close(self) -> None: ...
