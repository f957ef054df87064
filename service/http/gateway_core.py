"""What the gateway's routers (batch_routes.py, openai_api.py, rl_control.py, session_routes.py, health_routes.py) use
of the gateway, as a Protocol: they depend on it, not on the gateway's own class, so gateway.py imports the routers
to mount them and nothing imports gateway.py back. `_Gateway` in gateway.py is the one implementation."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from fastapi import HTTPException

from das.service.cluster.group_aborts import GroupAborts
from das.service.cluster.rollout_backend import RolloutBackend
from das.service.cluster.sessions import SessionBook
from das.service.engine.contract import EngineInputError
from das.service.http.metrics import GatewayMetrics
from das.service.http.weight_updates import WeightUpdates
from das.service.wire.api import BatchSummary, GroupRequest, PauseMode, RolloutRequest, WeightsRequest, WeightsResponse


class RouterSettings(Protocol):
    """The gateway settings the routers read (`GatewayConfig`)."""

    @property
    def openai_coalesce_s(self) -> float: ...

    @property
    def max_batch_samples(self) -> int: ...

    @property
    def served_model_name(self) -> str | None: ...

    @property
    def max_history_records(self) -> int: ...

    @property
    def stalls_until_unlive(self) -> int: ...


class BatchHandle(Protocol):
    """A batch the gateway admitted: its id, and whether it ended (done, aborted or failed)."""

    @property
    def batch_id(self) -> str: ...

    @property
    def ended(self) -> bool: ...

    @property
    def groups(self) -> Sequence[GroupRequest]: ...

    @property
    def aborts(self) -> GroupAborts:
        """Its groups aborted alone (a session's turn inside a batch of many)."""
        ...

    def summary(self) -> BatchSummary: ...


Batch = TypeVar("Batch", bound=BatchHandle)


class LiveBatches(Protocol[Batch]):
    @property
    def live(self) -> Mapping[str, Batch]:
        """The batches not ended yet, by batch id."""
        ...

    def get(self, batch_id: str) -> Batch | None:
        """A batch running or retained, by id."""
        ...

    def evicted(self, batch_id: str) -> bool:
        """Whether this id's batch ended and its results are no longer retained."""
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
    def metrics(self) -> GatewayMetrics: ...

    @property
    def sessions(self) -> SessionBook: ...

    @property
    def stalls_in_a_row(self) -> int:
        """Batches failed by the stall timeout since a sample last finished."""
        ...

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

    def follow(self, batch: Batch, start: int, wire: str, progress: bool) -> AsyncIterator[bytes]:
        """As `stream`, with progress records when asked, for the request that started or attached to the batch:
        an unnamed batch whose last such reader leaves before it ended is aborted."""
        ...

    def tie(self, batch: Batch) -> None:
        """Marks a new, unnamed batch as its request's alone (aborted when that request's readers leave)."""
        ...

    async def abort(self, batch: Batch) -> None: ...

    async def reload(self, body: WeightsRequest) -> WeightsResponse:
        """POST /v1/weights: reloads a checkpoint directory once the running batches have finished."""
        ...

    def set_paused(self, mode: PauseMode | None) -> None:
        """What /pause (its mode) and /resume (None) set: while paused, new batches are held, stall timeouts are off
        and reloads do not wait."""
        ...

    async def load_weights(self, given: str, version: int | None) -> tuple[int, float]:
        """Loads a checkpoint directory (inside the weights root); (policy version, seconds)."""
        ...


def json_safe(value: Any) -> Any:
    """`value` with what JSON cannot carry (NaN and infinite floats, lone UTF-16 surrogates) turned into text, so
    an error that echoes a refused input is still a JSON body and not a 500."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode()
    if isinstance(value, dict):
        return {json_safe(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def input_error(exc: EngineInputError, loc: list[str | int]) -> HTTPException:
    """A backend refusal in the shape of FastAPI's own validation errors (422, `[{loc, msg, type}]`), so clients
    parse one format."""
    return HTTPException(422, [{"loc": loc, "msg": json_safe(str(exc)), "type": "value_error"}])
