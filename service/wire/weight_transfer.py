"""The wire of vLLM's weight transfer through the service (service/http/rl_control.py; docs/design.md "vLLM's RL
control plane"): the routes' bodies and answers in vLLM's shapes (vllm/entrypoints/rl/online/api_router.py in vLLM
0.32), the DAS route that tells a trainer the transfer's backend and group size, and the update's size in bytes.
No torch, no vLLM: the gateway and the trainer's client read these.

The group: one process group of 1 + `world_size` ranks, the trainer rank 0, then every engine's model workers in the
service's order of engines (engine e's workers at 1 + the workers of the engines before it). The trainer asks for
`rank_offset` 1 as vLLM's trainer engines do; the service adds each engine's offset when it forwards the call.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

TransferBackend = Literal["nccl", "gloo"]
"""The transfer's backend: vLLM's NCCL engine on GPU engines, our gloo twin (service/engine/vllm/weight_transfer.py) on
CPU engines."""

TransferChoice = Literal["auto", "nccl", "gloo", "none"]
"""`das serve --weight-transfer`: auto (nccl where the engines run on GPUs, else gloo), or none (the routes answer
501)."""

# Bytes per element of the dtypes a transfer may carry (torch's names, as vLLM's update_info spells them).
DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


class InitWeightTransferBody(BaseModel):
    """vLLM's body of POST /init_weight_transfer_engine: the backend's init info (NCCL's and ours: master_address,
    master_port, rank_offset, world_size, plus backend settings)."""

    model_config = ConfigDict(extra="forbid")

    init_info: dict[str, Any]


class UpdateWeightsBody(BaseModel):
    """vLLM's body of POST /update_weights for a transfer: one chunk's update info (names, dtype_names, shapes, in
    the served checkpoint's names), or a list of them by worker rank."""

    model_config = ConfigDict(extra="forbid")

    update_info: dict[str, Any] | list[dict[str, Any]]


class FinishWeightUpdateBody(BaseModel):
    """vLLM's body of POST /finish_weight_update. `weight_version`: vLLM's label of the weights; here the policy
    version they are served as, an integer newer than the served one (None: served + 1)."""

    model_config = ConfigDict(extra="forbid")

    weight_version: str | None = None


class TransferMessage(BaseModel):
    """vLLM's answer to the transfer routes."""

    message: str


class FinishWeightUpdateResponse(BaseModel):
    """vLLM's answer plus the policy version now served everywhere."""

    message: Literal["Weight update finished"] = "Weight update finished"
    policy_version: int
    transfer_s: float = Field(description="seconds from /start_weight_update to now, including the wait for running "
                                          "batches")
    transfer_bytes: int = Field(description="bytes of the tensors sent, once (the group broadcasts them)")


class WorldSizeResponse(BaseModel):
    """vLLM's answer to GET /get_world_size: the model workers of every serving engine (a trainer's group has one
    rank more, its own)."""

    world_size: int


class WeightTransferInfo(BaseModel):
    """GET /v1/weights/transfer (DAS): what a trainer needs to join the group."""

    backend: TransferBackend | None = Field(description="None: the engines were started without weight transfer "
                                                        "(das serve --weight-transfer none)")
    world_size: int = Field(description="model workers of every serving engine (the group is this + 1)")
    policy_version: int


def update_bytes(update_info: dict[str, Any] | list[dict[str, Any]]) -> int:
    """Bytes of the tensors an update info describes (the first entry of a per-rank list: every rank receives the
    same broadcast). ValueError for a dtype outside DTYPE_BYTES or a malformed entry."""
    info = update_info[0] if isinstance(update_info, list) and update_info else update_info
    if not isinstance(info, dict):
        raise ValueError("update_info: an object with names, dtype_names and shapes")
    total = 0
    for dtype, shape in zip(info.get("dtype_names") or [], info.get("shapes") or []):
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"update_info.dtype_names: {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        numel = 1
        for size in shape:
            numel *= int(size)
        total += numel * DTYPE_BYTES[dtype]
    return total
