"""Requests and checks of the RL control tests: a group, a batch, a batch's summary, the route checks run against a
server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from das.service.config import GatewayConfig
from das.service.http.gateway import create_app


TOKEN = "rl-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def group(problem: str, n: int, max_tokens: int = 256) -> dict[str, Any]:
    return {"problem_id": problem, "prompt_token_ids": [5, 6, 7], "n": n,
            "sampling": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}}


async def against(scenario: Callable[[httpx.AsyncClient], Awaitable[Any]], backend: Any,
                  weights_root: Path | None = None, timeout_s: float = 60) -> Any:
    """`scenario(http)` against the gateway over `backend` (token auth on, `weights_root` for reloads)."""
    app = create_app(backend, GatewayConfig(token=TOKEN, weights_root=weights_root))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway", headers=AUTH,
                                 timeout=timeout_s) as http:
        return await asyncio.wait_for(scenario(http), timeout_s)


async def batch(http: httpx.AsyncClient, batch_id: str, groups: list[dict[str, Any]]
                ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    response = await http.post("/v1/rollouts", json={"batch_id": batch_id, "groups": groups})
    assert response.status_code == 200, response.text
    *records, last = [json.loads(line) for line in response.text.splitlines()]
    return records, last["summary"]


async def summary(http: httpx.AsyncClient, batch_id: str) -> dict[str, Any]:
    return (await http.get(f"/v1/rollouts/{batch_id}")).json()
