"""Fixtures shared by the service's tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from das.service.cluster.rollout_backend import RolloutBackend
from das.service.http.gateway import create_app
from tests.service.live_gateway import TOKEN, LiveServer, gateway_settings


@pytest.fixture
def session_serve() -> Iterator[Any]:
    """serve(backend, **settings) -> (LiveServer, openai.OpenAI, headers); stopped at the end of the test."""
    servers: list[LiveServer] = []

    def start(backend: RolloutBackend, **settings: Any) -> tuple[LiveServer, openai.OpenAI, dict[str, str]]:
        server = LiveServer(create_app(backend, gateway_settings(token=TOKEN, **settings))).__enter__()
        servers.append(server)
        return (server, openai.OpenAI(base_url=f"{server.url}/v1", api_key=TOKEN, max_retries=0, timeout=10),
                {"Authorization": f"Bearer {TOKEN}"})

    yield start
    for server in servers:
        server.__exit__()
