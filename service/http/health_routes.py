"""The probes: `GET /healthz` (liveness) and `GET /readyz` (readiness), open routes (`OpenRoute`: no token, so an
orchestrator's probes need no secret)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response

from das.service.http.gateway_core import GatewayCore
from das.service.http.request_guard import OpenRoute
from das.service.wire.api import error_responses


def health_router(gateway: GatewayCore[Any]) -> APIRouter:
    """/healthz and /readyz over `gateway`'s backend and stall count."""
    router = APIRouter(route_class=OpenRoute, tags=["probes"])

    @router.get("/healthz", responses=error_responses({503: "the backend cannot serve again without a restart, or "
                                                             "makes no progress"}))
    async def healthz(response: Response) -> dict[str, str]:
        """200 while the process answers and the backend can serve or is recovering; 503 once it cannot recover
        (every engine past its restart cap) or makes no progress (`stalls_until_unlive` batches in a row failed by
        the stall timeout), so an orchestrator restarts the process."""
        backend = gateway.backend
        if not await backend.live():
            response.status_code = 503
            failed = backend.stats().engines_failed
            return {"status": "failed", "reason": "no engine can serve again: " + "; ".join(
                dict.fromkeys(failed.values())) if failed else "no engine can serve again (restart cap)"}
        stalls = gateway.stalls_in_a_row
        if stalls >= gateway.settings.stalls_until_unlive:
            response.status_code = 503
            return {"status": "failed", "reason": f"{stalls} batches in a row finished no sample within "
                                                  f"batch_stall_timeout_s"}
        return {"status": "ok"}

    @router.get("/readyz", responses=error_responses({503: "the backend is not ready"}))
    async def readyz(response: Response) -> dict[str, Any]:
        """200 once the backend can run batches, 503 before. `engines_failed`: each engine that stays down (one that
        cannot load, or past its restart cap) with why, whether or not the others serve."""
        ready = await gateway.backend.ready()
        if not ready:
            response.status_code = 503
        return {"ready": ready, "engines_failed": gateway.backend.stats().engines_failed}

    return router
