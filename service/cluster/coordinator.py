"""`RayBackend`: the coordinator of the Ray-distributed service (a `RolloutBackend` for the gateway).

Actors (Ray's own scheduling, node affinity and failure reporting; no cluster manager of ours):
- `HistoryShard` x S (service/cluster/history_store.py), on the coordinator's node: rollouts and difficulty by problem,
  snapshotted to the state directory every `history.snapshot_interval_s` and at shutdown.
- `NodeEngine` x engines (service/cluster/node_engine.py), one per engine (a GPU node's GPUs / `tensor_parallel_size`,
  `engines_per_node` on a node without), pinned to its node with a hard node-affinity strategy: every GPU node, or
  every node when the cluster has no GPU (a CPU machine; the embedded default). A node that
  joins later (a worker pod added, or replacing a lost one) gets its actors within `adopt_nodes_interval_s`.

The coordinator itself runs in the gateway's process (the Ray driver), not as an actor: it only predicts, places
and relays, and keeping it beside the gateway saves every sample one more hop. Per batch it predicts each group's
length from the difficulty records (scheduler.length; the records are loaded from the store at start and updated
from every sample that passes), places groups on engines longest-predicted first onto the least loaded engine
(scheduler.placement; a group's samples stay together so they share the drafter's live segment), starts each
engine's groups longest first, and merges the engines' streams as samples finish. An engine's load counts every
batch running at once (`_PlacedWork`): the predicted output tokens of the samples placed there that have not
arrived, so batches of one group each (a trainer that sends a request per prompt, as OpenAI-style clients do)
spread over the engines instead of all landing on the first; and a problem whose samples already run on an engine
gets its next groups there, so siblings from separate requests share the live segment too. A session's turns (groups
with a session_id, service/cluster/sessions.py) go to the engine holding the session's prefix while it serves and is not
overloaded, and idle sessions' predicted remaining work counts in their engine's load (`attach_sessions`).

Locally `RayBackend.start(config)` starts an embedded single-node cluster; with `address` it joins a running one
(`ray start --head` on the head node, `ray start --address=...` on the others, or KubeRay).

An engine that dies loses nothing (docs/design.md "Failure behaviour"). The NodeEngine actors are created with
unbounded Ray restarts and no task retries (nothing runs twice behind our back); the coordinator counts the
restarts itself, `FailureConfig.max_restarts` per `restart_window_s`, and kills an actor for good past that. A
death is noticed by the stream that breaks or by a call the coordinator keeps pending on every actor
(`NodeEngine.watch`); the engine stops serving, the coordinator calls `start()` on the restarted actor (which
reloads the model and pulls its drafter history from the store with fresh cursors) and reloads the weights last
served, then it serves again. The samples the dead engine owed that had not arrived are sent to a serving engine
(or the restarted one) as a group with n = their count, and renumbered back to the missing indices
(service/cluster/engine_failure.py `Share`), so every sample index reaches the client exactly once. Each resumes
from the tokens it had delivered (the engines report each sample's new tokens every stream interval,
`node_engine.PROGRESS_INTERVAL_S` or longer with many engines, `_stream_interval`; the coordinator keeps them per
sample and hands them to the caller's `on_progress`), so a death costs the recomputation of prompt + prefix and the
tokens of the last interval, not the sample. `ready()` while at
least one engine serves; `live()` False once no engine can ever serve again.

An engine that fails to load (at the start, after a restart, on a node that joined) is told by its error's kind
(service/cluster/load_failure.py): one no retry mends (a configuration, a package or a model directory missing on its
node, a refused vLLM release, a tensor parallel size its node cannot run) stays down at once with its cause and what
to do, in `stats().engines_failed` (/readyz) and `engine_load_failures` (/metrics, by reason), while the others
serve; any other (its process killed, out of memory) restarts it as a death does. `fatal_error` says when no engine
will ever serve: `das serve` then stops with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from das.scheduler.difficulty import DifficultyBook, DifficultyFormatError, load_difficulty
from das.scheduler.length import LengthPredictor
from das.scheduler.placement import place_groups
from das.service.cluster.engine_failure import GivenUpPrompts, RestartWindow, Share
from das.service.config import ServiceConfig
from das.service.cluster.engine_layout import LayoutError, cpu_engine_error, cpu_node, gpu_engines
from das.service.cluster.group_aborts import GroupAborts, aborted_sample
from das.service.cluster.history_store import HistoryShardActor, shard_of
from das.service.cluster.load_failure import LoadFailure, classify
from das.service.cluster.node_engine import PROGRESS_INTERVAL_S, EngineNotStarted, NodeEngine
from das.service.cluster.pause_hold import PauseHold
from das.service.cluster.rollout_backend import BackendStats, GroupInputError, ProgressSink, WeightUpdateConflict
from das.service.engine.config import transfer_backend
from das.service.engine.contract import EngineInputError, validate_rollouts
from das.service.wire.api import GroupRequest, LengthCurveSpec, ProblemSummary, SampleResult
from das.service.wire.engine_control import EngineControl, Pause, Resume
from das.service.wire.sample_progress import SampleProgress
from das.service.wire.weight_transfer import TransferBackend
from das.service.cluster.sessions import SessionBook

log = logging.getLogger(__name__)

# Passed on to the engine actors' processes, which do not inherit the driver's environment when joining a cluster.
_FORWARDED_ENV = ("VLLM_LOGGING_LEVEL", "VLLM_LOGGING_STREAM", "VLLM_PLUGINS", "DAS_DATA_DIR",
                  "VLLM_CPU_OMP_THREADS_BIND")


def _describe(exc: BaseException) -> str:
    """The first line of `exc` with its type (Ray's death messages run to many lines)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _sample_load(group: GroupRequest) -> float:
    """What one sample of a group placed by `with_length_predictions` weighs in placement: its predicted output
    tokens."""
    return float(group.predicted_tokens or 0.0)


class _PlacedWork:
    """The samples placed on the engines that have not arrived, over every batch running at once: per engine their
    predicted output tokens (what placement balances), per problem the engines they run on (so that a problem's
    groups running at once share an engine, and its drafter's live segment sees all of them). Every sample is added
    once when placed (`hold`) and removed once: when it arrives (`arrived`) or when its job ends or moves without
    it (`release`)."""

    def __init__(self) -> None:
        self.tokens: Counter[str] = Counter()
        self._problems: dict[str, Counter[str]] = {}

    def load(self, name: str) -> float:
        """Engine `name`'s predicted output tokens placed and not arrived (>= 0: the float sums may round below)."""
        return max(self.tokens[name], 0.0)

    def hold(self, name: str, work: Sequence[tuple[Share, GroupRequest]]) -> None:
        for share, group in work:
            self._add(name, group, len(share.missing()))

    def arrived(self, name: str, group: GroupRequest) -> None:
        self._add(name, group, -1)

    def release(self, name: str, work: Sequence[tuple[Share, GroupRequest]]) -> None:
        for share, group in work:
            self._add(name, group, -len(share.missing()))

    def engine_of(self, problem_id: str, index: Mapping[str, int]) -> int | None:
        """The index (`index`: engine name -> its index) of the engine running most of the problem's samples (ties:
        the lowest index), None if none of those engines runs any. Reads the engines the problem runs on (one or
        a few), not every engine: placement calls it for every group of a batch."""
        engines = self._problems.get(problem_id)
        if not engines:
            return None
        running = [(count, -index[name]) for name, count in engines.items() if count > 0 and name in index]
        return -max(running)[1] if running else None

    def _add(self, name: str, group: GroupRequest, samples: int) -> None:
        if not samples:
            return
        self.tokens[name] += samples * _sample_load(group)
        engines = self._problems.setdefault(group.problem_id, Counter())
        engines[name] += samples
        if engines[name] <= 0:
            del engines[name]
            if not engines:
                del self._problems[group.problem_id]


def with_length_predictions(predictor: LengthPredictor, groups: Sequence[GroupRequest]) -> list[GroupRequest]:
    """The groups with the scheduler's forecasts, every one with `predicted_tokens` set: a group without it gets
    its problem's predicted mean length (for placement and submission order) and, unless it brought a
    `length_curve`, the curve the draft budget reads every step. A group with `predicted_tokens` of its own keeps
    it and gets no curve, so the caller's prediction is the one the budget uses."""
    forecast = predictor.predict([g.problem_id for g in groups], np.zeros(len(groups), np.int64))
    curves = predictor.curves([g.problem_id for g in groups])
    return [g if g.predicted_tokens else
            g.model_copy(update={"predicted_tokens": float(m),
                                 "length_curve": g.length_curve or LengthCurveSpec.model_validate(c.to_dict())})
            for g, m, c in zip(groups, forecast.mean, curves)]


# The longest interval between an engine's stream items (`RayBackend._stream_interval`): a finished sample waits on its
# engine this long at most, whatever the number of engines.
_MAX_STREAM_INTERVAL_S = 5.0

# Seconds of calls refused with ActorDiedError after which an actor is taken to be dead for good.
_DEAD_FOR_GOOD_S = 30.0


class _NotRestarted(RuntimeError):
    """Ray refuses every call to an actor it will not restart (killed with no_restart, its node gone)."""


# A stream or call that raises one of these lost its engine actor (its process, or its node: Ray cannot place an
# actor pinned to a node that left), or the object holding its samples, or reached the restarted actor before its
# death was noticed: what it owed is re-dispatched. Anything else an engine raises fails the batch.
def _lost_errors() -> tuple[type[BaseException], ...]:
    import ray

    return (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError, ray.exceptions.ObjectLostError,
            EngineNotStarted)


def _engine_actors(config: ServiceConfig, node: dict[str, Any], shard_names: list[str], short_name: bool,
                   limit: int | None = None) -> list[tuple[Any, list[str]]]:
    """Creates the NodeEngine actors of one Ray node (`ray.nodes()` entry): one per engine, each holding its
    `tensor_parallel_size` GPUs (service/cluster/engine_layout.py; LayoutError where that does not divide the node's
    GPUs), or `engines_per_node` on a node without any, at most `limit` of them; each with the names of its engines.
    Engines are named by the node's address, and its id unless `short_name` (a cluster of one node)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    gpus = int(node["Resources"].get("GPU", 0))
    name = node["NodeManagerAddress"] if short_name else f"{node['NodeManagerAddress']}:{node['NodeID'][:6]}"
    engine = config.engine
    # Restarted by Ray on the same node (the hard affinity holds for every incarnation) as often as it dies: the
    # coordinator applies the cap per window. No task retries: what a dead actor owed is re-dispatched by the
    # coordinator, so nothing runs twice.
    tp = engine.tensor_parallel_size
    count = gpu_engines(gpus, tp, f"node {node['NodeManagerAddress']}") if gpus else config.engines_per_node
    count = count if limit is None else min(count, limit)
    options = ray.remote(NodeEngine).options(
        num_cpus=0, num_gpus=tp if gpus else 0, max_concurrency=1000, max_restarts=-1, max_task_retries=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False))
    per_actor = engine.engines_per_actor
    firsts = range(0, count, per_actor)
    return [(options.remote(name, engine, shard_names, min(per_actor, count - g), first_index=g,
                            history_push=config.history.push),
             [f"{name}/{g + i}" for i in range(min(per_actor, count - g))]) for g in firsts]


@dataclass(eq=False)
class _Actor:
    """One NodeEngine actor as the coordinator sees it. `incarnation` counts the deaths noticed, so the many
    streams that see one death count it once; `names`: its engines, the same after every restart."""

    handle: Any
    restarts: RestartWindow
    node_id: str = ""  # the Ray node it is pinned to
    names: list[str] = field(default_factory=list)
    state: Literal["loading", "serving", "recovering", "failed"] = "loading"
    incarnation: int = 0
    error: str | None = None  # why it failed for good
    node_left: bool = False  # failed because its node left the cluster (its batches' work moves on)
    served: bool = False  # it has loaded and served (its engines are in RayBackend._engines)
    failure: LoadFailure | None = None  # it failed for good because it cannot load (service/cluster/load_failure.py)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)  # its watcher and recovery


_Engine = tuple[_Actor, int, str]  # (actor, engine index in the actor, engine name)
# What a batch's jobs hand its stream: (group index, sample or progress), None at a job's end, or its error.
_Out = asyncio.Queue[tuple[int, SampleResult | SampleProgress] | BaseException | None]
_Placement = list[list[tuple[int, GroupRequest]]]  # per engine, (batch index, group) pairs in start order


class _RayInThisProcess:
    """Ray as the backends of one process share it: a backend joins the Ray connection an earlier one made, and Ray
    that a backend started stops when the last backend using it closes, not when the one that started it does
    (the others' actors would die with it; `das bench e2e` runs two service arms side by side)."""

    started_here = False
    users = 0


class RayBackend:
    """Use `await RayBackend.start(config)`; `await close()` at the end (snapshots the history)."""

    def __init__(self, config: ServiceConfig, shards: list[Any], shard_names: list[str],
                 actors: list[tuple[str, Any, list[str]]], gpu_nodes: bool, own_cluster: bool = False) -> None:
        self.config = config
        self._shards = shards
        self._shard_names = shard_names  # what an engine actor created later is given
        self._actors = [_Actor(handle, RestartWindow(config.failure), node_id, list(names))
                        for node_id, handle, names in actors]
        # A cluster this process started: one node, every engine on it with one configuration, and no node joins
        # later, so an engine that cannot load means none can (`fatal_error`).
        self._own_cluster = own_cluster
        self._gpu_nodes = gpu_nodes  # engines on the GPU nodes only (else on every node)
        self._refused_nodes: set[str] = set()  # joined with GPUs the engines' tensor parallel size does not divide
        self._uses_ray = True  # until close: counted in _RayInThisProcess.users
        self._engines: list[_Engine] = []  # every engine, serving or not, once the first load is done
        self._version = 0
        self._weights: tuple[str, int] | None = None  # the last reload (path, version): what a restart loads
        self._weights_lock = asyncio.Lock()  # a reload and a recovered engine's catch-up never interleave
        self._paused: Pause | None = None  # the last /pause until /resume
        # the engines in the trainer's weight-transfer group (actor, incarnation), in rank order: set by
        # /init_weight_transfer_engine; a push needs the same ones serving
        self._transfer_group: list[tuple[_Actor, int]] = []
        self._pushing = False  # a push is open: `_weights_lock` is held from its start to its end
        # every dispatch to an engine actor waits here while paused (service/cluster/pause_hold.py)
        self._hold = PauseHold()
        self._control_lock = asyncio.Lock()  # a pause or resume and a recovered engine's catch-up never interleave
        self._book = DifficultyBook()
        self._predictor = LengthPredictor(self._book)
        self._stats = BackendStats()
        self._loading: asyncio.Task[None] | None = None
        self._background: list[asyncio.Task[None]] = []
        self._closing = False
        self._changed = asyncio.Event()  # replaced at every change of an actor's state
        self._placed = _PlacedWork()
        self._restarts: Counter[str] = Counter()  # per engine
        self._load_failures: Counter[tuple[str, str]] = Counter()  # per (engine, LoadFailure.reason): failed loads
        self._recovery_s: dict[str, float] = {}  # per engine, death noticed to serving again, latest
        self._redispatched = 0
        self._given_up = 0  # samples ended with an error after max_group_deaths engine deaths
        self._stream_items = 0  # Ray objects received from engine streams (samples or progress)
        self._placement_s = 0.0  # seconds spent in _place, over `_placements` calls
        self._placements = 0
        self._given_up_prompts = GivenUpPrompts(config.failure)  # what `check` refuses for a while after that
        self._sessions: SessionBook | None = None  # the gateway's (attach_sessions): where sessions' prefixes are

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
        engine = config.engine
        for node in ray.nodes():  # before any actor exists: LayoutError for a node whose GPUs do not split
            if node["Alive"] and node["Resources"].get("GPU", 0) > 0:
                gpu_engines(int(node["Resources"]["GPU"]), engine.tensor_parallel_size,
                            f"node {node['NodeManagerAddress']}")
        own_cluster = _RayInThisProcess.started_here
        if own_cluster and engine.cpu_workers and not any(
                n["Alive"] and n["Resources"].get("GPU", 0) > 0 for n in ray.nodes()):
            # this node is the engines' node: what its CPUs cannot run is refused here, before anything loads (in a
            # cluster joined, each engine checks its own node and fails alone: `NodeEngine.start`)
            layout = cpu_engine_error(engine.cpu_workers, *cpu_node(), "this node")
            if layout is not None:
                raise layout
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

        alive = [n for n in ray.nodes() if n["Alive"]]
        gpu_nodes = [n for n in alive if n["Resources"].get("GPU", 0) > 0]
        actors: list[tuple[str, Any, list[str]]] = []
        target = config.target_engines
        for n in gpu_nodes if gpu_nodes or target is not None else alive:  # with a target: GPU nodes only
            wanted = None if target is None else target - sum(len(names) for _, _, names in actors)
            if wanted is not None and wanted <= 0:
                break
            actors += [(n["NodeID"], handle, names) for handle, names in
                       _engine_actors(config, n, shard_names, short_name=len(alive) == 1, limit=wanted)]
        backend = cls(config, shards, shard_names, actors, bool(gpu_nodes) or target is not None,
                      own_cluster=own_cluster)
        backend._request_engines(target or 0)
        _RayInThisProcess.users += 1
        await backend._load_difficulty()
        progress(f"{len(shards)} history shards, {len(actors)} engine actors; loading engines")
        backend._loading = asyncio.create_task(backend._load_engines(progress))
        backend._background = [asyncio.create_task(backend._every(config.stats_interval_s, backend.refresh_stats)),
                               asyncio.create_task(backend._every(config.history.snapshot_interval_s,
                                                                  backend._snapshot)),
                               asyncio.create_task(backend._every(config.adopt_nodes_interval_s,
                                                                  backend._adopt_nodes))]
        return backend

    async def _load_engines(self, progress: Callable[[str], None]) -> None:
        """The first load of every engine actor, at once; done when each serves or has failed for good."""
        await asyncio.gather(*(self._load(actor) for actor in self._actors))
        if self._engines:
            await self.refresh_stats()
        ready = [name for _, _, name in self._serving()]
        failed = [name for actor in self._actors if actor.state == "failed" for name in actor.names]
        progress("; ".join(([f"{len(ready)} engines ready: {', '.join(ready)}"] if ready else [])
                           + ([f"{len(failed)} failed to load: {', '.join(failed)}"] if failed else []))
                 or "no engine actor")

    async def _load(self, actor: _Actor) -> None:
        """An actor's first load (at the start, or on a node that joined): it serves once loaded and caught up (the
        weights last served, the pause in force). A load that cannot succeed fails it for good with its cause; one
        that may succeed in a fresh process restarts it, as a death does (`_load_failed`). Returns once it serves
        or has failed for good."""
        import ray

        timeout = self.config.failure.recovery_timeout_s
        try:
            async with asyncio.timeout(timeout):
                names = await actor.handle.start.remote()
                async with self._weights_lock, self._control_lock:
                    await self._catch_up(actor)
                    self._add_engines(actor, names)
                    self._serve(actor)
        except TimeoutError:
            self._fail(actor, f"engine {', '.join(actor.names)} did not load within {timeout:g} s "
                              f"(FailureConfig.recovery_timeout_s); it stays down")
            with contextlib.suppress(Exception):
                ray.kill(actor.handle, no_restart=True)
        except ray.exceptions.ActorUnschedulableError as exc:  # pinned to a node that left
            actor.node_left = True
            self._fail(actor, f"engine {', '.join(actor.names)} lost its node while loading: {_describe(exc)}")
        except Exception as exc:
            recovery = self._load_failed(actor, exc)
            if recovery is not None:
                await recovery

    def _add_engines(self, actor: _Actor, names: Sequence[str]) -> None:
        """Its engines join the service's list at the actor's first successful load."""
        actor.names = list(names)
        if not actor.served:
            self._engines.extend((actor, i, name) for i, name in enumerate(actor.names))

    def _load_failed(self, actor: _Actor, exc: BaseException) -> Coroutine[Any, Any, None] | None:
        """A load of `actor` failed with `exc` (service/cluster/load_failure.py says which kind): counted per engine
        and reason. One that no retry mends fails the actor for good at once, with its cause and remedy; any other
        restarts it as a death does, under the restart cap, and its recovery is returned for the caller to await."""
        import ray

        failure = classify(exc)
        names = ", ".join(actor.names)
        for name in actor.names:
            self._load_failures[(name, failure.reason)] += 1
        cap = self.config.failure
        if failure.permanent:
            actor.failure = failure
            self._fail(actor, f"engine {names} cannot load: {failure.describe()}")
        elif not actor.restarts.allow(time.monotonic()):
            self._fail(actor, f"engine {names} failed to load again after {cap.max_restarts} restart(s) within "
                              f"{cap.restart_window_s:g} s (the restart cap, FailureConfig.max_restarts); it stays "
                              f"down: {failure.cause}")
        else:
            actor.state = "recovering"
            for name in actor.names:
                self._restarts[name] += 1
            log.warning("engine %s failed to load (%s); restarting it", names, failure.cause)
            if isinstance(exc, ray.exceptions.RayTaskError):  # its process lives on: a fresh one loads
                with contextlib.suppress(Exception):
                    ray.kill(actor.handle, no_restart=False)
            self._notify()
            return self._recover(actor, time.monotonic())
        with contextlib.suppress(Exception):
            ray.kill(actor.handle, no_restart=True)
        return None

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
        if self._loading is not None:
            await asyncio.shield(self._loading)
        if self.load_error is not None:
            raise RuntimeError(f"an engine failed to load: {self.load_error}")

    @property
    def load_error(self) -> str | None:
        """Why the engines that failed for good without ever serving did (`; ` apart), None if none did."""
        errors = [actor.error for actor in self._actors if actor.state == "failed" and not actor.served]
        return "; ".join(dict.fromkeys(str(e) for e in errors)) or None

    @property
    def fatal_error(self) -> str | None:
        """Why no engine will ever serve, once that is known: in a cluster this process started (every engine on
        this node, with one configuration) the first engine that cannot load (service/cluster/load_failure.py); in
        any cluster, every engine failed for good without ever serving. None while an engine serves, or may (one
        that served and then failed past its restart cap leaves /healthz failing, as before). `das serve` stops
        with it."""
        if self._own_cluster:
            for actor in self._actors:
                if actor.failure is not None and not actor.served:
                    return actor.error
        if self._actors and all(actor.state == "failed" and not actor.served for actor in self._actors):
            return self.load_error
        return None

    async def unrecoverable(self) -> str:
        """Returns `fatal_error` once there is one."""
        while (error := self.fatal_error) is None:
            await self._changed.wait()
        return error

    async def close(self) -> None:
        """Snapshots the history, stops the engines and the actors, and Ray if a backend of this process started
        it and no other backend of this process still uses it."""
        import ray

        self._closing = True
        actor_tasks = [task for actor in self._actors for task in actor.tasks]
        for task in (*self._background, *actor_tasks, *([self._loading] if self._loading else [])):
            task.cancel()
        await asyncio.gather(*self._background, *actor_tasks, return_exceptions=True)
        with contextlib.suppress(Exception):  # no longer wanted: the autoscaler may remove the nodes once idle
            self._request_engines(0)
        try:
            written = await asyncio.gather(*(s.snapshot.remote(True) for s in self._shards))
            log.info("history snapshots: %s", [w for w in written if w])
        except Exception:
            log.exception("history snapshot at shutdown failed")
        # Not those restarting: a call would wait for their model to load.
        await asyncio.gather(*(actor.handle.close.remote() for actor in self._actors
                               if actor.state in ("loading", "serving")), return_exceptions=True)
        for handle in (*(actor.handle for actor in self._actors), *self._shards):
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
        return self._version

    @property
    def engine_names(self) -> list[str]:
        """Every engine, serving or not (`serving_engines` for those that serve now)."""
        return [name for _, _, name in self._engines]

    @property
    def serving_engines(self) -> list[str]:
        return [name for _, _, name in self._serving()]

    async def ready(self) -> bool:
        """True once the first load is done (every engine serving or failed for good) and while at least one engine
        serves."""
        return self._loading is not None and self._loading.done() and bool(self._serving())

    async def live(self) -> bool:
        """False once no engine can serve again: every actor past its restart cap or its recovery timeout, and no
        engine wanted of nodes yet to join (`target_engines`)."""
        return self._awaiting_nodes() or not all(actor.state == "failed" for actor in self._actors)

    def _awaiting_nodes(self) -> bool:
        """Engines are wanted (`target_engines`) that no node has room for yet: an autoscaler may add one."""
        target = self.config.target_engines
        return target is not None and self._engines_kept() < target

    async def check(self, groups: Sequence[GroupRequest]) -> None:
        held = self._given_up_prompts.refused(list(groups), time.monotonic())
        if held is not None:
            raise GroupInputError(*held)
        lost = _lost_errors()
        for actor in dict.fromkeys(actor for actor, _, _ in self._serving()):
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
        predicted remaining work counts in their engine's load (`_place`)."""
        self._sessions = book

    def place(self, groups: Sequence[GroupRequest]) -> _Placement:
        """Per serving engine (in `serving_engines` order), the (batch index, group) pairs it would run, longest
        predicted first (`with_length_predictions` tags the groups), given the work already placed there."""
        return self._place(groups, self._serving())

    def _place(self, groups: Sequence[GroupRequest], serving: Sequence[_Engine]) -> _Placement:
        """A session's turn goes to the engine holding its prefix while that one serves and is not overloaded
        (SessionBook.engine_for; each session is its own unit, so a problem's trajectories spread); a problem's
        other groups go where its samples already run, if they run on a serving engine; the rest, a problem's groups
        of this batch together, by LPT from the engines' placed loads plus the idle sessions' reserved work. Timed
        into `placement_s`."""
        started = time.perf_counter()
        try:
            return self._place_timed(groups, serving)
        finally:
            self._placement_s += time.perf_counter() - started
            self._placements += 1

    def _place_timed(self, groups: Sequence[GroupRequest], serving: Sequence[_Engine]) -> _Placement:
        tagged = with_length_predictions(self._predictor, groups)
        if self._sessions is not None:
            # A turn tagged here plans its drafts with its trajectory's remaining tokens (one tagged before, e.g.
            # re-run after its engine died, has its curve already; one with the caller's prediction keeps it).
            book = self._sessions
            tagged = [t if t.session_id is None or g.predicted_tokens else t.model_copy(update={
                "length_curve": book.trajectory_curve(t.session_id, t.length_curve, _sample_load(t))})
                for g, t in zip(groups, tagged)]
        names = [name for _, _, name in serving]
        index = {name: i for i, name in enumerate(names)}
        loads = np.array([g.n * _sample_load(g) for g in tagged])
        existing = np.array([self._placed.load(name) for name in names], dtype=np.float64)
        if self._sessions is not None:
            reserved = self._sessions.reserved()
            existing += np.array([reserved[name] for name in names], dtype=np.float64)
        assignment = np.empty(len(tagged), np.int64)
        units: dict[tuple[str, str], list[int]] = {}  # ("problem" or "session", id) -> its groups placed by LPT
        for i, group in enumerate(tagged):
            if group.session_id is not None and self._sessions is not None:
                engine = self._sessions.engine_for(group.session_id, names, existing.tolist())
                unit = ("session", group.session_id)
            else:
                engine = self._placed.engine_of(group.problem_id, index)
                unit = ("problem", group.problem_id)
            if engine is None:
                units.setdefault(unit, []).append(i)
            else:
                assignment[i] = engine
                existing[engine] += loads[i]
        members = list(units.values())
        if members:
            placement = place_groups([loads[m].sum() for m in members], len(names), existing_loads=existing)
            for unit_groups, engine in zip(members, placement.assignment.tolist()):
                assignment[unit_groups] = engine
        if self._sessions is not None:
            for i, group in enumerate(tagged):
                if group.session_id is not None:
                    self._sessions.placed(group.session_id, names[int(assignment[i])])
        # inside an engine, longest predicted first (ties in batch order)
        per_engine: _Placement = [[] for _ in names]
        for i in np.argsort(-loads, kind="stable").tolist():
            per_engine[int(assignment[i])].append((i, tagged[i]))
        return per_engine

    async def generate(self, groups: Sequence[GroupRequest], on_progress: ProgressSink | None = None,
                       aborts: GroupAborts | None = None) -> AsyncGenerator[tuple[int, SampleResult], None]:
        aborts = aborts or GroupAborts()
        serving = self._serving() or [await self._wait_serving()]
        placed = [(engine, [(Share(i, tuple(range(g.n))), g) for i, g in items])
                  for engine, items in zip(serving, self._place(groups, serving)) if items]
        # Held now, before anything awaits: a batch placed at the same moment sees this one's work.
        for engine, work in placed:
            self._placed.hold(engine[2], work)
        # Each job puts (group index, sample or progress) pairs, then None at its end, or the exception that ended it.
        out: _Out = asyncio.Queue()
        jobs = [asyncio.create_task(self._job(engine, work, out, aborts)) for engine, work in placed]
        try:
            running = len(jobs)
            while running:
                item = await out.get()
                if item is None:
                    running -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                index, sample = item
                if isinstance(sample, SampleProgress):
                    if on_progress is not None:
                        on_progress(index, sample)
                    continue
                if sample.finish_reason in ("stop", "length"):
                    self._book.history(sample.problem_id).add_length(sample.policy_version, len(sample.token_ids),
                                                                     sample.finish_reason)
                yield index, sample
        finally:
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)

    async def _job(self, engine: _Engine, work: list[tuple[Share, GroupRequest]],
                   out: _Out, aborts: GroupAborts) -> None:
        """Runs `work` on `engine` (`_run`), putting its samples on `out` as they arrive, renumbered as the batch's.
        Ends with None on `out`, or the exception that failed the batch. The caller has put `work` in `_placed` on
        `engine`."""
        try:
            await self._run(engine, work, out, aborts)
            out.put_nowait(None)
        except Exception as exc:  # handed to the batch, which owns the error
            out.put_nowait(exc)

    async def _run(self, engine: _Engine, work: list[tuple[Share, GroupRequest]],
                   out: _Out, aborts: GroupAborts) -> None:
        """Runs `work` (held in `_placed` on `engine`) there; the samples go to `out` as they arrive and leave the
        ledger, and what never arrived leaves it when this ends. When the engine dies, what had not arrived runs
        again (`_run_again`). A group aborted through `aborts` is aborted on the engine alone (NodeEngine.abort_group),
        or not sent at all if it was aborted before. Returns once every sample of `work` has reached `out`."""
        import ray

        actor, local, name = engine
        incarnation = actor.incarnation
        rest: list[tuple[Share, GroupRequest]] | None = None  # what a death left owed
        run_id = uuid.uuid4().hex

        def abort_group(group_index: int) -> None:
            indices = [k for k, (share, _) in enumerate(work) if share.group_index == group_index]
            if indices:
                actor.handle.abort_group.remote(run_id, indices)

        with aborts.listening(abort_group):
            try:
                await self._hold.wait()  # first dispatches and re-dispatches alike reach engines that have resumed
                self._end_aborted(name, [item for item in work if aborts.aborted(item[0].group_index)], out)
                if all(not share.missing() for share, _ in work):
                    return
                interval = self._stream_interval()
                generator = actor.handle.run.remote(local, [(k, share.request(group))
                                                            for k, (share, group) in enumerate(work)
                                                            if share.missing()], progress_interval_s=interval,
                                                    item_interval_s=interval, run_id=run_id)
                try:
                    async for ref in generator:
                        self._stream_items += 1
                        for k, sample in await ref:
                            if isinstance(sample, SampleProgress):
                                report = work[k][0].progress(sample)
                                if report is not None:
                                    out.put_nowait((work[k][0].group_index, report))
                                continue
                            taken = work[k][0].take(sample)
                            if taken is not None:
                                taken.predicted_tokens = work[k][1].predicted_tokens
                                self._placed.arrived(name, work[k][1])
                                out.put_nowait((work[k][0].group_index, taken))
                except _lost_errors() as exc:
                    self._engine_died(actor, incarnation, exc)
                    if actor.state == "failed" and not actor.node_left:  # past its restart cap: its batches fail
                        raise RuntimeError(actor.error) from None
                    rest = [(share, group) for owed, group in work if (share := owed.remainder()) is not None]
                finally:
                    with contextlib.suppress(Exception):
                        ray.cancel(generator)
                missing = sum(len(share.missing()) for share, _ in work)
                if rest is None and missing:
                    raise RuntimeError(f"engine {name} ended its stream with {missing} samples missing")
            finally:
                self._placed.release(name, work)
        if rest is not None:
            await self._run_again(name, rest, out, aborts)

    async def _run_again(self, dead: str, work: list[tuple[Share, GroupRequest]],
                         out: _Out, aborts: GroupAborts) -> None:
        """Runs the shares that engine `dead` owed. A share that has run through `max_group_deaths` deaths is
        given up (`_give_up`). One whose next death would give it up runs alone, one share after another, so that a
        group that only ran beside the one that kills engines is not given up with it; the rest are placed again over
        the serving engines (`_place`, as a batch is) and run at once."""
        limit = self.config.failure.max_group_deaths
        alone = [item for item in work if item[0].deaths == limit - 1]
        together = [item for item in work if item[0].deaths < limit - 1]
        self._give_up([item for item in work if item[0].deaths >= limit], out)
        count = sum(len(share.indices) for share, _ in alone + together)
        self._redispatched += count
        if count:
            log.warning("engine %s died; %d of its samples in this batch are run again elsewhere%s", dead, count,
                        f" ({len(alone)} group(s) alone, one after another)" if alone else "")
        runs = []
        if together:
            serving = self._serving() or [await self._wait_serving()]
            placement = self._place([share.request(group) for share, group in together], serving)
            for engine, items in zip(serving, placement):
                part = [together[i] for i, _ in items]
                if part:
                    self._placed.hold(engine[2], part)
                    runs.append(self._run(engine, part, out, aborts))
        if alone:
            runs.append(self._one_at_a_time(alone, out, aborts))
        tasks = [asyncio.create_task(run) for run in runs]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()

    async def _one_at_a_time(self, work: list[tuple[Share, GroupRequest]],
                             out: _Out, aborts: GroupAborts) -> None:
        """Runs the shares one after another, each on the serving engine with the least work placed at its turn."""
        for item in work:
            engine = await self._wait_serving()
            self._placed.hold(engine[2], [item])
            await self._run(engine, [item], out, aborts)

    def _end_aborted(self, name: str, work: list[tuple[Share, GroupRequest]], out: _Out) -> None:
        """Ends the shares' missing samples (held in `_placed` on engine `name`) with finish_reason "abort": their
        group was aborted alone before they were sent (again) to an engine."""
        for share, group in work:
            for index in share.missing():
                share.received.add(index)
                self._placed.arrived(name, group)
                out.put_nowait((share.group_index, aborted_sample(group, index, self._version)))

    def _give_up(self, work: list[tuple[Share, GroupRequest]],
                 out: _Out) -> None:
        """Ends the shares' missing samples with finish_reason "error": their group ran through
        `max_group_deaths` engine deaths, the last one alone on its engine."""
        for share, group in work:
            error = (f"not run again: the samples of group {share.group_index} (problem {group.problem_id!r}) were "
                     f"running on an engine each of the {share.deaths} times one died"
                     f"{', the last time alone' if share.deaths > 1 else ''} (FailureConfig.max_group_deaths, "
                     f"das serve --max-group-deaths): the prompt may crash the engine")
            log.error("%s; %d sample(s) end with this error", error, len(share.indices))
            self._given_up += len(share.indices)
            self._given_up_prompts.add(group, time.monotonic())
            for index in share.indices:
                out.put_nowait((share.group_index, SampleResult(
                    problem_id=group.problem_id, sample_index=index, token_ids=[], logprobs=[],
                    finish_reason="error", policy_version=self._version, error=error)))

    async def reload_weights(self, path: str | os.PathLike[str], version: int) -> int:
        """Reloads every serving engine; an engine that is restarting loads these weights before it serves."""
        await self._wait_serving()  # someone must check the path and version before they are kept for restarts
        async with self._weights_lock:
            await self._on_serving(lambda node: node.reload_weights.remote(str(path), version))
            self._weights = (str(path), version)
            self._version = version
        return self._version

    async def add_history(self, records: list[dict[str, Any]]) -> int:
        # the checks walk every token: off the event loop, so a large import does not stall the other requests
        checked = await asyncio.to_thread(validate_rollouts, records)
        by_shard: dict[int, list[dict[str, Any]]] = {}
        for record in records:
            by_shard.setdefault(shard_of(record["problem_id"], len(self._shards)), []).append(record)
        counts = await asyncio.gather(*(self._shards[s].put.remote("import", rs) for s, rs in by_shard.items()))
        for rollout in sorted(checked, key=lambda r: r.policy_version):
            self._book.add_record(rollout)
        return int(sum(counts))

    async def history(self, problem_id: str) -> ProblemSummary | None:
        shard = self._shards[shard_of(problem_id, len(self._shards))]
        summary: ProblemSummary | None = await shard.summary.remote(problem_id)
        return summary

    def stats(self) -> BackendStats:
        return replace(self._stats, engines_ready=len(self._serving()), engine_restarts=dict(self._restarts),
                       samples_redispatched=self._redispatched, samples_given_up=self._given_up,
                       engine_recovery_s=dict(self._recovery_s),
                       engine_placed_tokens={name: self._placed.load(name) for name in self.engine_names},
                       engine_load_failures=dict(self._load_failures), engine_stream_items=self._stream_items,
                       placement_s=self._placement_s, placements=self._placements,
                       engines_failed={name: str(actor.error) for actor in self._actors if actor.state == "failed"
                                       for name in actor.names})

    # ---- vLLM's weight transfer (rollout_backend.RolloutBackend says what each does) ----

    @property
    def weight_transfer(self) -> TransferBackend | None:
        return transfer_backend(self.config.engine.weight_transfer, gpu=self._gpu_nodes)

    def transfer_world_size(self) -> int:
        engine = self.config.engine
        return len(self._serving()) * engine.tensor_parallel_size

    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """Every serving engine joins the trainer's group: engine e's workers at the trainer's `rank_offset` + the
        workers of the engines before it. Refused (EngineInputError) unless `world_size` is that offset + every
        serving worker: a group of another size would wait for ranks that never come."""
        if self._pushing:
            raise WeightUpdateConflict("a weight update is open: finish it before joining a new group")
        serving = self._serving()
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
        infos: dict[int, list[dict[str, Any]]] = {}
        actors: dict[int, _Actor] = {}
        for position, (actor, _, _) in enumerate(serving):
            actors[id(actor)] = actor
            infos.setdefault(id(actor), []).append({**init_info, "rank_offset": offset + position * tp})
        self._transfer_group = []
        group = [(actor, actor.incarnation) for actor in actors.values()]
        await self._on_actors(group, lambda actor: actor.handle.init_weight_transfer.remote(infos[id(actor)]))
        self._transfer_group = group

    async def start_weight_update(self) -> None:
        """Opens a push on every engine of the group (each waits for its running samples unless paused). Held
        against checkpoint reloads and restarted engines' catch-up until it ends (`_weights_lock`)."""
        changed = self._group_changes()
        if changed:
            raise WeightUpdateConflict(f"the engines changed since /init_weight_transfer_engine ({changed}): "
                                       f"join the group again")
        await self._weights_lock.acquire()
        self._pushing = True
        try:
            await self._on_actors(self._transfer_group, lambda actor: actor.handle.start_weight_update.remote())
        except BaseException:
            await self.abort_weight_update()
            raise

    async def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Every engine of the group receives one chunk (staged); a failure anywhere gives the push up
        everywhere."""
        if not self._pushing:
            raise WeightUpdateConflict("no weight update is open: call /start_weight_update first")
        try:
            await self._on_actors(self._transfer_group, lambda actor: actor.handle.update_weights.remote(update_info))
        except BaseException:
            await self.abort_weight_update()
            raise

    async def finish_weight_update(self, version: int) -> int:
        """Every engine of the group loads what it received and serves it as `version`; the push ends."""
        if not self._pushing:
            raise WeightUpdateConflict("no weight update is open: call /start_weight_update first")
        try:
            await self._on_actors(self._transfer_group,
                                  lambda actor: actor.handle.finish_weight_update.remote(version))
        except BaseException:
            await self.abort_weight_update()
            raise
        self._version = version
        self._pushing = False
        self._weights_lock.release()
        return version

    async def abort_weight_update(self) -> None:
        """Gives the open push up on every engine of the group (nothing loaded by the gloo backend); idempotent."""
        if not self._pushing:
            return
        try:
            await self._on_actors([(a, i) for a, i in self._transfer_group if a.state == "serving"],
                                  lambda actor: actor.handle.abort_weight_update.remote())
        finally:
            self._pushing = False
            self._weights_lock.release()

    async def shutdown_weight_transfer(self) -> None:
        await self.abort_weight_update()
        group, self._transfer_group = self._transfer_group, []
        await self._on_actors([(a, i) for a, i in group if a.state == "serving"],
                              lambda actor: actor.handle.shutdown_weight_transfer.remote())

    def _group_changes(self) -> str:
        """How the serving engines differ from the transfer group's ('' if they do not)."""
        if not self._transfer_group:
            return "no group: call /init_weight_transfer_engine first"
        members = {id(actor): incarnation for actor, incarnation in self._transfer_group}
        serving = list(dict.fromkeys(actor for actor, _, _ in self._serving()))
        gone = [actor for actor, incarnation in self._transfer_group
                if actor.state != "serving" or actor.incarnation != incarnation]
        new = [actor for actor in serving if id(actor) not in members]
        return "; ".join([*(f"engine {', '.join(a.names)} restarted or stopped serving" for a in gone),
                          *(f"engine {', '.join(a.names)} joined" for a in new)])

    async def _on_actors(self, actors: list[tuple[_Actor, int]], call: Callable[[_Actor], Any]) -> list[Any]:
        """`call(actor)` on each of `actors` at once; their replies. A lost actor is reported as a death and raised
        as a RuntimeError naming it; any other error is raised as it is (the first one)."""
        replies = await asyncio.gather(*(call(actor) for actor, _ in actors), return_exceptions=True)
        lost = _lost_errors()
        errors: list[BaseException] = []
        for (actor, incarnation), reply in zip(actors, replies):
            if isinstance(reply, lost):
                self._engine_died(actor, incarnation, reply)
                errors.append(RuntimeError(f"engine {', '.join(actor.names)} died during the weight transfer"))
            elif isinstance(reply, BaseException):
                errors.append(reply)
        if errors:  # a refusal says more than the broken group it leaves the others with
            raise next((e for e in errors if isinstance(e, EngineInputError)), errors[0])
        return list(replies)

    # ---- vLLM's RL control plane (rollout_backend.RolloutBackend says what each does) ----

    async def control(self, message: EngineControl) -> Any:
        # A Pause is remembered until the Resume: an engine actor restarted meanwhile is paused alike
        # (`_catch_up`), and new work waits in the coordinator's hold.
        async with self._control_lock:
            if isinstance(message, Pause):
                self._paused = message
                self._hold.pause()
            replies = await self._on_serving(lambda node: node.control.remote(message))
            if isinstance(message, Resume):
                self._paused = None
                self._hold.release()
        return message.combine(replies)

    async def _on_serving(self, call: Callable[[Any], Any]) -> list[Any]:
        """`call(actor handle)` on every serving NodeEngine at once; their replies. An actor lost meanwhile is
        left to its watcher (its restart catches up on the weights and the pause); any other error is raised."""
        actors = list(dict.fromkeys(actor for actor, _, _ in self._serving()))
        incarnations = [actor.incarnation for actor in actors]
        replies = await asyncio.gather(*(call(actor.handle) for actor in actors), return_exceptions=True)
        lost = _lost_errors()
        for actor, incarnation, reply in zip(actors, incarnations, replies):
            if isinstance(reply, lost):
                self._engine_died(actor, incarnation, reply)
            elif isinstance(reply, BaseException):
                raise reply
        return [reply for reply in replies if not isinstance(reply, BaseException)]

    # ---- engine failures ----

    def _serving(self) -> list[_Engine]:
        return [engine for engine in self._engines if engine[0].state == "serving"]

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_serving(self) -> _Engine:
        """The serving engine with the least predicted work outstanding, once one serves. RuntimeError once none
        ever will."""
        while True:
            serving = self._serving()
            if serving:
                return min(serving, key=lambda engine: self._placed.load(engine[2]))
            if all(actor.state == "failed" for actor in self._actors) and not self._awaiting_nodes():
                raise RuntimeError("no engine can serve: " + "; ".join(str(a.error) for a in self._actors))
            await self._changed.wait()

    def _spawn(self, actor: _Actor, job: Any) -> None:
        task = asyncio.create_task(job)
        actor.tasks.add(task)
        task.add_done_callback(actor.tasks.discard)

    def _serve(self, actor: _Actor) -> None:
        """Marks `actor` serving and keeps a call pending on it, so its death is noticed at once even when idle."""
        actor.state = "serving"
        actor.served = True
        self._spawn(actor, self._watch(actor, actor.incarnation))
        self._notify()

    async def _watch(self, actor: _Actor, incarnation: int) -> None:
        try:
            await actor.handle.watch.remote()
        except _lost_errors() as exc:
            self._engine_died(actor, incarnation, exc)

    def _engine_died(self, actor: _Actor, incarnation: int, exc: BaseException) -> None:
        """`actor` (as of `incarnation`) was seen dead: it stops serving, and is restarted unless its cap is spent.
        Idempotent per incarnation: every stream that breaks on one death calls it."""
        if self._closing or actor.incarnation != incarnation or actor.state != "serving":
            return
        import ray

        actor.incarnation += 1
        names = ", ".join(actor.names)
        failure = self.config.failure
        if isinstance(exc, ray.exceptions.ActorUnschedulableError):  # pinned to a node that left: no restart
            actor.node_left = True
            self._fail(actor, f"engine {names} lost its node, which left the Ray cluster; it stays down (a node that "
                              f"joins gets engines of its own): {_describe(exc)}")
        elif actor.restarts.allow(time.monotonic()):
            actor.state = "recovering"
            for name in actor.names:
                self._restarts[name] += 1
            log.warning("engine %s died (%s); restarting it", names, _describe(exc))
            self._spawn(actor, self._recover(actor, time.monotonic()))
        else:
            self._fail(actor, f"engine {names} died again after {failure.max_restarts} restart(s) within "
                              f"{failure.restart_window_s:g} s (the restart cap, FailureConfig.max_restarts); it "
                              f"stays down and the batches running on it fail: {_describe(exc)}")
            with contextlib.suppress(Exception):
                ray.kill(actor.handle, no_restart=True)
        self._notify()

    def _fail(self, actor: _Actor, error: str) -> None:
        actor.state, actor.error = "failed", error
        log.error("%s", error)
        self._notify()

    async def _recover(self, actor: _Actor, died: float) -> None:
        """Waits for Ray to restart `actor`, loads its engines and the weights last served; then it serves."""
        import ray

        timeout = self.config.failure.recovery_timeout_s
        refused_since: float | None = None  # the first of an unbroken run of ActorDiedError answers
        try:
            async with asyncio.timeout(timeout):
                while True:
                    try:
                        names = await actor.handle.start.remote()
                        async with self._weights_lock, self._control_lock:
                            await self._catch_up(actor)
                            self._add_engines(actor, names)  # an actor whose first load had failed
                            elapsed = time.monotonic() - died
                            for name in actor.names:
                                self._recovery_s[name] = elapsed
                            log.warning("engine %s serves again after %.1f s", ", ".join(actor.names), elapsed)
                            self._serve(actor)
                            return
                    except ray.exceptions.ActorDiedError as exc:
                        # A restarting actor holds calls until it is back; one Ray will not restart (killed with
                        # no_restart, its node gone) refuses every call at once. A refusal or two right after the
                        # death comes from calls sent before the driver learned of it.
                        now = time.monotonic()
                        refused_since = refused_since if refused_since is not None else now
                        if now - refused_since > _DEAD_FOR_GOOD_S:
                            raise _NotRestarted(f"Ray does not restart it ({_describe(exc)})") from None
                        await asyncio.sleep(0.5)
                    except ray.exceptions.RayActorError:  # unavailable for now, or died while loading: try again
                        refused_since = None
                        await asyncio.sleep(0.5)
        except TimeoutError:
            self._fail(actor, f"engine {', '.join(actor.names)} did not come back within {timeout:g} s "
                              f"(FailureConfig.recovery_timeout_s); it stays down")
            with contextlib.suppress(Exception):
                ray.kill(actor.handle, no_restart=True)
        except _NotRestarted as exc:
            self._fail(actor, f"engine {', '.join(actor.names)} failed to restart: {exc}")
            with contextlib.suppress(Exception):
                ray.kill(actor.handle, no_restart=True)
        except Exception as exc:  # its load failed (NodeEngine.start), or catching up did
            recovery = self._load_failed(actor, exc)
            if recovery is not None:
                await recovery

    async def _catch_up(self, actor: _Actor) -> None:
        """Brings a loaded actor to the others' state: the weights last served, the pause in force. Called under
        `_weights_lock` and `_control_lock`."""
        # An actor that only seemed dead (unreachable for a moment) kept its weights.
        if self._weights is not None and await actor.handle.policy_version.remote() != self._weights[1]:
            await actor.handle.reload_weights.remote(*self._weights)
        checkpointed = self._weights[1] if self._weights is not None else 0
        if self._version > checkpointed:  # pushed weights live in the engines only (docs/design.md "Not done yet")
            log.warning("engine %s serves policy version %d (its last checkpoint), not the pushed %d, until the "
                        "trainer pushes again (the push after a restart re-forms the group with it)",
                        ", ".join(actor.names), checkpointed, self._version)
        if self._paused is not None:  # it holds new work until /resume, as the others do
            await actor.handle.control.remote(self._paused)

    async def _adopt_nodes(self) -> None:
        """Gives engine actors to the nodes that joined after the start (a worker pod replaced, which Ray sees as a
        new node, or added): every live node of the kind that runs engines and has none. They load in the
        background and serve once loaded and caught up. Nothing while the first load runs."""
        import ray

        if self._loading is None or not self._loading.done() or self._closing:
            return
        every = await asyncio.to_thread(ray.nodes)
        self._forget_departed({n["NodeID"] for n in every if n["Alive"]})
        known = {actor.node_id for actor in self._actors}
        nodes = [n for n in every if n["Alive"] and n["NodeID"] not in known
                 and (not self._gpu_nodes or n["Resources"].get("GPU", 0) > 0)]
        target = self.config.target_engines
        for node in nodes:
            if node["NodeID"] in self._refused_nodes:
                continue
            wanted = None if target is None else target - self._engines_kept()
            if wanted is not None and wanted <= 0:  # a node beyond the target stays idle: an autoscaler removes it
                break
            try:
                handles = _engine_actors(self.config, node, self._shard_names, short_name=False, limit=wanted)
            except LayoutError as exc:  # said once; the engines already serving go on
                self._refused_nodes.add(node["NodeID"])
                log.error("node %s joined but runs no engine: %s", node["NodeManagerAddress"], exc)
                continue
            log.warning("node %s joined: starting %d engine actor(s) there", node["NodeManagerAddress"], len(handles))
            for handle, names in handles:
                actor = _Actor(handle, RestartWindow(self.config.failure), node["NodeID"], names)
                self._actors.append(actor)
                self._spawn(actor, self._join(actor))

    async def _join(self, actor: _Actor) -> None:
        """Loads an actor created after the start (`_load`: one that cannot load fails alone, with its cause; the
        engines already serving go on)."""
        await self._load(actor)
        if actor.state == "serving":
            log.warning("engine %s joined and serves", ", ".join(actor.names))

    def _stream_interval(self) -> float:
        """Seconds between an engine's stream items (finished samples and progress travel together): 50 ms, longer
        once the engines together would send more than `stream_items_per_s`, at most 5 s. A finished sample waits
        up to this long on its engine (not the last ones of its engine's run), and a death loses up to this long of
        a sample's tokens."""
        return min(_MAX_STREAM_INTERVAL_S,
                   max(PROGRESS_INTERVAL_S, len(self._engines) / self.config.stream_items_per_s))

    def _engines_kept(self) -> int:
        """Engines of the actors that have not failed for good (loading, serving or recovering)."""
        return sum(len(actor.names) for actor in self._actors if actor.state != "failed")

    def _request_engines(self, engines: int) -> None:
        """Asks Ray's autoscaler for room for `engines` engines on GPU nodes, in place of the last request (0: no
        request). A request is a floor on the cluster's resources, not a claim on them: the engines that run
        satisfy it, and nodes beyond it that nothing uses are idle (docs/design.md "Autoscaling")."""
        if self.config.target_engines is None:
            return
        from ray.autoscaler.sdk import request_resources

        engine = self.config.engine
        request_resources(bundles=[{"GPU": float(engine.tensor_parallel_size)}] * engines)

    def _forget_departed(self, alive: set[str]) -> None:
        """Drops the actors pinned to nodes that left the cluster and will not serve again (failed, or waiting for a
        restart Ray cannot place): their engines leave the service's list and every figure, so a node an
        autoscaler removed, or a replaced pod, is not shown as a failed engine. One still serving is left to its
        watcher, which sees it die first."""
        gone = [actor for actor in self._actors if actor.node_id and actor.node_id not in alive
                and actor.state in ("failed", "recovering")]
        for actor in gone:
            log.warning("engine %s left with its node", ", ".join(actor.names))
            for task in actor.tasks:
                task.cancel()
            self._actors.remove(actor)
            self._engines = [engine for engine in self._engines if engine[0] is not actor]
            for name in actor.names:
                self._restarts.pop(name, None)
                self._recovery_s.pop(name, None)
            for key in [key for key in self._load_failures if key[0] in actor.names]:
                del self._load_failures[key]
        if gone:
            self._notify()

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
        actors = list(dict.fromkeys(actor for actor, _, _ in self._serving()))
        replies = await asyncio.gather(*(actor.handle.stats.remote() for actor in actors), return_exceptions=True)
        lost = _lost_errors()
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

