"""vLLM's RL control routes on the gateway (vllm/entrypoints/rl/online/api_router.py in vLLM 0.32): the paths,
query and body shapes, status codes and semantics of vLLM's server, for trainers that drive a rollout server with
them (TRL, SkyRL, prime-rl, verl). `rl_control_router(gateway)` builds them; `create_app` mounts them under the
gateway's bearer-token auth. Every call fans out to every engine on every node. docs/design.md "vLLM's RL control
plane" has the reasoning.

- `POST /pause?mode=abort|wait|keep&clear_cache=true` (vLLM's defaults: abort, true): "abort" ends every sample in
  flight with finish_reason "abort", delivered with the tokens it had, and its batch goes on and ends as usual;
  "wait" answers once the samples in flight have finished; "keep" freezes them until /resume. In every mode new
  batches and requests are accepted and held until /resume (by the service, never sent to a paused engine:
  service/engine/pause_gate.py), and a held batch's stall timeout is off. `{"status": "paused"}`.
- `POST /resume`: `{"status": "resumed"}`. `GET /is_paused`: `{"is_paused": bool}` (true while any engine is).
- `POST /abort_requests` `{"request_ids": [...]}` (vLLM's body): each id names a batch (the batch_id of
  /v1/rollouts, the X-Batch-Id of an OpenAI-compatible response), aborted as DELETE /v1/rollouts/{id} does (its
  summary says "aborted"; unknown ids are ignored, as vLLM ignores them); none or empty: every sample in flight
  ends with finish_reason "abort" without pausing, as under /pause?mode=abort. `{"status": "aborted", "aborted":
  n}`: batches, or samples.
- `POST /update_weights` `{"path": ..., "version": ...}` (ours: vLLM's body for the same path is
  `{"update_info": ...}`, so the two never collide): the checkpoint reload of POST /v1/weights (path inside the
  weights root, every engine, version newer than the served one, default served + 1, the drafter's history tagged
  by version), except that while paused it does not wait for the running batches: their held samples go on under
  the new weights, and a sample whose tokens span the update lists the versions in `policy_spans`
  ([version, first token index] pairs). `{"message": "Weights updated", "policy_version", "reload_s"}`.
- vLLM's weight transfer, when the engines were started with one (`das serve --weight-transfer`, default nccl on
  GPU engines and gloo on CPU engines; docs/design.md "vLLM's RL control plane"): `POST /init_weight_transfer_engine`
  `{"init_info": {...}}` (every serving engine's workers join the trainer's group, ranked trainer 0 then engine by
  engine: the service adds each engine's offset to the trainer's `rank_offset`), `POST /start_weight_update` (opens
  a push: holds new batches, waits for running ones unless paused), `POST /update_weights` `{"update_info": {names,
  dtype_names, shapes}}` (every engine receives the tensors the trainer broadcasts meanwhile), `POST
  /finish_weight_update` `{"weight_version": "<int>"}` (every engine loads them; the policy version moves once,
  as a checkpoint reload's), `POST /shutdown_weight_transfer_engine`, `GET /get_world_size` (every serving engine's
  workers), and ours, `GET /v1/weights/transfer` (backend, world size, version). With `--weight-transfer none` they
  answer 501 naming the flag; `/start_draft_weight_update` always does (no draft model is served).

Errors in vLLM's (OpenAI's) shape `{"error": {"message", "type", "param", "code"}}`, as vLLM's server answers:
400 invalid input (a mode vLLM does not know, a body that is not a JSON object, init or update info the engines
refuse: a tensor name or shape the served checkpoint does not have), 401 bad or missing token, 403 weights path
outside the root, 409 version not newer, or a transfer call out of turn, 422 a checkpoint the engines refuse, 500 an
engine failed (a transfer: the push was given up everywhere, every engine serves the version it served), 501 no
weight transfer.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from pydantic import ValidationError

from das.service.cluster.rollout_backend import WeightUpdateConflict
from das.service.engine.contract import EngineInputError
from das.service.http.gateway_core import GatewayCore
from das.service.http.openai_api import OpenAIError, OpenAIErrorRoute, invalid_request
from das.service.wire.api import (
    AbortRequestsBody,
    AbortResponse,
    CheckpointUpdateRequest,
    CheckpointUpdateResponse,
    IsPausedResponse,
    PauseMode,
    PauseResponse,
    ResumeResponse,
    error_responses,
)
from das.service.wire.engine_control import AbortSamples, IsPaused, Pause, Resume
from das.service.wire.openai_protocol import ErrorResponse
from das.service.wire.weight_transfer import (
    FinishWeightUpdateBody,
    FinishWeightUpdateResponse,
    InitWeightTransferBody,
    TransferMessage,
    UpdateWeightsBody,
    WeightTransferInfo,
    WorldSizeResponse,
)


WEIGHT_TRANSFER_UNAVAILABLE = (
    "vLLM's weight transfer is off on this server: its engines were started with `das serve --weight-transfer none`. "
    "Start it with --weight-transfer nccl (GPU engines), gloo (CPU engines) or auto, or load a checkpoint instead: "
    "POST /update_weights {\"path\": <directory inside the weights root>, \"version\": <int, optional>}")
DRAFT_UPDATE_UNAVAILABLE = ("no draft model is served here (the DAS proposer drafts from the rollout history, not a "
                            "model): there are no draft weights to update")

async def _json_object(request: Request) -> dict[str, Any]:
    """The body as a JSON object; 400 in vLLM's words otherwise."""
    try:
        body = json.loads(await request.body() or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise OpenAIError(400, "Invalid JSON format") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "Request body must be a JSON object")
    return body


