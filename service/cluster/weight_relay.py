"""`WeightRelay`: vLLM's weight transfer relayed from the trainer to the serving engines (docs/design.md "Weight
transfer"; rollout_backend.RolloutBackend.control says what each step does). The coordinator, service/cluster/
coordinator.py `RayBackend`, hands it every step (a `WeightTransferStep` message, service/wire/engine_control.py) and
composes it with the engine supervision and dispatch. It keeps the group and the order of a push; the engines get
each step as a control message to their actors (`NodeEngine.control`), as every other verb reaches them.

Invariants: the group is the engines that served at /init_weight_transfer_engine, each as of its incarnation, in
the order of the serving engines; a push needs the same ones serving (else WeightUpdateConflict: join again). A push
holds the policy's `weights_lock` from its start to its end, so checkpoint reloads and restarted engines' catch-up
wait for it; a failure anywhere gives the push up everywhere. An engine lost during a call is reported to the
supervisor as a death.

Under gloo with a state directory, a finished push is saved as a checkpoint for engines that load later (restarted,
or on a node that joined: the supervisor's catch-up loads `ServedPolicy.pushed`): the group's first engine keeps
the tensors it staged and, once the trainer has its answer, writes them under `<state_dir>/pushed-weights`
(service/engine/vllm/pushed_weights.py). The `weights_lock` is held until that write ends, so a catch-up meanwhile
waits for it and the next push or reload starts after it; `pushed` moves only once the checkpoint is whole. A save
that fails is logged, and `pushed` stays at the last push saved.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from das.service.cluster.engine_supervisor import ActorRecord, EngineSupervisor, ServedPolicy, lost_errors
from das.service.cluster.rollout_backend import WeightUpdateConflict
from das.service.config import ServiceConfig
from das.service.engine.config import transfer_backend
from das.service.engine.contract import EngineInputError
from das.service.wire.engine_control import (
    AbortWeightUpdate,
    FinishWeightUpdate,
    InitWeightTransfer,
    SaveWeightUpdate,
    ShutdownWeightTransfer,
    StartWeightUpdate,
    UpdateWeights,
    WeightTransferControl,
)
from das.service.wire.weight_transfer import TransferBackend

log = logging.getLogger(__name__)

PUSHED_DIR = "pushed-weights"  # under the state directory: the last push saved (a v<version> checkpoint)


class WeightRelay:
    """The trainer's weight-transfer group over the engines `supervisor` keeps; `gpu_nodes`: the engines run on GPU
    nodes (what the transfer backend depends on)."""

    def __init__(self, config: ServiceConfig, supervisor: EngineSupervisor, policy: ServedPolicy,
                 gpu_nodes: bool) -> None:
        self.config = config
        self._supervisor = supervisor
        self._policy = policy
        self._gpu_nodes = gpu_nodes
        # the engines in the trainer's weight-transfer group (actor, incarnation), in rank order: set by
        # /init_weight_transfer_engine; a push needs the same ones serving
        self._transfer_group: list[tuple[ActorRecord, int]] = []
        self._pushing = False  # a push is open: the policy's `weights_lock` is held from its start to its end
        self._saving: asyncio.Task[None] | None = None  # the last push's save (holds the `weights_lock`)

    @property
    def weight_transfer(self) -> TransferBackend | None:
        return transfer_backend(self.config.engine.weight_transfer, gpu=self._gpu_nodes)

    @property
    def saved_pushes(self) -> Path | None:
        """Where finished pushes are saved, None where they are not: only the gloo backend stages a push whole
        (vLLM's NCCL engine loads each tensor as it arrives), and only a state directory outlives an engine."""
        if self.weight_transfer != "gloo" or self.config.state_dir is None:
            return None
        return self.config.state_dir / PUSHED_DIR

    def transfer_world_size(self) -> int:
        engine = self.config.engine
        return len(self._supervisor.serving()) * engine.tensor_parallel_size

    async def control(self, message: WeightTransferControl) -> Any:
        """One step of the transfer on the engines of the group: what each step does is
        rollout_backend.RolloutBackend.control's; how the group is kept, here."""
        if isinstance(message, InitWeightTransfer):
            return await self._join(message.init_info)
        if isinstance(message, StartWeightUpdate):
            return await self._start(message)
        if isinstance(message, UpdateWeights):
            return await self._update(message)
        if isinstance(message, FinishWeightUpdate):
            return await self._finish(message.version)
        if isinstance(message, AbortWeightUpdate):
            return await self._abort()
        if isinstance(message, ShutdownWeightTransfer):
            return await self._leave(message)
        raise WeightUpdateConflict("a push is saved by the service itself, once finished (under --state-dir)")

    async def _join(self, init_info: dict[str, Any]) -> None:
        """Every serving engine joins the trainer's group: engine e's workers at the trainer's `rank_offset` + the
        workers of the engines before it. Refused (EngineInputError) unless `world_size` is that offset + every
        serving worker: a group of another size would wait for ranks that never come."""
        if self._pushing:
            raise WeightUpdateConflict("a weight update is open: finish it before joining a new group")
        serving = self._supervisor.serving()
        if not serving:
            raise RuntimeError("no engine serves: nothing to join the group")
        tp = self.transfer_world_size() // len(serving)
        offset, world = init_info.get("rank_offset", 1), init_info.get("world_size")
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 1:
            raise EngineInputError(f"init_info.rank_offset: the first worker's rank, an integer >= 1; got {offset!r}")
        if world != offset + len(serving) * tp:
            raise EngineInputError(f"init_info.world_size: {world!r}, but the group has the trainer's {offset} "
                                   f"rank(s) and {len(serving) * tp} model workers ({len(serving)} engines x "
                                   f"{tp}): {offset + len(serving) * tp} (GET /get_world_size + 1)")
        # An actor's engines are consecutive among the serving ones: its message names its first engine's rank.
        joins: dict[int, InitWeightTransfer] = {}
        actors: dict[int, ActorRecord] = {}
        for position, (actor, _, _) in enumerate(serving):
            if id(actor) not in actors:
                actors[id(actor)] = actor
                joins[id(actor)] = InitWeightTransfer(init_info={**init_info, "rank_offset": offset + position * tp},
                                                      workers_per_engine=tp)
        self._transfer_group = []
        group = [(actor, actor.incarnation) for actor in actors.values()]
        await self._on_actors(group, lambda actor: actor.handle.control.remote(joins[id(actor)]))
        self._transfer_group = group

    async def _start(self, message: StartWeightUpdate) -> None:
        """Opens a push on every engine of the group (each waits for its running samples unless paused). Held
        against checkpoint reloads and restarted engines' catch-up until it ends (the policy's `weights_lock`)."""
        changed = self._group_changes()
        if changed:
            raise WeightUpdateConflict(f"the engines changed since /init_weight_transfer_engine ({changed}): "
                                       f"join the group again")
        await self._policy.weights_lock.acquire()
        self._pushing = True
        try:
            await self._on_actors(self._transfer_group, lambda actor: actor.handle.control.remote(message))
        except BaseException:
            await self._abort()
            raise

    async def _update(self, message: UpdateWeights) -> None:
        """Every engine of the group receives one chunk (staged); a failure anywhere gives the push up
        everywhere."""
        if not self._pushing:
            raise WeightUpdateConflict("no weight update is open: call /start_weight_update first")
        try:
            await self._on_actors(self._transfer_group, lambda actor: actor.handle.control.remote(message))
        except BaseException:
            await self._abort()
            raise

    async def _finish(self, version: int) -> int:
        """Every engine of the group loads what it received and serves it as `version`; the push ends, and the
        policy's version moves once for them all. Where pushes are saved, the group's first engine keeps its
        tensors and saves them in the background (the lock held until it has)."""
        if not self._pushing:
            raise WeightUpdateConflict("no weight update is open: call /start_weight_update first")
        root = self.saved_pushes
        keeper, incarnation = self._transfer_group[0]
        finish = FinishWeightUpdate(version=version)
        kept = FinishWeightUpdate(version=version, keep=root is not None)
        try:
            replies = await self._on_actors(self._transfer_group, lambda actor: actor.handle.control.remote(
                kept if actor is keeper else finish))
            version = finish.combine(replies)
        except BaseException:
            await self._abort()
            raise
        self._policy.version = version
        self._pushing = False
        if root is None:
            self._policy.weights_lock.release()
        else:
            self._saving = asyncio.create_task(self._save(keeper, incarnation, root, version))
        return version

    async def _save(self, keeper: ActorRecord, incarnation: int, root: Path, version: int) -> None:
        """`keeper` saves the push it kept as `<root>/v<version>`, which becomes what a restart loads; then the
        policy's `weights_lock` (held since the push's start) is released."""
        try:
            path = await keeper.handle.control.remote(SaveWeightUpdate(root=str(root), version=version))
            self._policy.pushed = (path, version)
            log.info("the push of policy version %d is saved at %s for engines that load later", version, path)
        except Exception as exc:
            if isinstance(exc, lost_errors()):
                self._supervisor.engine_died(keeper, incarnation, exc)
            log.error("the push of policy version %d was not saved (%s: %s): an engine that restarts before the "
                      "next push serves older weights", version, type(exc).__name__,
                      (str(exc).strip().splitlines() or [""])[-1])
        finally:
            self._policy.weights_lock.release()

    async def _abort(self) -> None:
        """Gives the open push up on every engine of the group (nothing loaded by the gloo backend); idempotent."""
        if not self._pushing:
            return
        try:
            await self._on_actors([(a, i) for a, i in self._transfer_group if a.state == "serving"],
                                  lambda actor: actor.handle.control.remote(AbortWeightUpdate()))
        finally:
            self._pushing = False
            self._policy.weights_lock.release()

    async def _leave(self, message: ShutdownWeightTransfer) -> None:
        await self._abort()
        group, self._transfer_group = self._transfer_group, []
        await self._on_actors([(a, i) for a, i in group if a.state == "serving"],
                              lambda actor: actor.handle.control.remote(message))

    def _group_changes(self) -> str:
        """How the serving engines differ from the transfer group's ('' if they do not)."""
        if not self._transfer_group:
            return "no group: call /init_weight_transfer_engine first"
        members = {id(actor): incarnation for actor, incarnation in self._transfer_group}
        serving = self._supervisor.serving_actors()
        gone = [actor for actor, incarnation in self._transfer_group
                if actor.state != "serving" or actor.incarnation != incarnation]
        new = [actor for actor in serving if id(actor) not in members]
        return "; ".join([*(f"engine {', '.join(a.names)} restarted or stopped serving" for a in gone),
                          *(f"engine {', '.join(a.names)} joined" for a in new)])

    async def _on_actors(self, actors: list[tuple[ActorRecord, int]],
                         call: Callable[[ActorRecord], Any]) -> list[Any]:
        """`call(actor)` on each of `actors` at once; their replies. A lost actor is reported as a death, as a
        RuntimeError naming it. Of the failures one is raised: the first refusal (EngineInputError), else the first
        death, else the first other error as it is."""
        replies = await asyncio.gather(*(call(actor) for actor, _ in actors), return_exceptions=True)
        lost = lost_errors()
        refusals: list[BaseException] = []
        deaths: list[BaseException] = []
        errors: list[BaseException] = []
        for (actor, incarnation), reply in zip(actors, replies):
            if isinstance(reply, lost):
                self._supervisor.engine_died(actor, incarnation, reply)
                deaths.append(RuntimeError(f"engine {', '.join(actor.names)} died during the weight transfer"))
            elif isinstance(reply, EngineInputError):
                refusals.append(reply)
            elif isinstance(reply, BaseException):
                errors.append(reply)
        # A refusal says more than the broken group it leaves the others with, and a death more than the receives
        # it broke in the other engines (gloo's "Connection closed by peer", in whichever position they are).
        failures = [*refusals, *deaths, *errors]
        if failures:
            raise failures[0]
        return list(replies)
