"""The batch routes of the gateway (service/http/gateway.py's docstring says what each answers):

- `POST /v1/rollouts`: runs a batch, or attaches to the batch with its `batch_id`, and streams its samples;
- `GET /v1/rollouts/{batch_id}`, `DELETE /v1/rollouts/{batch_id}`: a batch's summary, its abort;
- `POST /v1/weights`: a checkpoint reload; `POST /v1/history`, `GET /v1/history/{problem_id}`: history import and
  lookup; `GET /metrics`: Prometheus text.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.responses import StreamingResponse

from das.service.cluster.rollout_backend import HistoryUnavailable
from das.service.engine.contract import EngineInputError
from das.service.http.gateway_core import GatewayCore, input_error
from das.service.http.metrics import CONTENT_TYPE
from das.service.http.request_guard import OffloopJsonRoute
from das.service.wire.api import (
    MSGPACK,
    NDJSON,
    BatchSummary,
    HistoryRequest,
    HistoryResponse,
    ProblemSummary,
    RolloutRequest,
    SampleRecord,
    WeightsRequest,
    WeightsResponse,
    error_responses,
)
from das.service.wire.engine_control import AddHistory


def batch_router(gateway: GatewayCore[Any]) -> APIRouter:
    """The batch, weights, history and metrics routes over `gateway` (include it where auth applies). Large JSON
    bodies (a history import) are parsed off the event loop (`OffloopJsonRoute`)."""
    router = APIRouter(route_class=OffloopJsonRoute)

    def known(batch_id: str) -> Any:
        batch = gateway.batches.get(batch_id)
        if batch is None:
            if gateway.batches.evicted(batch_id):
                raise HTTPException(410, f"batch {batch_id} ended and its results are no longer retained")
            raise HTTPException(404, f"batch {batch_id} is unknown")
        return batch

    @router.post("/v1/rollouts", response_class=StreamingResponse, responses={200: {
        "model": SampleRecord,
        "description": "a stream of SampleRecord objects, then {\"summary\": BatchSummary}: NDJSON, or a msgpack "
                       "stream (concatenated maps, no length prefix) with Accept: application/msgpack",
        "content": {NDJSON: {}, MSGPACK: {}}}, **error_responses({
            409: "batch_id already used by a different batch (or accepted by an earlier run), or a group's session "
                 "is running a turn",
            410: "the batch with this batch_id ended and its results are no longer retained",
            413: "the body is over max_body_bytes, or the batch asks for more than max_batch_samples samples",
            429: "max_batches_in_flight batches are queued or running (Retry-After)",
            503: "the backend is not ready (Retry-After)"})})
    async def post_rollouts(body: RolloutRequest, request: Request) -> StreamingResponse:
        """Run a batch (or attach to the batch with this batch_id) and stream its samples as they finish."""
        batch, start = await gateway.admit(body, headers=[request.headers])
        if body.batch_id is None:
            gateway.tie(batch)  # a new batch (an unnamed request never attaches): its client alone can read it
        wire = MSGPACK if MSGPACK in request.headers.get("accept", "") else NDJSON
        return StreamingResponse(gateway.follow(batch, start, wire, body.progress), media_type=wire,
                                 headers={"X-Batch-Id": batch.batch_id, "X-Stream-Offset": str(start)})

    unknown_batch = error_responses({404: "no batch has this id",
                                     410: "the batch ended and its results are no longer retained"})

    @router.get("/v1/rollouts/{batch_id}", responses=unknown_batch)
    async def get_rollout(batch_id: str) -> BatchSummary:
        """Status and progress of a batch."""
        return known(batch_id).summary()

    @router.delete("/v1/rollouts/{batch_id}", responses=unknown_batch)
    async def delete_rollout(batch_id: str) -> BatchSummary:
        """Abort a batch (its samples so far stay replayable); an ended batch is left as it is."""
        batch = known(batch_id)
        await gateway.abort(batch)
        return batch.summary()

    @router.post("/v1/weights", responses=error_responses({
        403: "path outside the weights root, or no weights root configured",
        409: "version not newer than the served one"}))
    async def post_weights(body: WeightsRequest) -> WeightsResponse:
        """Reload the policy; waits for running batches, holds new ones until done."""
        return await gateway.reload(body)

    @router.post("/v1/history", responses=error_responses({
        413: "the body is over max_body_bytes, or it carries more than max_history_records records"}))
    async def post_history(body: HistoryRequest) -> HistoryResponse:
        """Import finished rollouts for drafting; all are validated first, so a bad one imports nothing."""
        limit = gateway.settings.max_history_records
        if len(body.records) > limit:
            raise HTTPException(413, f"{len(body.records)} records; the limit is {limit} (max_history_records)")
        try:
            added = await gateway.backend.control(AddHistory(rollouts=body.records))
        except EngineInputError as exc:
            raise input_error(exc, ["body", "records"]) from None
        gateway.metrics.history_imported += added
        return HistoryResponse(added=added)

    @router.get("/v1/history/{problem_id}", responses=error_responses({
        404: "no rollouts of this problem are held", 501: "the backend keeps no history store"}))
    async def get_history(problem_id: str) -> ProblemSummary:
        """What the history store holds for a problem: rollouts, tokens, policy versions, lengths."""
        try:
            summary = await gateway.backend.history(problem_id)
        except HistoryUnavailable as exc:
            raise HTTPException(501, str(exc)) from None
        if summary is None:
            raise HTTPException(404, f"no rollouts of problem {problem_id!r} are held")
        return summary

    @router.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        """Prometheus text exposition."""
        return Response(gateway.metrics.render(), media_type=CONTENT_TYPE)

    return router
