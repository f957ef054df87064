"""The gloo weight-transfer backend in vLLM's two factories (vllm/distributed/weight_transfer/factory.py), through
their public `register_engine`: `GlooWeightTransferEngine` on the worker side, `GlooTrainerWeightTransferEngine` on
the trainer side, both under the name "gloo", following vLLM's interfaces (base.py) and its NCCL engine's layout
(trainer rank 0, workers at `rank_offset` + their rank). The data plane is torch only (gloo_transfer.py), so the
trainer's `WeightSender` uses it without vLLM.

Unlike vLLM's NCCL engine, which loads each layer as it arrives, a gloo worker stages what it receives and loads
it all at /finish_weight_update (vLLM's in-place reload, the checkpoint reload's own loader): a push that fails
midway (a peer dies, a refused name or shape, the trainer gone) loads nothing, and the engine keeps serving the
weights it had. The cost is one copy of the weights in host memory while a push runs. One engine of the group is
asked to keep that copy past the finish until it has saved it as a checkpoint (pushed_weights.py), which an engine
restarted later loads.

`register_backends()` is called by our vLLM plugin (plugin.py) in every engine process and by a trainer that uses
vLLM's trainer factory; it is idempotent.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from das.service.engine.vllm.gloo_transfer import (
    DEFAULT_PACKED_BUFFER_BYTES,
    DEFAULT_TIMEOUT_S,
    GlooGroup,
    GlooInitInfo,
    GlooUpdateInfo,
    checkpoint_manifest,
    join_as_trainer,
    push,
    receive,
    refusal,
)
from das.service.engine.vllm.pushed_weights import save_pushed

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

BACKEND = "gloo"
_registered = False


def register_backends() -> None:
    """Registers the gloo engines in vLLM's worker-side and trainer-side factories (lazily: by module path)."""
    global _registered
    if _registered:
        return
    WeightTransferEngineFactory.register_engine(BACKEND, __name__, "GlooWeightTransferEngine")
    WeightTransferTrainerFactory.register_engine(BACKEND, __name__, "GlooTrainerWeightTransferEngine")
    _registered = True


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """A CPU worker's side: joins the group, checks each update against the served checkpoint's names and shapes
    (the verdict, before any tensor moves), stages the tensors, loads them all at finish."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device,
                 model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        # Read now: a checkpoint reload repoints model_config.model at the checkpoint it loaded.
        self._model_dir = vllm_config.model_config.model
        self._manifest = checkpoint_manifest(self._model_dir)
        self._group: GlooGroup | None = None
        self._staged: list[tuple[str, torch.Tensor]] | None = None  # None: no update, or it was given up
        self._keep = False  # the open update's tensors are kept past its finish, to be saved
        self._kept: list[tuple[str, torch.Tensor]] | None = None  # the last finished update's, until saved

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        if self._group is not None:
            self._group.close()
        parallel = self.parallel_config
        rank = init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
        self._group = GlooGroup(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                                init_info.timeout_s, init_info.chunk_bytes)

    def start_weight_update(self) -> None:
        self._staged, self._keep, self._kept = [], False, None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's base synchronises the accelerator after receiving, which a CPU worker has none of.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self._group is None:
            raise RuntimeError("gloo weight transfer is not initialized: call /init_weight_transfer_engine first")
        if self._staged is None:
            raise RuntimeError("no weight update is open: call /start_weight_update first")
        why_not = refusal(update_info, self._manifest)
        if why_not is None and (again := {n for n, _ in self._staged} & set(update_info.names)):
            why_not = f"update_info.names: {sorted(again)[0]!r} was already sent in this update"
        try:
            self._staged.extend(receive(self._group, update_info, why_not))
        except BaseException:
            self._staged = None  # given up: finish loads nothing
            raise

    def discard(self) -> None:
        """Gives up the open update: its finish loads nothing."""
        self._staged, self._keep = None, False

    def keep(self) -> None:
        """The open update's tensors are kept after its finish until `save` (one engine of the group does this)."""
        if self._staged is None:
            raise RuntimeError("no weight update is open: nothing to keep")
        self._keep = True

    def save(self, root: str, version: int) -> str:
        """Saves the kept tensors of the last finished update as the checkpoint `<root>/v<version>`
        (pushed_weights.py; written by the engine's first worker, the others drop their copy) and drops them;
        returns its path. RuntimeError when no finished update was kept."""
        kept, self._kept = self._kept, None
        if kept is None:
            raise RuntimeError("no finished weight update was kept: nothing to save")
        path = Path(root) / f"v{version}"
        if self.parallel_config.rank == 0:
            path = save_pushed(kept, self._model_dir, root, version)
        return str(path)

    def finish_weight_update(self) -> None:
        staged, self._staged = self._staged, None
        keep, self._keep = self._keep, False
        if staged is None:
            return
        missing = sorted(set(self._manifest) - {name for name, _ in staged})
        if missing:
            raise ValueError(f"update_info.names: the update lacks {len(missing)} tensor(s) of the served checkpoint "
                             f"(e.g. {missing[0]!r}); nothing was loaded")
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        reload_weights(self.vllm_config, self.model, weights_iterator=iter(staged), weights_path=None,
                       is_checkpoint_format=True)
        refresh_tied_head(self.model)
        if keep:
            self._kept = staged

    def shutdown(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None


def refresh_tied_head(model: torch.nn.Module) -> bool:
    """After an in-place reload (a checkpoint's or a push's), makes a tied output layer compute with the new
    weights; True if the model has one. vLLM 0.32's layerwise reload loads a tied model's embedding but not its
    `lm_head` (the checkpoint has no tensor of that name): it puts the head's old kernel tensors back ("ParallelLMHead:
    Failed to load weights"), and on the CPU those include the GEMM kernel's own packed copy of the weight
    (`dispatch_cpu_unquantized_gemm`), so SmolLM2 kept computing its logits with the weights it booted with
    (docs/design.md "vLLM-CPU defects we work around"). The head is tied to the embedding again and its kernel
    rebuilt from it (its quant method's `process_weights_after_loading`, as at load)."""
    head = getattr(model, "lm_head", None)
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    config = getattr(model, "config", None)
    if head is None or embed is None or not getattr(config, "tie_word_embeddings", False):
        return False
    if head.weight is not embed.weight:
        head.weight = embed.weight
    method = getattr(head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(head)
    return True


class WeightTransferExtension:
    """Worker-extension methods (mixed into vLLM's worker: service/engine/vllm/worker.py) for the service's side of a
    transfer and of a checkpoint reload."""

    weight_transfer_engine: WeightTransferEngine | None
    model_runner: Any

    def das_refresh_tied_head(self) -> bool:
        """`refresh_tied_head` on this worker's model (after vLLM's reload_weights)."""
        return refresh_tied_head(self.model_runner.get_model())

    def das_abort_weight_update(self) -> bool:
        """Gives up the open update: a gloo engine drops what it staged (nothing loaded), then vLLM's worker closes
        the update as a finish would. vLLM's NCCL engine loads as it receives: what it loaded stays (docs/design.md
        "vLLM's RL control plane"). Reads vLLM's private `_weight_update_active` (vLLM 0.32's worker: whether an
        update is open, cleared by a failed update_weights itself)."""
        if isinstance(self.weight_transfer_engine, GlooWeightTransferEngine):
            self.weight_transfer_engine.discard()
        if getattr(self, "_weight_update_active", False):
            self.finish_weight_update()  # type: ignore[attr-defined]  # vLLM's Worker method
        return True

    def das_keep_weight_update(self) -> bool:
        """This worker keeps the open update's tensors past its finish, for `das_save_weight_update`."""
        self._gloo_engine().keep()
        return True

    def das_save_weight_update(self, root: str, version: int) -> str:
        """Saves the kept tensors of the last finished update as the checkpoint `<root>/v<version>`; its path."""
        return self._gloo_engine().save(root, version)

    def _gloo_engine(self) -> GlooWeightTransferEngine:
        engine = self.weight_transfer_engine
        if not isinstance(engine, GlooWeightTransferEngine):
            raise RuntimeError("only the gloo weight transfer stages a push, so only it can save one")
        return engine


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """The trainer's init info for vLLM's trainer factory: rank 0 hosts the rendezvous at
    `master_address:master_port`; `world_size` is the service's GET /get_world_size + 1."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S
    # unpacked unless told: over gloo on a CPU, packing was slower (a copy into the buffer before each broadcast)
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_BYTES


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """The trainer's side in vLLM's trainer factory (`WeightTransferTrainerFactory.trainer_init`): a full resync of
    its `WeightSource` each `send_weights`. Non-sender ranks only iterate the source (its gathers are collectives)."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource | None = None,
                 is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self._group: GlooGroup | None = None

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> Self:
        if source is None:
            raise ValueError("gloo trainer weight transfer requires a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if engine.is_sender:
            engine._group = join_as_trainer(client, init_info.master_address, init_info.master_port,
                                            init_info.world_size, init_info.timeout_s,
                                            init_info.packed_buffer_size_bytes if init_info.packed else None)
        return engine

    def send_weights(self) -> None:
        assert self.source is not None  # trainer_init refuses none
        pairs: Iterator[tuple[str, torch.Tensor]] = iter(self.source)
        if not self.is_sender:
            for _ in pairs:
                pass
            return
        assert self._group is not None
        push(self.client, self._group, list(pairs))

    def shutdown(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None


class PushedPairs(WeightSource):
    """A `WeightSource` over the (name, tensor) pairs of the current push: the trainer's `WeightSender` sets
    `pairs` before each `send_weights` (vLLM's trainer engines take their source once, at init)."""

    def __init__(self) -> None:
        self.pairs: list[tuple[str, torch.Tensor]] = []

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in self.pairs]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.pairs)


def nccl_trainer(client: VLLMWeightSyncClient, master_address: str, master_port: int,
                 world_size: int) -> TrainerWeightTransferEngine:
    """vLLM's NCCL trainer engine (rank 0, the sender) over `client`, its source a `PushedPairs`: what the
    trainer's WeightSender pushes with on GPU engines. Needs CUDA on the trainer."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    return WeightTransferTrainerFactory.trainer_init(
        NCCLTrainerInitInfo(master_address=master_address, master_port=master_port, world_size=world_size, rank=0),
        client=client, source=PushedPairs())
