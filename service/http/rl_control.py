"""vLLM's RL control routes on the gateway (vllm/entrypoints/rl/online/api_router.py in vLLM 0.32): the paths,
query and body shapes, status codes and semantics of vLLM's server, for trainers that drive a rollout server with
them (TRL, SkyRL, prime-rl, verl). `rl_control_router(gateway)` builds them; `create_app` mounts them under the
gateway's bearer-token auth. Every call fans out to every engine on every node. docs/design.md "vLLM's RL control
plane" has the reasoning.

- `POST /pause?mode=abort|wait|keep&clear_cache=true` (vLLM's defaults: abort, true): "abort" ends every sample in
  flight with finish_reason "abort", delivered with the tokens it had, and its batch goes on and ends as usual;
  "wait" answers once the samples in flight have finished; "keep" freezes them until /resume. In every mode new
  batches and requests are accepted and held until /resume (by the service, never sent to a paused engine:
  service/cluster/pause_hold.py), and a held batch's stall timeout is off. `{"status": "paused"}`.
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
- vLLM's weight transfer (`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights` with
  `update_info`, `/finish_weight_update`, `/shutdown_weight_transfer_engine`): 501. Its NCCL and IPC backends need
  CUDA (a NCCL communicator, CUDA IPC handles), and our engines are started without vLLM's weight_transfer_config,
  which every one of these calls needs; send a checkpoint path instead.

Errors in vLLM's (OpenAI's) shape `{"error": {"message", "type", "param", "code"}}`, as vLLM's server answers:
400 invalid input (a mode vLLM does not know, a body that is not a JSON object), 401 bad or missing token, 403
weights path outside the root, 409 version not newer, 422 a checkpoint the engines refuse, 500 an engine failed,
501 weight transfer.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from pydantic import ValidationError

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
from das.service.wire.openai_protocol import ErrorResponse


WEIGHT_TRANSFER_UNAVAILABLE = (
    "vLLM's weight transfer is not available on this server: its engines are started without a "
    "weight_transfer_config, and vLLM's NCCL and IPC transfer backends need CUDA. Load a checkpoint instead: "
    "POST /update_weights {\"path\": <directory inside the weights root>, \"version\": <int, optional>}")


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


def rl_control_router(gateway: GatewayCore[Any]) -> APIRouter:
    """vLLM's RL control routes over `gateway`'s backend (include it where auth applies)."""
    router = APIRouter(route_class=OpenAIErrorRoute, tags=["rl"])
    backend = gateway.backend

    @router.post("/pause", responses=error_responses({400: "a mode vLLM does not know",
                                                      500: "an engine failed to pause"}, ErrorResponse))
    async def pause(mode: Annotated[PauseMode, Query()] = "abort",
                    clear_cache: Annotated[bool, Query()] = True) -> PauseResponse:
        """Pause generation (vLLM's pause_generation on every engine); new work is held until /resume."""
        gateway.set_paused(True)  # first: no stall timer may fire between the engines pausing and this
        try:
            await backend.pause(mode, clear_cache)
        except ValueError as exc:
            gateway.set_paused(await backend.is_paused())
            raise OpenAIError(400, str(exc)) from None
        except Exception as exc:
            gateway.set_paused(await backend.is_paused())
            raise OpenAIError(500, f"Failed to pause generation: {exc}") from None
        return PauseResponse()

    @router.post("/resume", responses=error_responses({500: "an engine failed to resume"}, ErrorResponse))
    async def resume() -> ResumeResponse:
        """Resume generation on every engine: held and frozen samples go on."""
        try:
            await backend.resume()
        except Exception as exc:
            raise OpenAIError(500, f"Failed to resume generation: {exc}") from None
        gateway.set_paused(False)
        return ResumeResponse()

    @router.get("/is_paused")
    async def is_paused() -> IsPausedResponse:
        """Whether generation is paused (on any engine)."""
        return IsPausedResponse(is_paused=await backend.is_paused())

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
            return AbortResponse(aborted=await backend.abort_samples())
        aborted = 0
        for batch_id in dict.fromkeys(body.request_ids):
            batch = gateway.batches.live.get(batch_id)
            if batch is not None and not batch.ended:
                await gateway.abort(batch)
                aborted += 1
        return AbortResponse(aborted=aborted)

    @router.post("/update_weights", responses=error_responses({
        400: "invalid input", 403: "path outside the weights root, or no weights root configured",
        409: "version not newer than the served one", 422: "a checkpoint the engines refuse",
        501: "vLLM's weight transfer body (update_info)"}, ErrorResponse),
        openapi_extra=_json_body(CheckpointUpdateRequest.model_json_schema(), {
            "type": "object", "properties": {"update_info": {"type": "object"}}, "required": ["update_info"]}))
    async def update_weights(request: Request) -> CheckpointUpdateResponse:
        """Load a checkpoint directory on every engine ({path, version}); vLLM's weight-transfer body is 501."""
        body = await _json_object(request)
        if "update_info" in body:
            raise _transfer_unavailable()
        try:
            update = CheckpointUpdateRequest.model_validate(body)
        except ValidationError as exc:
            raise invalid_request(exc.errors()) from None
        version, seconds = await gateway.load_weights(update.path, update.version)
        return CheckpointUpdateResponse(policy_version=version, reload_s=seconds)

    async def transfer_unavailable() -> None:
        raise _transfer_unavailable()

    for path in ("/init_weight_transfer_engine", "/shutdown_weight_transfer_engine", "/start_weight_update",
                 "/start_draft_weight_update", "/finish_weight_update"):
        router.add_api_route(path, transfer_unavailable, methods=["POST"], status_code=501,
                             responses=error_responses({501: "weight transfer is not available"}, ErrorResponse),
                             summary=f"vLLM's {path[1:]}: 501 here (weight transfer needs CUDA)")

    return router
