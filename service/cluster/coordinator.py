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

An engine that dies loses nothing (docs/design.md "Failure behaviour"; its supervision is
service/cluster/engine_supervisor.py). The NodeEngine actors are created with
unbounded Ray restarts and no task retries (nothing runs twice behind our back); the coordinator counts the
restarts itself, `FailureConfig.max_restarts` per `restart_window_s`, and kills an actor for good past that. A
death is noticed by the stream that breaks or by a call the coordinator keeps pending on every actor
(`NodeEngine.watch`); the engine stops serving, the coordinator calls `start()` on the restarted actor (which
reloads the model and pulls its drafter history from the store with fresh cursors) and reloads the weights last
served, then it serves again. The samples the dead engine owed that had not arrived are sent to a serving engine
(or the restarted one) as a group with n = their count, and renumbered back to the missing indices
(service/cluster/engine_failure.py `Share`), so every sample index reaches the client exactly once. Each resumes
from the tokens it had delivered (the engines report each sample's new tokens every stream interval,
`node_engine.PROGRESS_INTERVAL_S` or longer with many engines, `stream_interval`; the coordinator keeps them per
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
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from das.scheduler.difficulty import DifficultyBook, DifficultyFormatError, load_difficulty
from das.scheduler.length import LengthPredictor
from das.scheduler.placement import place_groups
from das.service.cluster.engine_failure import GivenUpPrompts, Share
from das.service.cluster.engine_supervisor import (ActorRecord, EngineRef, EngineSupervisor, ServedPolicy,
                                                   check_layouts, first_engine_actors, lost_errors)
from das.service.cluster.group_aborts import GroupAborts, aborted_sample
from das.service.cluster.history_store import HistoryShardActor, shard_of
from das.service.cluster.node_engine import PROGRESS_INTERVAL_S
from das.service.cluster.pause_hold import PauseHold
from das.service.cluster.rollout_backend import BackendStats, GroupInputError, ProgressSink, WeightUpdateConflict
from das.service.cluster.sessions import SessionBook
from das.service.config import ServiceConfig
from das.service.engine.config import transfer_backend
from das.service.engine.contract import EngineInputError, validate_rollouts
from das.service.wire.api import GroupRequest, LengthCurveSpec, ProblemSummary, SampleResult
from das.service.wire.engine_control import EngineControl, Pause, Resume
from das.service.wire.sample_progress import SampleProgress
from das.service.wire.weight_transfer import TransferBackend

log = logging.getLogger(__name__)

# Passed on to the engine actors' processes, which do not inherit the driver's environment when joining a cluster.
_FORWARDED_ENV = ("VLLM_LOGGING_LEVEL", "VLLM_LOGGING_STREAM", "VLLM_PLUGINS", "DAS_DATA_DIR",
                  "VLLM_CPU_OMP_THREADS_BIND")


def _sample_load(group: GroupRequest) -> float:
    """What one sample of a group placed by `with_length_predictions` weighs in placement: its predicted output
    tokens."""
    return float(group.predicted_tokens or 0.0)


# The longest interval between an engine's stream items (`stream_interval`): a finished sample waits on its
# engine this long at most, whatever the number of engines.
_MAX_STREAM_INTERVAL_S = 5.0


def stream_interval(engines: int, items_per_s: float) -> float:
    """Seconds between an engine's stream items (finished samples and progress travel together) with `engines`
    engines: 50 ms, longer once the engines together would send more than `items_per_s`
    (`ServiceConfig.stream_items_per_s`), at most 5 s. A finished sample waits up to this long on its engine (not
    the last ones of its engine's run), and a death loses up to this long of a sample's tokens."""
    return min(_MAX_STREAM_INTERVAL_S, max(PROGRESS_INTERVAL_S, engines / items_per_s))


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
    """Use `await RayBackend.start(config)`; `await close()` at the end (snapshots the history). `supervisor` keeps
    its engine actors (service/cluster/engine_supervisor.py)."""

    def __init__(self, config: ServiceConfig, shards: list[Any], shard_names: list[str],
                 actors: list[tuple[str, Any, list[str]]], gpu_nodes: bool, own_cluster: bool = False) -> None:
        self.config = config
        self._shards = shards
        self._gpu_nodes = gpu_nodes  # engines on the GPU nodes only (else on every node)
        self._uses_ray = True  # until close: counted in _RayInThisProcess.users
        self._policy = ServedPolicy()
        self.supervisor = EngineSupervisor(config, shard_names, actors, gpu_nodes, self._policy, own_cluster)
        # the engines in the trainer's weight-transfer group (actor, incarnation), in rank order: set by
        # /init_weight_transfer_engine; a push needs the same ones serving
        self._transfer_group: list[tuple[ActorRecord, int]] = []
        self._pushing = False  # a push is open: the policy's `weights_lock` is held from its start to its end
        # every dispatch to an engine actor waits here while paused (service/cluster/pause_hold.py)
        self._hold = PauseHold()
        self._book = DifficultyBook()
        self._predictor = LengthPredictor(self._book)
        self._stats = BackendStats()
        self._background: list[asyncio.Task[None]] = []
        self._placed = _PlacedWork()
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
        predicted remaining work counts in their engine's load (`_place`)."""
        self._sessions = book

    def place(self, groups: Sequence[GroupRequest]) -> _Placement:
        """Per serving engine (in `serving_engines` order), the (batch index, group) pairs it would run, longest
        predicted first (`with_length_predictions` tags the groups), given the work already placed there."""
        return self._place(groups, self.supervisor.serving())

    def _place(self, groups: Sequence[GroupRequest], serving: Sequence[EngineRef]) -> _Placement:
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

    def _place_timed(self, groups: Sequence[GroupRequest], serving: Sequence[EngineRef]) -> _Placement:
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

    async def _least_loaded(self) -> EngineRef:
        """The serving engine with the least predicted work outstanding, once one serves. RuntimeError once none
        ever will."""
        serving = await self.supervisor.wait_serving()
        return min(serving, key=lambda engine: self._placed.load(engine[2]))

    async def generate(self, groups: Sequence[GroupRequest], on_progress: ProgressSink | None = None,
                       aborts: GroupAborts | None = None) -> AsyncGenerator[tuple[int, SampleResult], None]:
        aborts = aborts or GroupAborts()
        serving = self.supervisor.serving() or [await self._least_loaded()]
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

    async def _job(self, engine: EngineRef, work: list[tuple[Share, GroupRequest]],
                   out: _Out, aborts: GroupAborts) -> None:
        """Runs `work` on `engine` (`_run`), putting its samples on `out` as they arrive, renumbered as the batch's.
        Ends with None on `out`, or the exception that failed the batch. The caller has put `work` in `_placed` on
        `engine`."""
        try:
            await self._run(engine, work, out, aborts)
            out.put_nowait(None)
        except Exception as exc:  # handed to the batch, which owns the error
            out.put_nowait(exc)

    async def _run(self, engine: EngineRef, work: list[tuple[Share, GroupRequest]],
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
                interval = stream_interval(len(self.supervisor.engines), self.config.stream_items_per_s)
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
                except lost_errors() as exc:
                    self.supervisor.engine_died(actor, incarnation, exc)
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
            serving = self.supervisor.serving() or [await self._least_loaded()]
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
            engine = await self._least_loaded()
            self._placed.hold(engine[2], [item])
            await self._run(engine, [item], out, aborts)

    def _end_aborted(self, name: str, work: list[tuple[Share, GroupRequest]], out: _Out) -> None:
        """Ends the shares' missing samples (held in `_placed` on engine `name`) with finish_reason "abort": their
        group was aborted alone before they were sent (again) to an engine."""
        for share, group in work:
            for index in share.missing():
                share.received.add(index)
                self._placed.arrived(name, group)
                out.put_nowait((share.group_index, aborted_sample(group, index, self._policy.version)))

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
                    finish_reason="error", policy_version=self._policy.version, error=error)))

    async def reload_weights(self, path: str | os.PathLike[str], version: int) -> int:
        """Reloads every serving engine; an engine that is restarting loads these weights before it serves."""
        await self.supervisor.wait_serving()  # someone must check the path and version before they are kept
        async with self._policy.weights_lock:
            await self.supervisor.on_serving(lambda node: node.reload_weights.remote(str(path), version))
            self._policy.weights = (str(path), version)
            self._policy.version = version
        return self._policy.version

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
        return replace(self.supervisor.stats(self._stats), samples_redispatched=self._redispatched,
                       samples_given_up=self._given_up,
                       engine_placed_tokens={name: self._placed.load(name) for name in self.engine_names},
                       engine_stream_items=self._stream_items, placement_s=self._placement_s,
                       placements=self._placements)

    # ---- vLLM's weight transfer (rollout_backend.RolloutBackend says what each does) ----

    @property
    def weight_transfer(self) -> TransferBackend | None:
        return transfer_backend(self.config.engine.weight_transfer, gpu=self._gpu_nodes)

    def transfer_world_size(self) -> int:
        engine = self.config.engine
        return len(self.supervisor.serving()) * engine.tensor_parallel_size

    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """Every serving engine joins the trainer's group: engine e's workers at the trainer's `rank_offset` + the
        workers of the engines before it. Refused (EngineInputError) unless `world_size` is that offset + every
        serving worker: a group of another size would wait for ranks that never come."""
        if self._pushing:
            raise WeightUpdateConflict("a weight update is open: finish it before joining a new group")
        serving = self.supervisor.serving()
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
        actors: dict[int, ActorRecord] = {}
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
        await self._policy.weights_lock.acquire()
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
        self._policy.version = version
        self._pushing = False
        self._policy.weights_lock.release()
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
            self._policy.weights_lock.release()

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
        serving = self.supervisor.serving_actors()
        gone = [actor for actor, incarnation in self._transfer_group
                if actor.state != "serving" or actor.incarnation != incarnation]
        new = [actor for actor in serving if id(actor) not in members]
        return "; ".join([*(f"engine {', '.join(a.names)} restarted or stopped serving" for a in gone),
                          *(f"engine {', '.join(a.names)} joined" for a in new)])

    async def _on_actors(self, actors: list[tuple[ActorRecord, int]],
                         call: Callable[[ActorRecord], Any]) -> list[Any]:
        """`call(actor)` on each of `actors` at once; their replies. A lost actor is reported as a death and raised
        as a RuntimeError naming it; any other error is raised as it is (the first one)."""
        replies = await asyncio.gather(*(call(actor) for actor, _ in actors), return_exceptions=True)
        lost = lost_errors()
        errors: list[BaseException] = []
        for (actor, incarnation), reply in zip(actors, replies):
            if isinstance(reply, lost):
                self.supervisor.engine_died(actor, incarnation, reply)
                errors.append(RuntimeError(f"engine {', '.join(actor.names)} died during the weight transfer"))
            elif isinstance(reply, BaseException):
                errors.append(reply)
        if errors:  # a refusal says more than the broken group it leaves the others with
            raise next((e for e in errors if isinstance(e, EngineInputError)), errors[0])
        return list(replies)

    # ---- vLLM's RL control plane (rollout_backend.RolloutBackend says what each does) ----

    async def control(self, message: EngineControl) -> Any:
        # A Pause is remembered until the Resume: an engine actor restarted meanwhile is paused alike
        # (`EngineSupervisor._catch_up`), and new work waits in the coordinator's hold.
        async with self._policy.control_lock:
            if isinstance(message, Pause):
                self._policy.paused = message
                self._hold.pause()
            replies = await self.supervisor.on_serving(lambda node: node.control.remote(message))
            if isinstance(message, Resume):
                self._policy.paused = None
                self._hold.release()
        return message.combine(replies)

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
