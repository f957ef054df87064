"""`RayBackend`: the coordinator of the Ray-distributed service (a `RolloutBackend` for the gateway).

Actors (Ray's own scheduling, node affinity and failure reporting; no cluster manager of ours):
- `HistoryShard` x S (service/cluster/history_store.py), on the coordinator's node: rollouts and difficulty by problem,
  snapshotted to the state directory every `history.snapshot_interval_s` and at shutdown.
- `NodeEngine` x engines (service/cluster/node_engine.py), one per engine (a GPU node's GPUs / `tensor_parallel_size`,
  `engines_per_node` on a node without), pinned to its node with a hard node-affinity strategy: every GPU node, or
  every node when the cluster has no GPU (a CPU machine; the embedded default). A node that
  joins later (a worker pod added, or replacing a lost one) gets its actors within `adopt_nodes_interval_s`.

The coordinator itself runs in the gateway's process (the Ray driver), not as an actor: it only predicts, places
and relays, and keeping it beside the gateway saves every sample one more hop. `RayBackend` is a facade over three
parts, each in its own module:
- service/cluster/engine_supervisor.py `EngineSupervisor`: the engine actors, from their start and load to their
  death, restart and catch-up, nodes that join or leave, and the autoscaler's demand. It owns the actor records, the
  list of engines and the notification of their changes.
- service/cluster/dispatch.py `Dispatcher`: a batch's groups placed on the serving engines, run there, re-run
  elsewhere when an engine dies, and merged into one stream.
- service/cluster/weight_relay.py `WeightRelay`: vLLM's weight transfer from the trainer to the serving engines.
The facade owns what they share (`ServedPolicy`: the weights and the pause every engine serves, and their locks; the
pause hold; the difficulty book; the prompts given up) and passes it to them, and it keeps the history shards.

Locally `RayBackend.start(config)` starts an embedded single-node cluster; with `address` it joins a running one
(`ray start --head` on the head node, `ray start --address=...` on the others, or KubeRay).

An engine that dies loses nothing (docs/design.md "Failure behaviour"): the supervisor restarts it and catches it up,
and dispatch runs the samples it owed elsewhere, so every sample index reaches the client exactly once. `ready()`
while at least one engine serves; `live()` False once no engine can ever serve again. An engine that fails to load is
told by its error's kind (service/cluster/load_failure.py): one no retry mends stays down at once with its cause and
what to do, in `stats().engines_failed` (/readyz) and `engine_load_failures` (/metrics, by reason), while the others
serve; any other restarts it as a death does. `fatal_error` says when no engine will ever serve: `das serve` then
stops with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

from das.scheduler.difficulty import DifficultyBook, DifficultyFormatError, load_difficulty
from das.service.cluster.dispatch import Dispatcher, Placement
from das.service.cluster.engine_failure import GivenUpPrompts
from das.service.cluster.engine_supervisor import (EngineSupervisor, ServedPolicy, check_layouts,
                                                   first_engine_actors, lost_errors)
from das.service.cluster.group_aborts import GroupAborts
from das.service.cluster.history_store import HistoryShardActor, shard_of
from das.service.cluster.rollout_backend import BackendStats, GroupInputError, ProgressSink
from das.service.cluster.sessions import SessionBook
from das.service.cluster.weight_relay import WeightRelay
from das.service.config import ServiceConfig
from das.service.engine.contract import validate_rollouts
from das.service.engine.pause_gate import PauseGate
from das.service.wire.api import GroupRequest, ProblemSummary, SampleResult
from das.service.wire.engine_control import (AddHistory, EngineControl, Pause, ReloadWeights, Resume,
                                               WeightTransferStep)
from das.service.wire.weight_transfer import TransferBackend

log = logging.getLogger(__name__)

# Passed on to the engine actors' processes, which do not inherit the driver's environment when joining a cluster.
_FORWARDED_ENV = ("VLLM_LOGGING_LEVEL", "VLLM_LOGGING_STREAM", "VLLM_PLUGINS", "DAS_DATA_DIR",
                  "VLLM_CPU_OMP_THREADS_BIND")


class _RayInThisProcess:
    """Ray as the backends of one process share it: a backend joins the Ray connection an earlier one made, and Ray
    that a backend started stops when the last backend using it closes, not when the one that started it does
    (the others' actors would die with it; `das bench e2e` runs two service arms side by side)."""

    started_here = False
    users = 0


class RayBackend:
    """Use `await RayBackend.start(config)`; `await close()` at the end (snapshots the history). `supervisor`,
    `dispatcher` and `weight_relay` are its parts (the module's docstring)."""

    def __init__(self, config: ServiceConfig, shards: list[Any], shard_names: list[str],
                 actors: list[tuple[str, Any, list[str]]], gpu_nodes: bool, own_cluster: bool = False) -> None:
        self.config = config
        self._shards = shards
        self._uses_ray = True  # until close: counted in _RayInThisProcess.users
        self._policy = ServedPolicy()
        # every dispatch to an engine actor waits here while paused (service/engine/pause_gate.py)
        self._hold = PauseGate()
        self._book = DifficultyBook()
        self._given_up_prompts = GivenUpPrompts(config.failure)  # what `check` refuses for a while after that
        self._stats = BackendStats()
        self._background: list[asyncio.Task[None]] = []
        self.supervisor = EngineSupervisor(config, shard_names, actors, gpu_nodes, self._policy, own_cluster)
        self.dispatcher = Dispatcher(config, self.supervisor, self._policy, self._hold, self._book,
                                     self._given_up_prompts)
        self.weight_relay = WeightRelay(config, self.supervisor, self._policy, gpu_nodes)

    # ---- lifecycle ----

    @classmethod
    async def start(cls, config: ServiceConfig, progress: Callable[[str], None] = log.info) -> RayBackend:
        """Connects to (or starts) Ray and creates the actors. The engines load in the background: `ready()` is
        False until every one has loaded or failed for good (`load_error` says why), and while none serves.
        LayoutError, before any actor exists, for a GPU node whose GPUs the tensor parallel size does not divide,
        and in a cluster this process starts, for a node without a GPU whose CPUs cannot run it."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if not ray.is_initialized():
            env = {k: os.environ[k] for k in _FORWARDED_ENV if k in os.environ}
            kwargs: dict[str, Any] = {"include_dashboard": False, "runtime_env": {"env_vars": env}}
            if config.address is None:
                kwargs["object_store_memory"] = config.object_store_mib << 20
            # "local": always a cluster of our own; with no address Ray would join one that `ray start` left
            # running on this machine.
            ray.init(address=config.address or "local", **kwargs)
            _RayInThisProcess.started_here = True
        own_cluster = _RayInThisProcess.started_here
        check_layouts(config, own_cluster)
        here = ray.get_runtime_context().get_node_id()
        state_dir = str(config.state_dir.resolve()) if config.state_dir is not None else None
        # Restarted by Ray when it dies, from its last snapshot; no task retries: engines re-send their pushes.
        shard_actor = ray.remote(HistoryShardActor)
        # Named, and named to the engine actors: a restarted NodeEngine re-runs its constructor, and handles among
        # its arguments would have to outlive it in Ray's object store (Ray logs an error at every start).
        shard_names = [f"das-history-{uuid.uuid4().hex[:12]}-{i}" for i in range(config.history.shards)]
        shards = [shard_actor.options(num_cpus=0, name=name, max_restarts=config.history.max_restarts,
                                      max_task_retries=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
            here, soft=True)).remote(i, config.history, state_dir) for i, name in enumerate(shard_names)]

        actors, gpu_nodes = first_engine_actors(config, shard_names)
        backend = cls(config, shards, shard_names, actors, gpu_nodes, own_cluster=own_cluster)
        backend.supervisor.request_engines(config.target_engines or 0)
        _RayInThisProcess.users += 1
        await backend._load_difficulty()
        progress(f"{len(shards)} history shards, {len(actors)} engine actors; loading engines")
        backend.supervisor.start_loading(progress, backend.refresh_stats)
        backend._background = [asyncio.create_task(backend._every(config.stats_interval_s, backend.refresh_stats)),
                               asyncio.create_task(backend._every(config.history.snapshot_interval_s,
                                                                  backend._snapshot)),
                               asyncio.create_task(backend._every(config.adopt_nodes_interval_s,
                                                                  backend.supervisor.adopt_nodes))]
        return backend

    async def _load_difficulty(self) -> None:
        blobs = await asyncio.gather(*(s.difficulty_blobs.remote() for s in self._shards))
        for shard_blobs in blobs:
            for pid, blob in shard_blobs.items():
                try:
                    self._book.put(load_difficulty(blob))
                except (DifficultyFormatError, ValueError) as exc:
                    log.warning("difficulty record of %s skipped: %s", pid, exc)

    async def wait_ready(self) -> None:
        """Returns once every engine has loaded; RuntimeError if one failed for good instead."""
        await self.supervisor.wait_loaded()
        if self.load_error is not None:
            raise RuntimeError(f"an engine failed to load: {self.load_error}")

    @property
    def load_error(self) -> str | None:
        """Why the engines that failed for good without ever serving did (`; ` apart), None if none did."""
        return self.supervisor.load_error

    @property
    def fatal_error(self) -> str | None:
        """Why no engine will ever serve, once that is known (`EngineSupervisor.fatal_error`); `das serve` stops
        with it."""
        return self.supervisor.fatal_error

    async def unrecoverable(self) -> str:
        """Returns `fatal_error` once there is one."""
        return await self.supervisor.unrecoverable()

    async def close(self) -> None:
        """Snapshots the history, stops the engines and the actors, and Ray if a backend of this process started
        it and no other backend of this process still uses it."""
        import ray

        actor_tasks = self.supervisor.stop()
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, *actor_tasks, return_exceptions=True)
        with contextlib.suppress(Exception):  # no longer wanted: the autoscaler may remove the nodes once idle
            self.supervisor.request_engines(0)
        try:
            written = await asyncio.gather(*(s.snapshot.remote(True) for s in self._shards))
            log.info("history snapshots: %s", [w for w in written if w])
        except Exception:
            log.exception("history snapshot at shutdown failed")
        await self.supervisor.close_actors()
        for handle in self._shards:
            ray.kill(handle)
        if self._uses_ray:
            self._uses_ray = False
            _RayInThisProcess.users -= 1
            if _RayInThisProcess.users == 0 and _RayInThisProcess.started_here:
                _RayInThisProcess.started_here = False
                ray.shutdown()

    # ---- RolloutBackend ----

    @property
    def policy_version(self) -> int:
        return self._policy.version

    @property
    def engine_names(self) -> list[str]:
        """Every engine, serving or not (`serving_engines` for those that serve now)."""
        return [name for _, _, name in self.supervisor.engines]

    @property
    def serving_engines(self) -> list[str]:
        return [name for _, _, name in self.supervisor.serving()]

    async def ready(self) -> bool:
        """True once the first load is done (every engine serving or failed for good) and while at least one engine
        serves."""
        return self.supervisor.loaded and bool(self.supervisor.serving())

    async def live(self) -> bool:
        """False once no engine can serve again: every actor past its restart cap or its recovery timeout, and no
        engine wanted of nodes yet to join (`target_engines`)."""
        return self.supervisor.live()

    async def check(self, groups: Sequence[GroupRequest]) -> None:
        held = self._given_up_prompts.refused(list(groups), time.monotonic())
        if held is not None:
            raise GroupInputError(*held)
        lost = lost_errors()
        for actor in self.supervisor.serving_actors():
            try:
                refused = await actor.handle.check.remote(list(groups))
            except lost:  # its watcher takes care of it; another engine checks
                continue
            if refused is not None:
                raise GroupInputError(*refused)
            return
        raise RuntimeError("no engine serves: the groups cannot be checked")

    def attach_sessions(self, book: SessionBook) -> None:
        """The gateway's session book: a session's turns go to the engine holding its prefix, and idle sessions'
        predicted remaining work counts in their engine's load (`Dispatcher.place`)."""
        self.dispatcher.attach_sessions(book)

    def place(self, groups: Sequence[GroupRequest]) -> Placement:
        """Per serving engine (in `serving_engines` order), the (batch index, group) pairs it would run, longest
        predicted first (`dispatch.with_length_predictions` tags the groups), given the work already placed
        there."""
        return self.dispatcher.place(groups, self.supervisor.serving())

    def generate(self, groups: Sequence[GroupRequest], on_progress: ProgressSink | None = None,
                 aborts: GroupAborts | None = None) -> AsyncGenerator[tuple[int, SampleResult], None]:
        return self.dispatcher.generate(groups, on_progress, aborts)

    async def history(self, problem_id: str) -> ProblemSummary | None:
        shard = self._shards[shard_of(problem_id, len(self._shards))]
        summary: ProblemSummary | None = await shard.summary.remote(problem_id)
        return summary

    def stats(self) -> BackendStats:
        return self.dispatcher.stats(self.supervisor.stats(self._stats))

    # ---- vLLM's weight transfer (rollout_backend.RolloutBackend says what each does; weight_relay.py) ----

    @property
    def weight_transfer(self) -> TransferBackend | None:
        return self.weight_relay.weight_transfer

    def transfer_world_size(self) -> int:
        return self.weight_relay.transfer_world_size()

    # ---- control (rollout_backend.RolloutBackend says what each verb does) ----

    async def control(self, message: EngineControl) -> Any:
        """The verb reaches the serving engines' actors as it is (`NodeEngine.control`), with what the service keeps
        or orders around it: a reload is what engines that load later catch up to; a history import goes to the
        history store, from which every engine pulls what it runs; a weight-transfer step goes to the trainer's
        group (`WeightRelay`); a pause is remembered until the resume."""
        if isinstance(message, ReloadWeights):
            return await self._reload(message)
        if isinstance(message, AddHistory):
            return await self._import_history(message.rollouts)
        if isinstance(message, WeightTransferStep):
            return await self.weight_relay.control(message)
        # A Pause is remembered until the Resume: an engine actor restarted meanwhile is paused alike
        # (`EngineSupervisor._catch_up`), and new work waits in the coordinator's hold.
        async with self._policy.control_lock:
            if isinstance(message, Pause):
                self._policy.paused = message
                self._hold.pause(message.mode)
            replies = await self.supervisor.on_serving(lambda node: node.control.remote(message))
            if isinstance(message, Resume):
                self._policy.paused = None
                self._hold.resume()
        return message.combine(replies)

    async def _reload(self, message: ReloadWeights) -> int:
        """Every serving engine reloads; an engine that is restarting loads these weights before it serves."""
        await self.supervisor.wait_serving()  # someone must check the path and version before they are kept
        async with self._policy.weights_lock:
            replies = await self.supervisor.on_serving(lambda node: node.control.remote(message))
            version = message.combine(replies)
            self._policy.weights = (message.checkpoint, version)
            self._policy.version = version
        return version

    async def _import_history(self, records: list[dict[str, Any]]) -> int:
        """The records go to the history store, not to the engines: each engine pulls its problems' history before
        it runs them (`NodeEngine`), and the difficulty book learns their lengths here."""
        # the checks walk every token: off the event loop, so a large import does not stall the other requests
        checked = await asyncio.to_thread(validate_rollouts, records)
        by_shard: dict[int, list[dict[str, Any]]] = {}
        for record in records:
            by_shard.setdefault(shard_of(record["problem_id"], len(self._shards)), []).append(record)
        counts = await asyncio.gather(*(self._shards[s].put.remote("import", rs) for s, rs in by_shard.items()))
        for rollout in sorted(checked, key=lambda r: r.policy_version):
            self._book.add_record(rollout)
        return int(sum(counts))

    # ---- background ----

    @staticmethod
    async def _every(seconds: float, job: Callable[[], Any]) -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                await job()
            except Exception:  # figures and snapshots are retried next time; the service goes on
                log.exception("background job %s failed", getattr(job, "__name__", job))

    async def refresh_stats(self) -> None:
        """Reads every serving node's and every shard's figures now (the background job does it every
        stats_interval_s). An actor that dies meanwhile is left out: its watcher deals with it."""
        actors = self.supervisor.serving_actors()
        replies = await asyncio.gather(*(actor.handle.stats.remote() for actor in actors), return_exceptions=True)
        lost = lost_errors()
        nodes = [r for r in replies if not isinstance(r, lost)]
        for reply in nodes:
            if isinstance(reply, BaseException):
                raise reply
        shards = await asyncio.gather(*(s.stats.remote() for s in self._shards))
        self._stats = BackendStats(
            engines=tuple(load for n in nodes for load in n.engines),
            history_problems=sum(s.problems for s in shards), history_tokens=sum(s.output_tokens for s in shards),
            history_shards=tuple(shards),
            history_outbox_records=sum(n.history_outbox_records for n in nodes),
            history_records_given_up=sum(n.history_records_given_up for n in nodes),
            resident_bytes={"history_store": sum(s.resident_bytes for s in shards),
                            "node_engine": sum(n.resident_bytes for n in nodes)})

    async def _snapshot(self) -> None:
        await asyncio.gather(*(s.snapshot.remote() for s in self._shards))

    async def snapshot(self) -> None:
        """Snapshots, now, every history shard that changed since its last snapshot (`das serve` on a signal)."""
        await self._snapshot()
