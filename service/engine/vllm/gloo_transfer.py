"""The gloo weight transfer's data plane, in torch only (no vLLM): what our worker-side engine
(service/engine/vllm/weight_transfer.py, registered in vLLM's factories) and the trainer's `WeightSender`
(service/client/weights.py, which must not import vLLM) share. vLLM's NCCL engine broadcasts over NCCL, which needs
CUDA; this is the same broadcast over gloo, so the whole path runs on CPU engines.

The group: a torch `ProcessGroupGloo` of its own over a `TCPStore` that the trainer (rank 0) hosts at
`master_address:master_port`; the engines' workers join it at rank `rank_offset` + their rank. It never touches
torch.distributed's default group (vLLM's workers have one of their own). Besides the store's port, gloo connects
every pair of ranks on ports of its own choosing: the trainer and every engine node must reach each other.

One update, on every rank in this order:
1. the verdict: an all-reduce of one int64 per rank, 1 where a worker refuses the update info (a name the served
   checkpoint does not have, a shape it does not have: `refusal`). Any refusal and no tensor is sent: every rank
   gives up this update, so a bad push loads nothing anywhere.
2. every tensor, broadcast from rank 0 in the update info's order, in the dtype it names: packed, consecutive
   tensors' bytes in one buffer of up to `packed_buffer_size_bytes` per broadcast (a tensor larger than that alone,
   as itself), or one broadcast per tensor when the group is not packed. Both sides cut the same chunks from the
   update info (`packed_chunks`), so nothing but the buffer size has to agree, and it is fixed when the group forms
   (vLLM's NCCL engine makes `packed` the same kind of init-time wire parameter). Unpacked is the default: a
   packed broadcast waits for its buffer to be filled (a copy of every tensor, nothing sent meanwhile), which cost
   more than the per-tensor round trips it saves for SmolLM2's 273 and Qwen2.5-Coder's 291 tensors over loopback
   (docs/results, "weight sync, 2026-11-29"); packing pays where tensors are many and small.
A rank that dies mid-update breaks every other rank's next collective at once (gloo: "Connection closed by peer"),
a rank that hangs breaks them after `timeout_s`; the workers' received tensors are only staged, so nothing is
loaded (service/engine/vllm/weight_transfer.py).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

_PREFIX = "das-weight-transfer"
DEFAULT_TIMEOUT_S = 120.0
# How long past the group's timeout a trainer whose broadcast broke waits for the service's answer (every worker's
# receive has ended by the timeout; then the service gives the push up and answers)
_ANSWER_GRACE_S = 30.0
DEFAULT_PACKED_BUFFER_BYTES = 256 * 2**20  # a chunk's bytes: the sender's extra memory, and each receiver's per chunk
_ALIGN = 16  # bytes: every tensor of a chunk starts at a multiple, so each slice can be viewed as its dtype
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


class TransferRefused(ValueError):
    """A worker refused the update (the verdict was not unanimous): nothing was sent or loaded."""


@dataclass(frozen=True)
class GlooInitInfo:
    """A worker's init info (vLLM builds it from the dict of /init_weight_transfer_engine: `cls(**init_info)`).
    `rank_offset`: the group rank of this engine's first worker; `timeout_s`: how long a collective may wait for a
    peer before it fails (a trainer that hangs mid-push); `packed`, `packed_buffer_size_bytes`: how tensors are
    broadcast (module docstring), as the trainer forms the group (unpacked unless it says so, as vLLM's NCCL
    worker)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_BYTES

    @property
    def chunk_bytes(self) -> int:
        """The group's packing: a chunk's most bytes, 0 for one broadcast per tensor."""
        return self.packed_buffer_size_bytes if self.packed else 0

    def __post_init__(self) -> None:
        if not self.packed_buffer_size_bytes > 0:
            raise ValueError(f"init_info.packed_buffer_size_bytes: must be positive, got "
                             f"{self.packed_buffer_size_bytes}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"init_info.master_port: {self.master_port} is not a TCP port")
        if not 1 <= self.rank_offset < self.world_size:
            raise ValueError(f"init_info.rank_offset {self.rank_offset} must lie in [1, world_size {self.world_size})")
        if not self.timeout_s > 0:
            raise ValueError(f"init_info.timeout_s: must be positive, got {self.timeout_s}")


@dataclass(frozen=True)
class GlooUpdateInfo:
    """One update's tensors, in the order they are broadcast: checkpoint names, torch dtype names, full shapes."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"update_info: names ({len(self.names)}), dtype_names ({len(self.dtype_names)}) and "
                             f"shapes ({len(self.shapes)}) must be as long as each other")
        bad = [d for d in self.dtype_names if d not in _DTYPES]
        if bad:
            raise ValueError(f"update_info.dtype_names: {bad[0]!r} is not one of {sorted(_DTYPES)}")
        if len(set(self.names)) != len(self.names):
            raise ValueError("update_info.names: a name appears twice")

    def metas(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        return [(n, _DTYPES[d], tuple(int(s) for s in shape))
                for n, d, shape in zip(self.names, self.dtype_names, self.shapes)]

    def nbytes(self) -> list[int]:
        """Each tensor's bytes, in order."""
        return [math.prod(shape) * dtype.itemsize for _, dtype, shape in self.metas()]

    @classmethod
    def of(cls, pairs: Sequence[tuple[str, torch.Tensor]]) -> GlooUpdateInfo:
        return cls(names=[n for n, _ in pairs], dtype_names=[str(t.dtype).removeprefix("torch.") for _, t in pairs],
                   shapes=[list(t.shape) for _, t in pairs])


def packed_chunks(nbytes: Sequence[int], chunk_bytes: int) -> list[range]:
    """The update's tensors (their bytes, in order) cut into broadcasts: consecutive tensors while their aligned
    bytes fit `chunk_bytes`; a tensor larger than that is a chunk of its own; `chunk_bytes` 0: a chunk per tensor.
    Every rank computes the same chunks from the same update info."""
    chunks: list[range] = []
    start, size = 0, 0
    for i, n in enumerate(nbytes):
        if i > start and (chunk_bytes == 0 or _aligned(size) + n > chunk_bytes):
            chunks.append(range(start, i))
            start, size = i, 0
        size = _aligned(size) + n
    if nbytes:
        chunks.append(range(start, len(nbytes)))
    return chunks


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def _layout(nbytes: Sequence[int]) -> tuple[list[int], int]:
    """Each tensor's byte offset in its chunk's buffer, and the buffer's bytes."""
    offsets, size = [], 0
    for n in nbytes:
        size = _aligned(size)
        offsets.append(size)
        size += n
    return offsets, size


def checkpoint_manifest(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor of the safetensors checkpoint in `model_dir` and its shape, read from the files' headers
    (nothing loaded): the names and shapes a transfer must use."""
    from safetensors import safe_open

    manifest: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                manifest[name] = tuple(f.get_slice(name).get_shape())
    return manifest


def refusal(info: GlooUpdateInfo, manifest: Mapping[str, tuple[int, ...]]) -> str | None:
    """Why a worker serving `manifest` refuses `info` (the first wrong name or shape), or None."""
    for name, _, shape in info.metas():
        expected = manifest.get(name)
        if expected is None:
            return (f"update_info.names: {name!r} is not a tensor of the served checkpoint "
                    f"(e.g. {', '.join(sorted(manifest)[:3])})")
        if shape != expected:
            return f"update_info.shapes: {name!r} is {list(shape)}, the served checkpoint's is {list(expected)}"
    return None


class GlooGroup:
    """One rank's membership of the transfer group. Rank 0 (the trainer) hosts the store; the constructor returns
    once every rank has joined (or raises after `timeout_s`). `chunk_bytes`: the group's packing (`packed_chunks`),
    the same on every rank."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 timeout_s: float = DEFAULT_TIMEOUT_S, chunk_bytes: int = 0) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.rank = rank
        self.world_size = world_size
        self.chunk_bytes = chunk_bytes
        # kept: the trainer's store serves the others for as long as the group lives
        self._store = torch.distributed.TCPStore(master_address, master_port, world_size, is_master=rank == 0,
                                                 timeout=timeout, wait_for_workers=False)
        self._group: Any = torch.distributed.ProcessGroupGloo(
            torch.distributed.PrefixStore(_PREFIX, self._store), rank, world_size, timeout)

    def verdict(self, refused: bool) -> int:
        """How many ranks refuse this update (every rank calls it once per update, before any tensor)."""
        flag = torch.tensor([int(refused)], dtype=torch.int64)
        self._group.allreduce([flag]).wait()
        return int(flag.item())

    def broadcast(self, tensor: torch.Tensor) -> None:
        options = torch.distributed.BroadcastOptions()
        options.rootRank = 0
        self._group.broadcast([tensor], options).wait()

    def close(self) -> None:
        """Leaves the group (the peers' next collective fails)."""
        self._group = None
        self._store = None


def send(group: GlooGroup, pairs: Iterable[tuple[str, torch.Tensor]], info: GlooUpdateInfo) -> int:
    """Rank 0's side of one update: the verdict, then every tensor. Returns the bytes sent. TransferRefused when a
    worker refused (nothing sent); the workers say why in their answer to /update_weights."""
    refused = group.verdict(False)
    if refused:
        raise TransferRefused(f"{refused} model worker(s) refused the update")
    tensors = []
    for (name, tensor), (expected, dtype, shape) in zip(pairs, info.metas(), strict=True):
        if name != expected or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"tensor {name!r} {tensor.dtype} {tuple(tensor.shape)} is not the announced "
                             f"{expected!r} {dtype} {shape}")  # the workers then fail at the timeout
        tensors.append(tensor)
    nbytes = info.nbytes()
    for chunk in packed_chunks(nbytes, group.chunk_bytes):
        if len(chunk) == 1:
            group.broadcast(tensors[chunk[0]].detach().to("cpu").contiguous())
            continue
        offsets, size = _layout([nbytes[i] for i in chunk])
        buffer = torch.zeros(size, dtype=torch.uint8)
        for i, offset in zip(chunk, offsets):
            data = tensors[i].detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            buffer[offset:offset + nbytes[i]] = data
        group.broadcast(buffer)
    return sum(nbytes)


def receive(group: GlooGroup, info: GlooUpdateInfo, why_not: str | None) -> list[tuple[str, torch.Tensor]]:
    """A worker's side of one update: the verdict (`why_not`: this worker's refusal, else None), then every tensor,
    received into new CPU tensors (staged, not loaded). TransferRefused naming the cause when any rank refused."""
    refused = group.verdict(why_not is not None)
    if why_not is not None:
        raise TransferRefused(why_not)
    if refused:
        raise TransferRefused(f"update_info: {refused} other model worker(s) refused the update")
    staged = []
    metas, nbytes = info.metas(), info.nbytes()
    for chunk in packed_chunks(nbytes, group.chunk_bytes):
        if len(chunk) == 1:
            name, dtype, shape = metas[chunk[0]]
            tensor = torch.empty(shape, dtype=dtype)
            group.broadcast(tensor)
            staged.append((name, tensor))
            continue
        offsets, size = _layout([nbytes[i] for i in chunk])
        buffer = torch.empty(size, dtype=torch.uint8)
        group.broadcast(buffer)
        for i, offset in zip(chunk, offsets):  # views into the chunk: staged, loaded at finish
            name, dtype, shape = metas[i]
            staged.append((name, buffer[offset:offset + nbytes[i]].view(dtype).reshape(shape)))
    return staged


class SyncClient(Protocol):
    """The control plane a trainer drives (vLLM's `VLLMWeightSyncClient`, structurally: the service's HTTP routes
    behind it)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


def join_as_trainer(client: SyncClient, master_address: str, master_port: int, world_size: int,
                    timeout_s: float = DEFAULT_TIMEOUT_S,
                    packed_buffer_size_bytes: int | None = None) -> GlooGroup:
    """Opens the group as rank 0 while the service's workers join it (/init_weight_transfer_engine, which returns
    once they have). `master_address` must be reachable from every engine node; gloo's pair ports too.
    `packed_buffer_size_bytes`: a packed broadcast's most bytes (None: one broadcast per tensor)."""
    init = {"master_address": master_address, "master_port": master_port, "rank_offset": 1,
            "world_size": world_size, "timeout_s": timeout_s, "packed": packed_buffer_size_bytes is not None,
            "packed_buffer_size_bytes": packed_buffer_size_bytes or DEFAULT_PACKED_BUFFER_BYTES}
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        joined = pool.submit(client.init_weight_transfer_engine, init)
        try:
            group = GlooGroup(master_address, master_port, 0, world_size, timeout_s, packed_buffer_size_bytes or 0)
        except BaseException:
            if joined.done():
                joined.result()  # the service's refusal says more than the rendezvous timeout
            raise
        joined.result()
    finally:
        pool.shutdown(wait=False)  # a failed rendezvous leaves the call to end at its own timeout
    return group


