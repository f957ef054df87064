"""Fixtures of the gateway's HTTP tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from das.service.cluster.rollout_backend import RolloutBackend
from das.service.http.gateway import create_app
from tests.service.live_gateway import TOKEN, LiveServer, gateway_settings


@pytest.fixture
def openai_serve() -> Iterator[Any]:
    """serve(backend, **settings) -> (LiveServer, openai.OpenAI) with auth on and no client retries (a retried
    429 or 503 would hide the status); all stopped at the end of the test."""
    servers: list[LiveServer] = []

    def start(backend: RolloutBackend, **settings: Any) -> tuple[LiveServer, openai.OpenAI]:
        server = LiveServer(create_app(backend, gateway_settings(token=TOKEN, **settings))).__enter__()
        servers.append(server)
        return server, openai.OpenAI(base_url=f"{server.url}/v1", api_key=TOKEN, max_retries=0, timeout=10)

    yield start
    for server in servers:
        server.__exit__()
