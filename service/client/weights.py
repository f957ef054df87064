"""`WeightSender`: the trainer's side of vLLM's weight transfer through the service, with torch and without vLLM,
Ray or the server (pyproject.toml's import contract; tests/test_architecture.py).

    with WeightSender("http://rollouts:8000", token) as sender:
        version = sender.push(model)            # a torch.nn.Module: its named_parameters()
        version = sender.push(pairs, version=7)  # or (name, tensor) pairs in the served checkpoint's names

One push sends the whole model to every engine in one transfer and returns the policy version every engine serves
then (the service moves it once, as a checkpoint reload does: docs/design.md "vLLM's RL control plane"). The
backend is the one the service reports (GET /v1/weights/transfer): gloo on CPU engines, over our torch-only data
plane (service/engine/vllm/gloo_transfer.py, the same one our gloo engines in vLLM's factories use); nccl on GPU engines,
over vLLM's own trainer engine (loaded only then: the one place this module reaches vLLM).

The sender is rank 0 of the group: it hosts the rendezvous on `master_address` (default: this host's address on
the route to the service) and `master_port` (default: a free one), and every engine node must reach it there and
on gloo's (or NCCL's) own pair ports. The group is formed at the first push and again after a push that failed, or
when the service's engines changed (a restart, a node that joined).

Errors: `WeightPushError` with the service's message (it names the cause: a tensor name or shape the served
checkpoint does not have, a transfer that broke) and its HTTP status; after one, every engine serves the version
it served before.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

import httpx
import torch

from das.service.engine.vllm.gloo_transfer import (
    DEFAULT_TIMEOUT_S,
    GlooGroup,
    join_as_trainer,
    push,
)
from das.service.wire.weight_transfer import FinishWeightUpdateResponse, WeightTransferInfo

Weights = torch.nn.Module | Iterable[tuple[str, torch.Tensor]]


class WeightPushError(RuntimeError):
    """The service refused or failed a transfer call: `status` (HTTP) and its message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class TransferControl:
    """The service's transfer routes as vLLM's `VLLMWeightSyncClient` (four synchronous methods taking plain
    dicts), which both trainer engines drive; keeps the last finish's answer. `version`: the weight_version a
    finish called without one sends (vLLM's NCCL trainer engine calls it without)."""

    def __init__(self, http: httpx.Client) -> None:
        self._http = http
        self.version: int | None = None
        self.finished: FinishWeightUpdateResponse | None = None

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        response = self._http.request(method, path, json=body)
        if response.is_success:
            return dict(response.json())
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text
        raise WeightPushError(response.status_code, str(message))

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.call("POST", "/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.call("POST", "/start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.call("POST", "/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if weight_version is None and self.version is not None:
            weight_version = str(self.version)
        body = {"weight_version": weight_version} if weight_version is not None else {}
        self.finished = FinishWeightUpdateResponse.model_validate(self.call("POST", "/finish_weight_update", body))


class WeightSender:
    """Pushes a trainer's weights to every engine of the service at `base_url`; a context manager (leaving it
    releases the engines' side of the group). `timeout_s`: how long any rank waits for a peer in a collective (a
    trainer that dies mid-push is noticed by the engines after at most this). `packed_buffer_size_bytes` (gloo): the
    most bytes a broadcast packs (None, the default: one broadcast per tensor); NCCL packs as vLLM's trainer engine
    does."""

    def __init__(self, base_url: str, token: str | None = None, *, master_address: str | None = None,
                 master_port: int = 0, timeout_s: float = DEFAULT_TIMEOUT_S,
                 packed_buffer_size_bytes: int | None = None) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        # no read timeout: /start_weight_update waits for running batches, /update_weights for the whole broadcast
        self._http = httpx.Client(base_url=base_url, headers=headers,
                                  timeout=httpx.Timeout(None, connect=10.0))
        self._control = TransferControl(self._http)
        self._address = master_address or _route_address(base_url)
        self._port = master_port
        self._timeout_s = timeout_s
        self._packed_bytes = packed_buffer_size_bytes
        self._group: GlooGroup | None = None
        self._nccl: Any = None  # vLLM's NCCL trainer engine, once formed
        self._world = 0  # the group's size when formed

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Leaves the group (the engines' side too) and closes the connection."""
        try:
            if self._group is not None or self._nccl is not None:
                self._control.call("POST", "/shutdown_weight_transfer_engine")
        except (WeightPushError, httpx.HTTPError):
            pass  # the service may be gone: its engines then left the group with it
        finally:
            self._leave()
            self._http.close()

    def info(self) -> WeightTransferInfo:
        """The service's backend, world size and served version (GET /v1/weights/transfer)."""
        return WeightTransferInfo.model_validate(self._control.call("GET", "/v1/weights/transfer"))

    def push(self, weights: Weights, version: int | None = None) -> int:
        """Sends `weights` (a module's named_parameters, or (name, tensor) pairs in the served checkpoint's names,
        every tensor of it) to every engine in one transfer; returns the policy version they serve now (`version`,
        newer than the served one; None: served + 1). WeightPushError on a refusal or a failure: nothing is loaded
        anywhere then."""
        pairs = list(weights.named_parameters()) if isinstance(weights, torch.nn.Module) else list(weights)
        info = self.info()
        if info.backend is None:
            raise WeightPushError(501, "the service's engines were started without weight transfer (das serve "
                                       "--weight-transfer none)")
        self._control.version = version
        self._control.finished = None
        world = info.world_size + 1
        try:
            if info.backend == "gloo":
                if self._group is None or self._world != world:
                    self._leave()
                    self._group = join_as_trainer(self._control, self._address, self._free_port(), world,
                                                  self._timeout_s, self._packed_bytes)
                    self._world = world
                push(self._control, self._group, pairs, None if version is None else str(version))
            else:
                from das.service.engine.vllm.weight_transfer import nccl_trainer

                if self._nccl is None or self._world != world:
                    self._leave()
                    self._nccl = nccl_trainer(self._control, self._address, self._free_port(), world)
                    self._world = world
                self._nccl.source.pairs = pairs
                self._nccl.send_weights()
        except BaseException:
            self._leave()  # the group is unusable after a failure: the next push forms a new one
            raise
        assert self._control.finished is not None
        return self._control.finished.policy_version

    def _leave(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None
        if self._nccl is not None:
            self._nccl.shutdown()
            self._nccl = None

    def _free_port(self) -> int:
        if self._port:
            return self._port
        with socket.socket() as probe:
            probe.bind((self._address, 0))
            return int(probe.getsockname()[1])


def _route_address(base_url: str) -> str:
    """This host's address on the route to the service (what its engines can reach the trainer at)."""
    parts = urlsplit(base_url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet is sent: connect only routes
        probe.connect((parts.hostname or "127.0.0.1", parts.port or 80))
        return str(probe.getsockname()[0])
