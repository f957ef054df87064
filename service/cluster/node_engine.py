"""`NodeEngine`: the Ray actor that owns engines of one node (the service gives each engine an actor of its own:
service/cluster/engine_supervisor.py `_engine_actors`).

For the groups the coordinator gives it, it pulls from the history store what other engines and imports added for
those problems since its last pull (the rollouts it made itself are already in its drafter) and installs them in
the engine's drafter; then it runs the groups, streams the samples back as they finish, and pushes each finished
rollout to the store (batched per group, awaited before its stream ends, so nothing accepted is dropped).

Run by Ray as an async actor: every method runs on the actor's event loop, so concurrent batches share the
engines the same way concurrent groups do in one `Engine`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections import OrderedDict, defaultdict
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from das.service.cluster.history_client import HistoryClient
from das.service.cluster.engine_layout import cpu_engine_error, cpu_node
from das.service.cluster.history_store import resident_bytes, shard_of
from das.service.config import HistoryPushConfig
from das.service.cluster.load_failure import EngineLoadError, Stage, classify
from das.service.cluster.group_aborts import GroupAborts, abortable
from das.service.cluster.rollout_backend import EngineLoad, merge_batches
from das.service.engine.contract import EngineInputError
from das.service.engine.pause_gate import PauseGate
from das.service.engine.control import apply_control
from das.service.engine.factory import EngineSpec, create_engine, prepare
from das.service.engine.protocol import Engine
from das.service.engine.spawn_env import restored_environ
from das.service.wire.api import GroupRequest, SampleResult
from das.service.wire.engine_control import EngineControl, Pause, Resume
from das.service.wire.sample_progress import ProgressBatcher, SampleProgress

log = logging.getLogger(__name__)

# Samples a stream item carries at most: samples that finish together travel in one Ray object.
_MAX_SAMPLES_PER_ITEM = 64

# Aborts kept for runs not started here (yet): a run id is a few dozen bytes, so this bound is about memory only.
_EARLY_ABORTS = 1024
# Seconds between an actor's progress reports at most (docs/design.md "Token progress"): often enough for a stream
# of deltas to look live and for a death to lose little, rare enough to cost one Ray object per actor per interval.
PROGRESS_INTERVAL_S = 0.05
# Seconds between an actor's stream items at least, by default (unless 64 samples wait): a sample that finishes waits
# up to this long to travel with the others and the next progress report, because the coordinator's CPU goes per Ray
# object (docs/design.md "The coordinator at scale"; the coordinator passes a longer one with many engine actors).
ITEM_INTERVAL_S = PROGRESS_INTERVAL_S
# Seconds between an actor's checks that its engines' cores live (`NodeEngine._watch_engines`): a death is acted on
# this long after vLLM has seen it at most; a check reads one flag per engine.
ENGINE_WATCH_S = 0.5

# What `NodeEngine.run` runs on one of its engines: (engine index in the actor, (index, group) pairs in start order).
RunPart = tuple[int, Sequence[tuple[int, GroupRequest]]]


def _shard_actor(shard: Any) -> Any:
    """A shard actor handle from its Ray actor name; a handle (or an in-process shard) as it is. A name Ray no longer
    knows (a shard past a finite restart cap) gives a `_GoneShard`: this engine then runs without that shard's
    history, as it does while a shard is down, instead of failing to start."""
    if not isinstance(shard, str):
        return shard
    import ray

    try:
        return ray.get_actor(shard)
    except ValueError:
        log.error("history shard %s is gone for good: this engine drafts without its rollouts", shard)
        return _GoneShard(shard)


class _GoneShard:
    """Stands in for a shard actor that no longer exists: every call raises RayActorError, which the history
    client treats as an unavailable shard (service/cluster/history_client.py)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getattr__(self, method: str) -> Any:
        import ray

        def remote(*args: Any, **kwargs: Any) -> Any:
            raise ray.exceptions.RayActorError(error_msg=f"history shard {self.name} is gone for good")

        return SimpleNamespace(remote=remote)


def _visible_gpus() -> list[str]:
    """The GPUs Ray gave this actor (CUDA_VISIBLE_DEVICES): none on a node without a GPU."""
    return [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]


class EngineNotStarted(RuntimeError):
    """A call reached an incarnation of the actor that has not loaded its engines: the incarnation the caller knew
    died and Ray restarted the actor before the caller noticed. The coordinator treats it as that death."""


@dataclass(frozen=True)
class NodeStats:
    engines: tuple[EngineLoad, ...]
    resident_bytes: int  # this actor's process; the engine core processes are children and not counted
    history_outbox_records: int = 0  # rollouts pushed that no shard snapshot holds yet (die with this process)
    history_records_given_up: int = 0  # since this process started: dropped from a full outbox, or refused


