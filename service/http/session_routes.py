"""The session routes of the gateway (service/cluster/sessions.py says what a session is):

- `GET /v1/sessions/{session_id}`: the open session (`SessionSummary`: its turns with their policy versions, its
  engine, context and output tokens, moves, makespan so far); 404 for a session not open (never opened, or closed,
  aborted, expired or evicted).
- `DELETE /v1/sessions/{session_id}`: ends the session and aborts its turn still running, freeing its engine's
  work. A turn that is its batch's only group (every OpenAI-compatible request: session turns are never coalesced,
  and `RolloutClient` sessions' own turns) aborts its batch, which ends "aborted". A turn inside a batch of many
  groups (`/v1/rollouts` with several sessions' turns) aborts its group only (service/cluster/group_aborts.py): the
  engine stops generating it and its sample comes with finish_reason "abort", while the batch's other groups run on
  and complete. Answers the session as it ended (state "aborted" if a turn was running, else "closed"); 404 for a
  session not open.

A trajectory that simply stops needs no DELETE: it expires after `SessionConfig.idle_expiry_s`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException

from das.service.http.gateway_core import GatewayCore
from das.service.wire.api import error_responses
from das.service.wire.sessions import SessionSummary


def session_router(gateway: GatewayCore[Any]) -> APIRouter:
    """GET and DELETE /v1/sessions/{session_id} over `gateway`'s session book (include it where auth applies)."""
    router = APIRouter(tags=["sessions"])
    not_open = error_responses({404: "no session open by this id (never opened, or ended: closed, aborted, "
                                     "expired, evicted)"})

    @router.get("/v1/sessions/{session_id}", responses=not_open)
    async def get_session(session_id: str) -> SessionSummary:
        """An open session: its turns (each with its policy version), engine, tokens and moves."""
        gateway.sessions.expire()
        session = gateway.sessions.get(session_id)
        if session is None:
            raise HTTPException(404, f"session {session_id!r} is not open")
        return session.summary()

    @router.delete("/v1/sessions/{session_id}", responses=not_open)
    async def delete_session(session_id: str) -> SessionSummary:
        """Ends the session, aborting its turn still running (which frees its engine's work)."""
        session = gateway.sessions.get(session_id)
        running = gateway.batches.get(session.running) if session is not None and session.running else None
        reason = "aborted" if running is not None and not running.ended else "closed"
        session = gateway.sessions.close(session_id, reason)
        if session is None:
            raise HTTPException(404, f"session {session_id!r} is not open")
        if reason == "aborted" and running is not None:
            if len(running.groups) == 1:
                await gateway.abort(running)
            else:  # the other groups (other sessions' turns) run on: only this turn's group stops
                for index, group in enumerate(running.groups):
                    if group.session_id == session_id:
                        running.aborts.abort(index)
        return session.summary(reason)

    return router
