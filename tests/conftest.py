"""One `das serve` on SmolLM2 for the whole test session, shared by the tests that need a real server on the real
small model: the verifiers example (tests/examples/verifiers_agent/test_agent.py), then vLLM's weight transfer
(tests/service/test_serve_weight_transfer.py). A start costs about a minute of CPU; one start serves both.

The server changes state as they run (sessions, pushed weights, policy versions), so its users run together, last
(`pytest_collection_modifyitems`): first those that leave its weights alone (the verifiers test, on the weights as
prepared), then those marked `changes_shared_weights` (the weight-transfer module) in the order they were
collected, whose last test stops the server to start its reference server. Nothing else shares this server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.service.serve_process import SMOLLM2_SERVE_FLAGS, Server

SHARED_SERVER = "smollm2_gloo_server"


@pytest.fixture(scope="session")
def smollm2_float32() -> Path:
    from das.service.engine.vllm.models import prepare_model

    return prepare_model("smollm2", progress=False, dtype="float32")


@pytest.fixture(scope="session")
def smollm2_weights_root(tmp_path_factory) -> Path:
    """The shared server's --weights-root: checkpoints pushed or reloaded by path are written under it."""
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="session")
def smollm2_gloo_server(tmp_path_factory, smollm2_float32, smollm2_weights_root) -> Iterator[Server]:
    """`das serve` on SmolLM2 (float32, eager, 2,048-token context) with `--weight-transfer gloo` and the token."""
    server = Server(smollm2_float32, tmp_path_factory.mktemp("shared-state"), *SMOLLM2_SERVE_FLAGS,
                    "--weight-transfer", "gloo", "--weights-root", str(smollm2_weights_root))
    try:
        server.wait_ready()
        yield server
    finally:
        if server.proc.poll() is None:
            server.stop()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "changes_shared_weights: the test pushes or reloads weights on the shared "
                                       "SmolLM2 server (tests/conftest.py), or stops it; it runs after its other users")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The shared server's users last, together: those that leave its weights alone first, then the others, each in
    collection order (the module docstring)."""
    users = [item for item in items if SHARED_SERVER in getattr(item, "fixturenames", ())]
    if users:
        users.sort(key=lambda item: item.get_closest_marker("changes_shared_weights") is not None)  # stable
        items[:] = [item for item in items if SHARED_SERVER not in getattr(item, "fixturenames", ())] + users