class NodeEngine:
    """The `engines` engines of one node (named `node/i`, i counted from `first_index`, so several actors on one
    node name their engines apart). `shards`: the HistoryStore shard actors in shard order, as Ray actor names
    (looked up here, in every incarnation) or as handles (in-process use). With several
    engines, the GPUs Ray gave this actor (CUDA_VISIBLE_DEVICES) are dealt out evenly, one slice per engine.
    A vLLM `config.model` may be a known model name: each node prepares its own copy (service/engine/vllm/models.py).

    A vLLM engine core that dies (EngineDeadError) ends this actor's process: Ray restarts the actor and the
    coordinator recovers it like any actor that died (service/cluster/engine_supervisor.py), re-dispatching what it
    owed. A batch that sees the death ends the actor at once; `_watch_engines` does for any other time, since vLLM
    never answers a call that was in flight when its core died (a push's receive, a reload, a save) and an idle dead
    engine would be counted as serving until a batch reached it. Why not recreate the engine here: that one path
    then covers both deaths (restart cap, weights catch-up, history re-pull, re-dispatch), and nothing of the dead
    engine (its processes, its memory) lingers in a live one; the cost is that an actor's other engines restart with
    it, which is why on a node without a GPU each engine has an actor of its own."""

    def __init__(self, node: str, config: EngineSpec, shards: Sequence[Any],
                 engines: int = 1, history_push: HistoryPushConfig | None = None, first_index: int = 0
                 ) -> None:
        if engines < 1:
            raise ValueError(f"engines must be >= 1, got {engines}")
        self.node = node
        self.config = config
        self.shards = [_shard_actor(s) for s in shards]
        self.engines: list[Engine] = []
        self.names = [f"{node}/{first_index + i}" for i in range(engines)]
        # What this actor pushes is tagged with a name of this incarnation: after a restart the same engine name
        # must still pull the rollouts its predecessor pushed (its fresh drafter never saw them).
        self._origins = [f"{name}#{uuid.uuid4().hex[:8]}" for name in self.names]
        # Per engine: problem id -> the store sequence number its drafter has seen up to.
        self._cursors: list[dict[str, int]] = [{} for _ in range(engines)]
        self._history = HistoryClient(self.shards, history_push or HistoryPushConfig())
        # Groups that reach this actor while it is paused (sent just before the coordinator's pause) wait here, not in
        # vLLM's queue (service/engine/pause_gate.py); paused before the engines, resumed after them.
        self._hold = PauseGate()
        # The runs in flight by the coordinator's run id, each with its groups aborted alone (`abort_group`), and
        # aborts that arrived before their run (an async actor may start calls out of order), bounded.
        self._runs: dict[str, GroupAborts] = {}
        self._early_aborts: OrderedDict[str, set[int]] = OrderedDict()
        self._watcher: asyncio.Task[None] | None = None  # `_watch_engines`, from the engines' load to `close`

    def _engine_envs(self) -> list[dict[str, str]]:
        count = len(self.names)
        gpus = _visible_gpus()
        if count == 1 or not gpus:
            return [{} for _ in range(count)]
        per = max(len(gpus) // count, 1)
        return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[i * per:(i + 1) * per])} for i in range(count)]

    async def start(self) -> list[str]:
        """Loads every engine (minutes with torch.compile); returns the engine names. Once they have loaded, a
        second call only returns the names (the coordinator calls it after every death it noticed). A load that
        fails raises EngineLoadError: the error classified here, where its type is known (service/cluster/
        load_failure.py), the engines it had loaded closed."""
        if self.engines:
            return self.names
        stage: Stage = "engine"
        try:
            # What the node's CPUs cannot run fails at once, before minutes of loading (a GPU engine's GPUs are
            # Ray's to fit)
            if self.config.cpu_workers and not _visible_gpus():
                layout = cpu_engine_error(self.config.cpu_workers, *cpu_node(), f"node {self.node}")
                if layout is not None:
                    raise layout
            stage = "model"
            config = prepare(self.config)
            stage = "engine"
            await self._load(config)
            self._watcher = asyncio.get_running_loop().create_task(self._watch_engines())
        except Exception as exc:
            failure = classify(exc, stage)
            log.error("%s: the engine failed to load (%s): %s", ", ".join(self.names),
                      "for good" if failure.permanent else "may load again", failure.describe())
            with contextlib.suppress(Exception):
                await self.close()
            raise EngineLoadError(failure) from None
        return self.names

    async def _load(self, config: EngineSpec) -> None:
        for env in self._engine_envs():
            with restored_environ(env):
                os.environ.update(env)  # the engine core process is spawned now and inherits it
                engine = await create_engine(config)
            self.engines.append(engine)

    async def _watch_engines(self) -> None:
        """Ends this actor once one of its engines' cores has died (the class docstring)."""
        while True:
            await asyncio.sleep(ENGINE_WATCH_S)
            for index, engine in enumerate(self.engines):
                if engine.dead:
                    self._engine_died(index)

    def _started(self) -> None:
        if not self.engines:
            raise EngineNotStarted(f"{', '.join(self.names)}: this actor restarted and has not loaded its engines")

    async def check(self, groups: Sequence[GroupRequest]) -> tuple[int, str] | None:
        """The first group an engine would refuse, as (index, message), or None."""
        self._started()
        for i, group in enumerate(groups):
            try:
                self.engines[0].prompt_token_ids(group)
            except EngineInputError as exc:
                return i, str(exc)
        return None

    async def run(self, parts: Sequence[RunPart], progress_interval_s: float = PROGRESS_INTERVAL_S,
                  run_id: str | None = None, item_interval_s: float = ITEM_INTERVAL_S
                  ) -> AsyncGenerator[list[tuple[int, SampleResult | SampleProgress]], None]:
        """Runs groups on this actor's engines, in one stream: per part, (engine index, (index, group) pairs), the
        engine starting its groups in the given order; the indices name the groups across all the parts (unique in
        the run). Yields lists of (index, sample) as samples finish, and (index, progress) of the samples in
        flight: each sample's new tokens since its last report, every `progress_interval_s` seconds at most (merged
        per sample, all the engines' reports in one item). Items follow each other by `item_interval_s` at least
        (finished samples wait for the next, up to 64 at once). One stream per actor, not per engine, because the
        coordinator's Ray work (a call, a stream, its items) goes per stream: an actor hosting 64 stub engines costs
        it what one engine does (docs/design.md "The coordinator at scale"). Cancelling the Ray task aborts the
        samples still running. `run_id` names the run for `abort_group`."""
        self._started()
        aborts = GroupAborts()
        if run_id is not None:
            self._runs[run_id] = aborts
            for index in self._early_aborts.pop(run_id, ()):
                aborts.abort(index)
        try:
            async with contextlib.aclosing(self._run(parts, progress_interval_s, aborts, item_interval_s)) as stream:
                async for items in stream:
                    yield items
        finally:
            if run_id is not None:
                self._runs.pop(run_id, None)

    async def abort_group(self, run_id: str, indices: Sequence[int]) -> None:
        """Aborts the groups of run `run_id` with these batch indices alone: the engine stops generating them and
        their samples not delivered come with finish_reason "abort" (service/cluster/group_aborts.py)."""
        aborts = self._runs.get(run_id)
        if aborts is None:  # its run has not started here yet, or has ended (then this is never read)
            self._early_aborts.setdefault(run_id, set()).update(indices)
            while len(self._early_aborts) > _EARLY_ABORTS:
                self._early_aborts.popitem(last=False)
            return
        for index in indices:
            aborts.abort(index)

    async def _run(self, parts: Sequence[RunPart], progress_interval_s: float, aborts: GroupAborts,
                   item_interval_s: float = ITEM_INTERVAL_S
                   ) -> AsyncGenerator[list[tuple[int, SampleResult | SampleProgress]], None]:
        # Each engine pulls its problems' history once, before any of its groups starts; every part's pull runs at
        # once, and each group waits for its own engine's.
        pulls = [asyncio.create_task(self._pull(engine, [g.problem_id for _, g in groups])) for engine, groups in parts]
        batcher = ProgressBatcher()
        running = sum(len(groups) for _, groups in parts)
        ended = asyncio.Event()

        async def one(engine: int, pulled: asyncio.Task[None], index: int, group: GroupRequest
                      ) -> AsyncIterator[tuple[int, SampleResult]]:
            nonlocal running
            target = self.engines[engine]
            name, origin = self.names[engine], self._origins[engine]
            records: list[dict[str, Any]] = []

            def report(progress: SampleProgress) -> None:
                batcher.add((index, progress.sample_index), progress)

            try:
                try:
                    # shielded: one group's stream closing must not cancel the pull its engine's other groups await
                    await asyncio.shield(pulled)
                except Exception:
                    if target.dead:
                        self._engine_died(engine)
                    raise
                await self._hold.resumed()
                samples = abortable(target.generate(group, report), group, aborts.event(index),
                                    lambda: target.policy_version)
                async for sample in samples:
                    batcher.drop((index, sample.sample_index))  # its result carries those tokens
                    if sample.finish_reason == "error" and target.dead:
                        self._engine_died(engine)  # the sample is owed, not failed: it is drawn again elsewhere
                    sample.engine = name
                    sample.finished_unix_s = time.time()
                    if sample.finish_reason in ("stop", "length") and sample.prompt_token_ids:
                        records.append({"problem_id": group.problem_id, "policy_version": sample.policy_version,
                                        "sample_index": sample.sample_index,
                                        "prompt_token_ids": sample.prompt_token_ids,
                                        "output_token_ids": sample.token_ids, "finish_reason": sample.finish_reason,
                                        "sample_key": group.sample_key(sample.sample_index)})
                    yield index, sample
                await self._push(origin, records)
            finally:
                running -= 1
                if not running:
                    ended.set()

        async def progress() -> AsyncIterator[list[tuple[int, SampleProgress]]]:
            while not ended.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ended.wait(), progress_interval_s)
                taken = batcher.take()
                if taken and not ended.is_set():
                    yield [(key[0], report) for key, report in taken]  # type: ignore[index]

        streams: list[AsyncIterator[Any]] = [one(engine, pulled, i, g)
                                             for (engine, groups), pulled in zip(parts, pulls) for i, g in groups]
        if running:
            streams.append(progress())
        try:
            async with contextlib.aclosing(merge_batches(streams, _MAX_SAMPLES_PER_ITEM, item_interval_s)) as merged:
                async for items in merged:
                    yield [pair for item in items for pair in (item if isinstance(item, list) else [item])]
        finally:
            for pull in pulls:
                pull.cancel()
            await asyncio.gather(*pulls, return_exceptions=True)

    def _engine_died(self, engine: int) -> None:
        """Ends this process: Ray restarts the actor, and the coordinator re-dispatches what it had not received."""
        log.error("%s: the vLLM engine core died; ending this actor so that Ray restarts it", self.names[engine])
        logging.shutdown()
        os._exit(1)

    async def policy_version(self) -> int:
        """The policy version the engines serve (0 before any reload)."""
        return self.engines[0].policy_version

    async def watch(self) -> None:
        """Never returns: the coordinator keeps this call pending to learn of this actor's death at once."""
        await asyncio.Event().wait()

    # ---- control: every engine of the node at once (rollout_backend.RolloutBackend says what each verb does) ----

    async def control(self, message: EngineControl) -> Any:
        """A control verb (pause, reload, a weight-transfer step, ...: service/wire/engine_control.py) on every engine
        of the node, the replies combined. From a Pause until the Resume, groups that reach this actor wait here, not
        in vLLM's queue."""
        self._started()
        if isinstance(message, Pause):
            self._hold.pause(message.mode)
        reply = await apply_control(self.engines, message)
        if isinstance(message, Resume):
            self._hold.resume()
        return reply

    async def stats(self) -> NodeStats:
        loads = []
        for name, engine in zip(self.names, self.engines):
            drafter = await engine.drafter_stats()
            parts = await engine.read_step_parts()
            loads.append(EngineLoad.of(name, engine.tally, drafter, engine.runner, parts))
        return NodeStats(tuple(loads), resident_bytes(), self._history.pending(), self._history.given_up)

    async def close(self) -> None:
        if self._watcher is not None:  # a closed engine reads as dead
            self._watcher.cancel()
            self._watcher = None
        for engine in self.engines:
            await engine.close()
        self.engines.clear()

    # ---- history ----

    async def _pull(self, engine: int, problem_ids: Sequence[str]) -> None:
        """Installs in `engine`'s drafter what the store got for these problems since its last pull."""
        cursors = self._cursors[engine]
        by_shard: dict[int, dict[str, int]] = defaultdict(dict)
        for pid in set(problem_ids):
            by_shard[shard_of(pid, len(self.shards))][pid] = cursors.get(pid, 0)
        if not by_shard:
            return
        replies = await asyncio.gather(*(self._history.pull(s, c, self._origins[engine]) for s, c in by_shard.items()))
        records = []
        for reply in replies:
            for pid, (new, cursor) in reply.items():
                records.extend(new)
                cursors[pid] = cursor
        if records:
            added = await self.engines[engine].add_history(records)
            log.info("%s: installed %d of %d pulled rollouts", self.names[engine], added, len(records))

    async def _push(self, origin: str, records: list[dict[str, Any]]) -> None:
        """Hands the records to the store; kept and re-sent until a snapshot holds them
        (service/cluster/history_client.py says what is guaranteed)."""
        await self._history.push(origin, records)
