"""What the routers beside the batch API (openai_api.py, rl_control.py) use of the gateway, as a Protocol: they
depend on it, not on the gateway's own class, so gateway.py imports the routers to mount them and nothing imports
gateway.py back. `_Gateway` in gateway.py is the one implementation."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Protocol, TypeVar

from das.service.cluster.rollout_backend import RolloutBackend
from das.service.http.weight_updates import WeightUpdates
from das.service.wire.api import RolloutRequest


class RouterSettings(Protocol):
    """The gateway settings the routers read (`GatewaySettings`)."""

    @property
    def openai_coalesce_s(self) -> float: ...

    @property
    def max_batch_samples(self) -> int: ...

    @property
    def served_model_name(self) -> str | None: ...


class BatchHandle(Protocol):
    """A batch the gateway admitted: its id, and whether it ended (done, aborted or failed)."""

    @property
    def batch_id(self) -> str: ...

    @property
    def ended(self) -> bool: ...


Batch = TypeVar("Batch", bound=BatchHandle)


class LiveBatches(Protocol[Batch]):
    @property
    def live(self) -> Mapping[str, Batch]:
        """The batches not ended yet, by batch id."""
        ...


class GatewayCore(Protocol[Batch]):
    """The gateway's batch machinery, as the OpenAI-compatible and RL-control routes drive it."""

    @property
    def settings(self) -> RouterSettings: ...

    @property
    def backend(self) -> RolloutBackend: ...

    @property
    def batches(self) -> LiveBatches[Batch]: ...

    @property
    def weight_updates(self) -> WeightUpdates:
        """The weight push that may be open (vLLM's weight transfer)."""
        ...

    async def admit(self, body: RolloutRequest, route: str = "/v1/rollouts",
                    headers: Sequence[Mapping[str, str]] = ()) -> tuple[Batch, int]:
        """The batch this request streams (a new one, or the running or ended one with its batch id) and the record
        to start streaming from. `route` and the requests' `headers` (their W3C traceparent) are what a new batch's
        trace records and follows, when the gateway traces."""
        ...

    def stream(self, batch: Batch, start: int, wire: str) -> AsyncIterator[bytes]:
        """The batch's records from position `start` as they come, then its summary, in `wire` (a media type)."""
        ...

    async def abort(self, batch: Batch) -> None: ...

    def set_paused(self, paused: bool) -> None:
        """What /pause and /resume set: while paused, stall timeouts are off and reloads do not wait."""
        ...

    async def load_weights(self, given: str, version: int | None) -> tuple[int, float]:
        """Loads a checkpoint directory (inside the weights root); (policy version, seconds)."""
        ...
