"""`EngineSupervisor`: the NodeEngine actors of the Ray service, from their creation to their end (the coordinator,
service/cluster/coordinator.py `RayBackend`, composes it with dispatch).

It owns the actor records (`ActorRecord`), the list of engines (`EngineRef`, in the order of their first load) and
the notification of every change of an actor's state; dispatch and the weight relay read those and report the deaths
they see (`engine_died`), nothing else changes them.

- Starting: one actor per engine (a GPU node's GPUs / `tensor_parallel_size`, `engines_per_node` on a node without),
  pinned to its node with a hard node-affinity strategy: every GPU node, or every node when the cluster has no GPU.
  An engine serves once loaded and caught up (`ServedPolicy`: the weights last served, the pause in force).
- Failure (docs/design.md "Failure behaviour"): the actors have unbounded Ray restarts and no task retries; the
  supervisor counts the restarts, `FailureConfig.max_restarts` per `restart_window_s`, and kills an actor for good
  past that. A death is noticed by whoever sees it (a stream, a call, or the call kept pending on every actor,
  `NodeEngine.watch`) and counted once per incarnation; the engine stops serving, and its restarted actor is loaded
  and caught up before it serves again.
- A load that fails is told by its error's kind (service/cluster/load_failure.py): one no retry mends fails the actor
  for good with its cause and remedy, any other restarts it as a death does. `fatal_error` says when no engine will
  ever serve.
- Nodes that join get actors of their own (`adopt_nodes`), up to `target_engines` when set; the autoscaler is asked
  for room for that many (`request_engines`); actors of nodes that left and will not serve again are forgotten.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from das.service.cluster.engine_failure import RestartWindow
from das.service.cluster.engine_layout import LayoutError, cpu_engine_error, cpu_node, gpu_engines
from das.service.cluster.load_failure import LoadFailure, classify
from das.service.cluster.node_engine import EngineNotStarted, NodeEngine
from das.service.cluster.rollout_backend import BackendStats
from das.service.config import ServiceConfig
from das.service.engine.contract import EngineInputError
from das.service.wire.engine_control import Pause, ReloadWeights

log = logging.getLogger(__name__)

# Seconds of calls refused with ActorDiedError after which an actor is taken to be dead for good.
_DEAD_FOR_GOOD_S = 30.0


def _describe(exc: BaseException) -> str:
    """The first line of `exc` with its type (Ray's death messages run to many lines)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


class _NotRestarted(RuntimeError):
    """Ray refuses every call to an actor it will not restart (killed with no_restart, its node gone)."""


# A stream or call that raises one of these lost its engine actor (its process, or its node: Ray cannot place an
# actor pinned to a node that left), or the object holding its samples, or reached the restarted actor before its
# death was noticed: what it owed is re-dispatched. Anything else an engine raises fails the batch.
def lost_errors() -> tuple[type[BaseException], ...]:
    import ray

    return (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError, ray.exceptions.ObjectLostError,
            EngineNotStarted)


@dataclass(eq=False)
class ServedPolicy:
    """What every serving engine serves, and what an engine that loads (at the start, after a restart, on a node
    that joined) catches up to before it serves. The coordinator owns it; it and its weight relay change it under
    its locks, the supervisor reads it to catch an engine up, dispatch stamps `version` on the samples it ends
    itself."""

    version: int = 0
    weights: tuple[str, int] | None = None  # the last reload (path, version)
    pushed: tuple[str, int] | None = None  # the last push saved as a checkpoint (path, version; weight_relay.py)
    paused: Pause | None = None  # the last /pause until /resume
    # a reload, a push (until it is saved) and a catch-up never interleave
    weights_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    control_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # a pause or resume and a catch-up never do

    def sources(self) -> list[tuple[str, int]]:
        """What a restart loads, newest first: the last reload and the last saved push (path, version)."""
        return sorted((s for s in (self.weights, self.pushed) if s is not None), key=lambda s: s[1], reverse=True)


def check_layouts(config: ServiceConfig, own_cluster: bool) -> None:
    """Before any actor exists: LayoutError for a GPU node whose GPUs the tensor parallel size does not divide, and
    in a cluster this process started (`own_cluster`), for a node without a GPU whose CPUs cannot run it."""
    import ray

    engine = config.engine
    for node in ray.nodes():
        if node["Alive"] and node["Resources"].get("GPU", 0) > 0:
            gpu_engines(int(node["Resources"]["GPU"]), engine.tensor_parallel_size,
                        f"node {node['NodeManagerAddress']}")
    if own_cluster and engine.cpu_workers and not any(
            n["Alive"] and n["Resources"].get("GPU", 0) > 0 for n in ray.nodes()):
        # this node is the engines' node: what its CPUs cannot run is refused here, before anything loads (in a
        # cluster joined, each engine checks its own node and fails alone: `NodeEngine.start`)
        layout = cpu_engine_error(engine.cpu_workers, *cpu_node(), "this node")
        if layout is not None:
            raise layout


def first_engine_actors(config: ServiceConfig, shard_names: list[str]) -> tuple[list[tuple[str, Any, list[str]]],
                                                                                bool]:
    """Creates the engine actors of the nodes alive now: on every GPU node, or on every node of a cluster without a
    GPU; with `target_engines`, on GPU nodes only and that many at most. Returns (node id, handle, engine names) per
    actor, and whether engines run on the GPU nodes only."""
    import ray

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
    return actors, bool(gpu_nodes) or target is not None


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
    # supervisor applies the cap per window. No task retries: what a dead actor owed is re-dispatched by the
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
class ActorRecord:
    """One NodeEngine actor as the supervisor sees it. `incarnation` counts the deaths noticed, so the many
    streams that see one death count it once; `names`: its engines, the same after every restart."""

    handle: Any
    restarts: RestartWindow
    node_id: str = ""  # the Ray node it is pinned to
    names: list[str] = field(default_factory=list)
    state: Literal["loading", "serving", "recovering", "failed"] = "loading"
    incarnation: int = 0
    error: str | None = None  # why it failed for good
    node_left: bool = False  # failed because its node left the cluster (its batches' work moves on)
    served: bool = False  # it has loaded and served (its engines are in EngineSupervisor.engines)
    failure: LoadFailure | None = None  # it failed for good because it cannot load (service/cluster/load_failure.py)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)  # its watcher and recovery


EngineRef = tuple[ActorRecord, int, str]  # (actor, engine index in the actor, engine name)


class EngineSupervisor:
    """The engine actors of one service: `start_loading` once, `stop` and `close_actors` at the end."""

    def __init__(self, config: ServiceConfig, shard_names: list[str], actors: list[tuple[str, Any, list[str]]],
                 gpu_nodes: bool, policy: ServedPolicy, own_cluster: bool = False) -> None:
        self.config = config
        self._shard_names = shard_names  # what an engine actor created later is given
        self._actors = [ActorRecord(handle, RestartWindow(config.failure), node_id, list(names))
                        for node_id, handle, names in actors]
        self._policy = policy
        # A cluster this process started: one node, every engine on it with one configuration, and no node joins
        # later, so an engine that cannot load means none can (`fatal_error`).
        self._own_cluster = own_cluster
        self._gpu_nodes = gpu_nodes  # engines on the GPU nodes only (else on every node)
        self._refused_nodes: set[str] = set()  # joined with GPUs the engines' tensor parallel size does not divide
        self._engines: list[EngineRef] = []  # every engine, serving or not, once the first load is done
        self._loading: asyncio.Task[None] | None = None
        self._closing = False
        self._changed = asyncio.Event()  # replaced at every change of an actor's state
        self._restarts: Counter[str] = Counter()  # per engine
        self._load_failures: Counter[tuple[str, str]] = Counter()  # per (engine, LoadFailure.reason): failed loads
        self._recovery_s: dict[str, float] = {}  # per engine, death noticed to serving again, latest

    # ---- the engines ----

    @property
    def engines(self) -> list[EngineRef]:
        """Every engine, serving or not, in the order of their first load."""
        return self._engines

    def serving(self) -> list[EngineRef]:
        return [engine for engine in self._engines if engine[0].state == "serving"]

    @property
    def actors_served(self) -> int:
        """The actors whose engines are in `engines` (each has served at least once): dispatch's streams at most,
        one per actor a batch runs on."""
        return sum(actor.served for actor in self._actors)

    def serving_actors(self) -> list[ActorRecord]:
        """The actors of the serving engines, each once, in the engines' order."""
        return list(dict.fromkeys(actor for actor, _, _ in self.serving()))

    async def wait_serving(self) -> list[EngineRef]:
        """The serving engines, once one serves. RuntimeError once none ever will."""
        while True:
            serving = self.serving()
            if serving:
                return serving
            if all(actor.state == "failed" for actor in self._actors) and not self._awaiting_nodes():
                raise RuntimeError("no engine can serve: " + "; ".join(str(a.error) for a in self._actors))
            await self._changed.wait()

    async def on_serving(self, call: Callable[[Any], Any]) -> list[Any]:
        """`call(actor handle)` on every serving NodeEngine at once; their replies. An actor lost meanwhile is
        left to its watcher (its restart catches up on the weights and the pause); any other error is raised."""
        actors = self.serving_actors()
        incarnations = [actor.incarnation for actor in actors]
        replies = await asyncio.gather(*(call(actor.handle) for actor in actors), return_exceptions=True)
        lost = lost_errors()
        for actor, incarnation, reply in zip(actors, incarnations, replies):
            if isinstance(reply, lost):
                self.engine_died(actor, incarnation, reply)
            elif isinstance(reply, BaseException):
                raise reply
        return [reply for reply in replies if not isinstance(reply, BaseException)]

    def stats(self, figures: BackendStats) -> BackendStats:
        """`figures` with the engines' own: how many serve, restarts, recovery times, failed loads and failures."""
        return replace(figures, engines_ready=len(self.serving()), engine_restarts=dict(self._restarts),
                       engine_recovery_s=dict(self._recovery_s), engine_load_failures=dict(self._load_failures),
                       engines_failed={name: str(actor.error) for actor in self._actors if actor.state == "failed"
                                       for name in actor.names})

    # ---- the first load ----

    def start_loading(self, progress: Callable[[str], None], loaded: Callable[[], Awaitable[None]]) -> None:
        """Starts the first load of every actor in the background (`loaded` runs after it once an engine exists)."""
        self._loading = asyncio.create_task(self._load_engines(progress, loaded))

    @property
    def loaded(self) -> bool:
        """The first load is done: every engine serves or has failed for good."""
        return self._loading is not None and self._loading.done()

    async def wait_loaded(self) -> None:
        if self._loading is not None:
            await asyncio.shield(self._loading)

    async def _load_engines(self, progress: Callable[[str], None], loaded: Callable[[], Awaitable[None]]) -> None:
        """The first load of every engine actor, at once; done when each serves or has failed for good."""
        await asyncio.gather(*(self._load(actor) for actor in self._actors))
        if self._engines:
            await loaded()
        ready = [name for _, _, name in self.serving()]
        failed = [name for actor in self._actors if actor.state == "failed" for name in actor.names]
        progress("; ".join(([f"{len(ready)} engines ready: {', '.join(ready)}"] if ready else [])
                           + ([f"{len(failed)} failed to load: {', '.join(failed)}"] if failed else []))
                 or "no engine actor")

    async def _load(self, actor: ActorRecord) -> None:
        """An actor's first load (at the start, or on a node that joined): it serves once loaded and caught up (the
        weights last served, the pause in force). A load that cannot succeed fails it for good with its cause; one
        that may succeed in a fresh process restarts it, as a death does (`_load_failed`). Returns once it serves
        or has failed for good."""
        import ray

        timeout = self.config.failure.recovery_timeout_s
        try:
            async with asyncio.timeout(timeout):
                names = await actor.handle.start.remote()
                async with self._policy.weights_lock, self._policy.control_lock:
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

    def _add_engines(self, actor: ActorRecord, names: Sequence[str]) -> None:
        """Its engines join the service's list at the actor's first successful load."""
        actor.names = list(names)
        if not actor.served:
            self._engines.extend((actor, i, name) for i, name in enumerate(actor.names))

    def _load_failed(self, actor: ActorRecord, exc: BaseException) -> Coroutine[Any, Any, None] | None:
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

    # ---- what the service can still do ----

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
        that served and then failed past its restart cap leaves /healthz failing, as before)."""
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

    def live(self) -> bool:
        """False once no engine can serve again: every actor past its restart cap or its recovery timeout, and no
        engine wanted of nodes yet to join (`target_engines`)."""
        return self._awaiting_nodes() or not all(actor.state == "failed" for actor in self._actors)

    def _awaiting_nodes(self) -> bool:
        """Engines are wanted (`target_engines`) that no node has room for yet: an autoscaler may add one."""
        target = self.config.target_engines
        return target is not None and self._engines_kept() < target

    # ---- deaths and recovery ----

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _spawn(self, actor: ActorRecord, job: Any) -> None:
        task = asyncio.create_task(job)
        actor.tasks.add(task)
        task.add_done_callback(actor.tasks.discard)

    def _serve(self, actor: ActorRecord) -> None:
        """Marks `actor` serving and keeps a call pending on it, so its death is noticed at once even when idle."""
        actor.state = "serving"
        actor.served = True
        self._spawn(actor, self._watch(actor, actor.incarnation))
        self._notify()

    async def _watch(self, actor: ActorRecord, incarnation: int) -> None:
        try:
            await actor.handle.watch.remote()
        except lost_errors() as exc:
            self.engine_died(actor, incarnation, exc)

    def engine_died(self, actor: ActorRecord, incarnation: int, exc: BaseException) -> None:
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

    def _fail(self, actor: ActorRecord, error: str) -> None:
        actor.state, actor.error = "failed", error
        log.error("%s", error)
        self._notify()

    async def _recover(self, actor: ActorRecord, died: float) -> None:
        """Waits for Ray to restart `actor`, loads its engines and the weights last served; then it serves."""
        import ray

        timeout = self.config.failure.recovery_timeout_s
        refused_since: float | None = None  # the first of an unbroken run of ActorDiedError answers
        try:
            async with asyncio.timeout(timeout):
                while True:
                    try:
                        names = await actor.handle.start.remote()
                        async with self._policy.weights_lock, self._policy.control_lock:
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

    async def _catch_up(self, actor: ActorRecord) -> None:
        """Brings a loaded actor to the others' state: the weights last served (the newer of the last reload and
        the last push saved), the pause in force. Called under the policy's `weights_lock` and `control_lock`. A
        saved push this engine's node cannot read (a state directory on another node's disk) is logged and the
        last reload loaded instead."""
        policy = self._policy
        names = ", ".join(actor.names)
        # An actor that only seemed dead (unreachable for a moment) kept its weights.
        served = await actor.handle.policy_version.remote()
        for path, version in policy.sources():
            if served >= version:
                break
            try:
                served = await actor.handle.control.remote(ReloadWeights(checkpoint=path, version=version))
                break
            except EngineInputError as exc:  # a reload's own path was checked when it was reloaded
                if (path, version) != policy.pushed:
                    raise
                log.error("engine %s cannot load the saved push %s (%s): its node does not see the state "
                          "directory", names, path, str(exc).strip().splitlines()[-1])
        if policy.version > served:  # a push not saved (docs/design.md "Weight transfer: weights without the disk")
            log.warning("engine %s serves policy version %d, not the pushed %d, until the trainer pushes again (the "
                        "push after a restart re-forms the group with it): pushes are saved for engines that "
                        "restart only under --weight-transfer gloo with --state-dir", names, served, policy.version)
        if policy.paused is not None:  # it holds new work until /resume, as the others do
            await actor.handle.control.remote(policy.paused)

    # ---- nodes that join or leave, and the autoscaler ----

    async def adopt_nodes(self) -> None:
        """Gives engine actors to the nodes that joined after the start (a worker pod replaced, which Ray sees as a
        new node, or added): every live node of the kind that runs engines and has none. They load in the
        background and serve once loaded and caught up. Nothing while the first load runs."""
        import ray

        if not self.loaded or self._closing:
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
                actor = ActorRecord(handle, RestartWindow(self.config.failure), node["NodeID"], names)
                self._actors.append(actor)
                self._spawn(actor, self._join(actor))

    async def _join(self, actor: ActorRecord) -> None:
        """Loads an actor created after the start (`_load`: one that cannot load fails alone, with its cause; the
        engines already serving go on)."""
        await self._load(actor)
        if actor.state == "serving":
            log.warning("engine %s joined and serves", ", ".join(actor.names))

    def _engines_kept(self) -> int:
        """Engines of the actors that have not failed for good (loading, serving or recovering)."""
        return sum(len(actor.names) for actor in self._actors if actor.state != "failed")

    def request_engines(self, engines: int) -> None:
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

    # ---- the end ----

    def stop(self) -> list[asyncio.Task[None]]:
        """No death is handled and no node adopted from now on; cancels the first load and every actor's watcher
        and recovery, and returns those last for the caller to await."""
        self._closing = True
        actor_tasks = [task for actor in self._actors for task in actor.tasks]
        for task in (*actor_tasks, *([self._loading] if self._loading else [])):
            task.cancel()
        return actor_tasks

    async def close_actors(self) -> None:
        """Closes the engines of the actors that run (not those restarting: a call would wait for their model to
        load), then kills every actor."""
        import ray

        await asyncio.gather(*(actor.handle.close.remote() for actor in self._actors
                               if actor.state in ("loading", "serving")), return_exceptions=True)
        for actor in self._actors:
            ray.kill(actor.handle)