def push(client: SyncClient, group: GlooGroup, pairs: Sequence[tuple[str, torch.Tensor]],
         weight_version: str | None = None) -> int:
    """One whole update from rank 0: /start_weight_update, /update_weights beside the broadcast (the workers
    receive inside that call), /finish_weight_update. Returns the bytes sent. A refused update, or one whose group
    broke under the broadcast (a worker died: gloo says only which address closed), raises the service's error
    (it names the cause); nothing is loaded anywhere then. A broken group is closed here."""
    info = GlooUpdateInfo.of(pairs)
    client.start_weight_update()
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        received = pool.submit(client.update_weights, dataclasses.asdict(info))
        try:
            sent = send(group, pairs, info)
        except TransferRefused:
            received.result()  # the service's answer names the refusal
            raise
        except RuntimeError as exc:  # gloo's: the group broke
            # Leaving it breaks the other workers' receives now, so the service answers without waiting out
            # their timeout; its answer names the engine that died.
            group.close()
            answer = _failure(received, group.timeout_s + _ANSWER_GRACE_S)
            if answer is not None:
                raise answer from exc
            raise
        received.result()
    finally:
        pool.shutdown(wait=False)  # never wait on a call a broken group leaves hanging until its timeout
    client.finish_weight_update(weight_version)
    return sent


def _failure(call: Future[None], timeout_s: float) -> BaseException | None:
    """The error `call` ended with, None if it succeeded or had not ended after `timeout_s`."""
    try:
        return call.exception(timeout=timeout_s)
    except TimeoutError:
        return None