def _json_body(*schemas: dict[str, Any]) -> dict[str, Any]:
    """OpenAPI's requestBody for a route that reads its JSON itself (vLLM's handling of a bad body, 400), so the
    schema still says what the route takes."""
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": list(schemas)}
    return {"requestBody": {"required": False, "content": {"application/json": {"schema": schema}}}}


def _transfer_unavailable() -> OpenAIError:
    return OpenAIError(501, WEIGHT_TRANSFER_UNAVAILABLE, code="weight_transfer_unavailable")


def _cause(exc: BaseException) -> BaseException:
    """The engine's own exception behind a relayed one (Ray's task error keeps it as `cause`)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


_TRANSFER_ERRORS = error_responses({400: "init or update info the engines refuse (names the field)",
                                    409: "a transfer call out of turn", 500: "the transfer failed; every engine "
                                    "serves the version it served", 501: "no weight transfer (--weight-transfer none)"},
                                   ErrorResponse)


def rl_control_router(gateway: GatewayCore[Any]) -> APIRouter:
    """vLLM's RL control routes over `gateway`'s backend (include it where auth applies)."""
    router = APIRouter(route_class=OpenAIErrorRoute, tags=["rl"])
    backend = gateway.backend

    @router.post("/pause", responses=error_responses({400: "a mode vLLM does not know",
                                                      500: "an engine failed to pause"}, ErrorResponse))
    async def pause(mode: Annotated[PauseMode, Query()] = "abort",
                    clear_cache: Annotated[bool, Query()] = True) -> PauseResponse:
        """Pause generation (vLLM's pause_generation on every engine); new work is held until /resume."""
        gateway.set_paused(mode)  # first: no stall timer may fire between the engines pausing and this
        try:
            await backend.control(Pause(mode=mode, clear_cache=clear_cache))
        except ValueError as exc:
            gateway.set_paused(mode if await backend.control(IsPaused()) else None)
            raise OpenAIError(400, str(exc)) from None
        except Exception as exc:
            gateway.set_paused(mode if await backend.control(IsPaused()) else None)
            raise OpenAIError(500, f"Failed to pause generation: {exc}") from None
        return PauseResponse()

    @router.post("/resume", responses=error_responses({500: "an engine failed to resume"}, ErrorResponse))
    async def resume() -> ResumeResponse:
        """Resume generation on every engine: held and frozen samples go on."""
        try:
            await backend.control(Resume())
        except Exception as exc:
            raise OpenAIError(500, f"Failed to resume generation: {exc}") from None
        gateway.set_paused(None)
        return ResumeResponse()

    @router.get("/is_paused")
    async def is_paused() -> IsPausedResponse:
        """Whether generation is paused (on any engine)."""
        return IsPausedResponse(is_paused=await backend.control(IsPaused()))

    @router.post("/abort_requests", responses=error_responses({400: "the body is not a JSON object, or request_ids "
                                                                    "is not a list of strings"}, ErrorResponse),
                 openapi_extra=_json_body(AbortRequestsBody.model_json_schema()))
    async def abort_requests(request: Request) -> AbortResponse:
        """Abort the named batches, or with no ids every sample in flight (they end with finish_reason abort)."""
        try:
            body = AbortRequestsBody.model_validate(await _json_object(request))
        except ValidationError as exc:
            raise invalid_request(exc.errors()) from None
        if not body.request_ids:
            return AbortResponse(aborted=await backend.control(AbortSamples()))
        aborted = 0
        for batch_id in dict.fromkeys(body.request_ids):
            batch = gateway.batches.live.get(batch_id)
            if batch is not None and not batch.ended:
                await gateway.abort(batch)
                aborted += 1
        return AbortResponse(aborted=aborted)

    async def transfer(step: Any) -> Any:
        """Runs one transfer step, its errors in vLLM's shape (step: a coroutine of gateway.weight_updates)."""
        try:
            return await step
        except Exception as exc:
            cause = _cause(exc)
            if isinstance(cause, EngineInputError):
                raise OpenAIError(400, str(cause)) from None
            if isinstance(cause, WeightUpdateConflict):
                raise OpenAIError(409, str(cause), code="weight_update_conflict") from None
            raise OpenAIError(500, f"the weight transfer failed and was given up on every engine, which serve "
                                   f"policy version {backend.policy_version}: {cause}") from None

    def check_transfer() -> None:
        if backend.weight_transfer is None:
            raise _transfer_unavailable()

    @router.post("/update_weights", responses=error_responses({
        400: "invalid input", 403: "path outside the weights root, or no weights root configured",
        409: "version not newer than the served one, or a transfer call out of turn",
        422: "a checkpoint the engines refuse", 500: "the transfer failed; every engine serves the version it served",
        501: "vLLM's weight transfer body (update_info) without weight transfer"}, ErrorResponse),
        openapi_extra=_json_body(CheckpointUpdateRequest.model_json_schema(), UpdateWeightsBody.model_json_schema()))
    async def update_weights(request: Request) -> CheckpointUpdateResponse | TransferMessage:
        """Load a checkpoint directory on every engine ({path, version}), or receive a transfer's tensors
        ({update_info}, vLLM's)."""
        body = await _json_object(request)
        if "update_info" in body:
            check_transfer()
            try:
                chunk = UpdateWeightsBody.model_validate(body)
            except ValidationError as exc:
                raise invalid_request(exc.errors()) from None
            await transfer(gateway.weight_updates.update(chunk.update_info))
            return TransferMessage(message="Weights updated")
        try:
            update = CheckpointUpdateRequest.model_validate(body)
        except ValidationError as exc:
            raise invalid_request(exc.errors()) from None
        version, seconds = await gateway.load_weights(update.path, update.version)
        return CheckpointUpdateResponse(policy_version=version, reload_s=seconds)

    @router.post("/init_weight_transfer_engine", responses=_TRANSFER_ERRORS,
                 openapi_extra=_json_body(InitWeightTransferBody.model_json_schema()))
    async def init_weight_transfer_engine(request: Request) -> TransferMessage:
        """Every serving engine's workers join the trainer's group (returns once they have)."""
        check_transfer()
        try:
            body = InitWeightTransferBody.model_validate(await _json_object(request))
        except ValidationError as exc:
            raise invalid_request(exc.errors()) from None
        await transfer(gateway.weight_updates.init(body.init_info))
        return TransferMessage(message="Weight transfer initialized")

    @router.post("/start_weight_update", responses=_TRANSFER_ERRORS)
    async def start_weight_update() -> TransferMessage:
        """Opens a push (new batches held; running ones finish first unless paused)."""
        check_transfer()
        await transfer(gateway.weight_updates.start())
        return TransferMessage(message="Weight update started")

    @router.post("/finish_weight_update", responses=_TRANSFER_ERRORS,
                 openapi_extra=_json_body(FinishWeightUpdateBody.model_json_schema()))
    async def finish_weight_update(request: Request) -> FinishWeightUpdateResponse:
        """Every engine loads what it received and serves it as `weight_version` (default: served + 1)."""
        check_transfer()
        try:
            body = FinishWeightUpdateBody.model_validate(await _json_object(request))
        except ValidationError as exc:
            raise invalid_request(exc.errors()) from None
        pushed = await transfer(gateway.weight_updates.finish(body.weight_version))
        return FinishWeightUpdateResponse(policy_version=pushed.policy_version, transfer_s=pushed.seconds,
                                          transfer_bytes=pushed.bytes)

    @router.post("/shutdown_weight_transfer_engine", responses=_TRANSFER_ERRORS)
    async def shutdown_weight_transfer_engine() -> TransferMessage:
        """The engines leave the trainer's group (an open push is given up)."""
        check_transfer()
        await transfer(gateway.weight_updates.shutdown())
        return TransferMessage(message="Weight transfer shut down")

    @router.get("/get_world_size", responses=error_responses({400: "include_dp is not a boolean"}, ErrorResponse))
    async def get_world_size(include_dp: Annotated[bool, Query()] = True) -> WorldSizeResponse:
        """Model workers of every serving engine (`include_dp` is vLLM's; engines are the service's data
        parallelism, so it changes nothing)."""
        return WorldSizeResponse(world_size=backend.transfer_world_size())

    @router.get("/v1/weights/transfer")
    async def weight_transfer_info() -> WeightTransferInfo:
        """What a trainer needs to join the group: the backend, the workers, the version served."""
        return WeightTransferInfo(backend=backend.weight_transfer, world_size=backend.transfer_world_size(),
                                  policy_version=backend.policy_version)

    async def draft_update_unavailable() -> None:
        raise OpenAIError(501, DRAFT_UPDATE_UNAVAILABLE, code="draft_weight_update_unavailable")

    router.add_api_route("/start_draft_weight_update", draft_update_unavailable, methods=["POST"], status_code=501,
                         responses=error_responses({501: "no draft model is served"}, ErrorResponse),
                         summary="vLLM's start_draft_weight_update: 501 here (no draft model)")

    return router
