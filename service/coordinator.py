"""`RayBackend`: the coordinator of the Ray-distributed service (a `RolloutBackend` for the gateway).

Actors (Ray's own scheduling, node affinity and failure reporting; no cluster manager of ours):
- `HistoryShard` x S (service/history_store.py), on the coordinator's node: rollouts and difficulty by problem,
  snapshotted to the state directory every `history.snapshot_interval_s` and at shutdown.
- `NodeEngine` x nodes (service/node_engine.py), one per node, pinned there with a hard node-affinity strategy:
  every GPU node, or every node when the cluster has no GPU (a CPU machine; the embedded default).

The coordinator itself runs in the gateway's process (the Ray driver), not as an actor: it only predicts, places
and relays, and keeping it beside the gateway saves every sample one more hop. Per batch it predicts each group's
length from the difficulty records (scheduler.length; the records are loaded from the store at start and updated
from every sample that passes), places groups on engines longest-predicted first onto the least loaded engine
(scheduler.placement; a group's samples stay together so they share the drafter's live segment), starts each
engine's groups longest first, and merges the engines' streams as samples finish.

Locally `RayBackend.start(config)` starts an embedded single-node cluster; with `address` it joins a running one
(`ray start --head` on the head node, `ray start --address=...` on the others, or KubeRay).

A NodeEngine that dies fails the batches running on it with an error naming it (their finished samples are
delivered; the gateway reports the batch as failed) and leaves the service not ready; Ray does not restart it,
because a half-loaded engine serving silently is worse than a loud failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from das.drafter.records import RolloutRecord
from das.scheduler.difficulty import DifficultyBook, DifficultyFormatError, load_difficulty
from das.scheduler.length import LengthPredictor
from das.scheduler.placement import place_groups
from das.service.api import GroupRequest, ProblemSummary, SampleResult
from das.service.engine.async_engine import EngineConfig, validate_rollouts
from das.service.history_store import HistoryConfig, HistoryShard, shard_of
from das.service.node_engine import NodeEngine
from das.service.rollout_backend import BackendStats, GroupInputError, merge_streams
from das.service.stub_engine import StubEngineConfig

log = logging.getLogger(__name__)

# Passed on to the engine actors' processes, which do not inherit the driver's environment when joining a cluster.
_FORWARDED_ENV = ("VLLM_LOGGING_LEVEL", "VLLM_LOGGING_STREAM", "VLLM_PLUGINS", "DAS_DATA_DIR",
                  "VLLM_CPU_OMP_THREADS_BIND")


def with_length_predictions(predictor: LengthPredictor, groups: Sequence[GroupRequest]) -> list[GroupRequest]:
    """The groups with the scheduler's forecasts, every one with `predicted_tokens` set: a group without it gets
    its problem's predicted mean length (for placement and submission order) and, unless it brought a
    `length_curve`, the curve the draft budget reads every step. A group with `predicted_tokens` of its own keeps
    it and gets no curve, so the caller's prediction is the one the budget uses."""
    forecast = predictor.predict([g.problem_id for g in groups], np.zeros(len(groups), np.int64))
    curves = predictor.curves([g.problem_id for g in groups])
    return [g if g.predicted_tokens else
            g.model_copy(update={"predicted_tokens": float(m), "length_curve": g.length_curve or c})
            for g, m, c in zip(groups, forecast.mean, curves)]


class ServiceConfig(BaseModel):
    """Everything that shapes the service. Exactly one of `engine` (vLLM; its `model` may be a known model name,
    prepared on each node) and `stub_engine` (no model: tests and load tests)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine: EngineConfig | None = None
    stub_engine: StubEngineConfig | None = None
    address: str | None = Field(None, description="Ray cluster to join ('auto', 'HOST:PORT'); None: embedded")
    state_dir: Path | None = Field(None, description="history snapshots; None: history lives in memory only")
    history: HistoryConfig = HistoryConfig()
    stats_interval_s: float = Field(2.0, gt=0, description="seconds between engine and store figure refreshes")
    object_store_mib: int = Field(256, ge=64, description="object store of an embedded cluster, MiB")

    @model_validator(mode="after")
    def _one_engine(self) -> ServiceConfig:
        if (self.engine is None) == (self.stub_engine is None):
            raise ValueError("give exactly one of engine and stub_engine")
        return self


class RayBackend:
    """Use `await RayBackend.start(config)`; `await close()` at the end (snapshots the history)."""

    def __init__(self, config: ServiceConfig, shards: list[Any], nodes: list[Any], started_ray: bool) -> None:
        self.config = config
        self._shards = shards
        self._nodes = nodes
        self._started_ray = started_ray
        self._engines: list[tuple[Any, int, str]] = []  # (node actor, engine index on the node, name)
        self._version = 0
        self._book = DifficultyBook()
        self._predictor = LengthPredictor(self._book)
        self._stats = BackendStats()
        self._loading: asyncio.Task[None] | None = None
        self._background: list[asyncio.Task[None]] = []
        self.load_error: str | None = None  # why the service is not ready: an engine failed to load or died

    # ---- lifecycle ----

    @classmethod
    async def start(cls, config: ServiceConfig, progress: Callable[[str], None] = log.info) -> RayBackend:
        """Connects to (or starts) Ray and creates the actors. The engines load in the background: `ready()` is
        False until every one has loaded (`load_error` says why if one failed)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        started = False
        if not ray.is_initialized():
            env = {k: os.environ[k] for k in _FORWARDED_ENV if k in os.environ}
            kwargs: dict[str, Any] = {"include_dashboard": False, "runtime_env": {"env_vars": env}}
            if config.address is None:
                kwargs["object_store_memory"] = config.object_store_mib << 20
            # "local": always a cluster of our own; with no address Ray would join one that `ray start` left
            # running on this machine.
            ray.init(address=config.address or "local", **kwargs)
            started = True
        here = ray.get_runtime_context().get_node_id()
        state_dir = str(config.state_dir.resolve()) if config.state_dir is not None else None
        shard_actor = ray.remote(HistoryShard)
        shards = [shard_actor.options(num_cpus=0, name=None, scheduling_strategy=NodeAffinitySchedulingStrategy(
            here, soft=True)).remote(i, config.history, state_dir) for i in range(config.history.shards)]

        alive = [n for n in ray.nodes() if n["Alive"]]
        gpu_nodes = [n for n in alive if n["Resources"].get("GPU", 0) > 0]
        node_actor = ray.remote(NodeEngine)
        nodes = []
        for n in gpu_nodes or alive:
            gpus = int(n["Resources"].get("GPU", 0))
            name = n["NodeManagerAddress"] if len(alive) == 1 else f"{n['NodeManagerAddress']}:{n['NodeID'][:6]}"
            engine = config.engine or config.stub_engine
            assert engine is not None
            nodes.append(node_actor.options(
                num_cpus=0, num_gpus=gpus, max_concurrency=1000,
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False),
            ).remote(name, engine, shards, max(gpus, 1)))
        backend = cls(config, shards, nodes, started)
        await backend._load_difficulty()
        progress(f"{len(shards)} history shards, {len(nodes)} node engine actors; loading engines")
        backend._loading = asyncio.create_task(backend._load_engines(progress))
        backend._background = [asyncio.create_task(backend._every(config.stats_interval_s, backend.refresh_stats)),
                               asyncio.create_task(backend._every(config.history.snapshot_interval_s,
                                                                  backend._snapshot))]
        return backend

    async def _load_engines(self, progress: Callable[[str], None]) -> None:
        try:
            names = await asyncio.gather(*(node.start.remote() for node in self._nodes))
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.error("an engine failed to load: %s", self.load_error)
            return
        self._engines = [(node, i, name) for node, node_names in zip(self._nodes, names)
                         for i, name in enumerate(node_names)]
        await self.refresh_stats()
        progress(f"{len(self._engines)} engines ready: {', '.join(n for _, _, n in self._engines)}")

    async def _load_difficulty(self) -> None:
        blobs = await asyncio.gather(*(s.difficulty_blobs.remote() for s in self._shards))
        for shard_blobs in blobs:
            for pid, blob in shard_blobs.items():
                try:
                    self._book.put(load_difficulty(blob))
                except (DifficultyFormatError, ValueError) as exc:
                    log.warning("difficulty record of %s skipped: %s", pid, exc)

    async def wait_ready(self) -> None:
        """Returns once every engine has loaded; RuntimeError if one failed."""
        if self._loading is not None:
            await asyncio.shield(self._loading)
        if self.load_error is not None:
            raise RuntimeError(f"an engine failed to load: {self.load_error}")

    async def close(self) -> None:
        """Snapshots the history, stops the engines and the actors (and Ray, if this backend started it)."""
        import ray

        for task in (*self._background, *([self._loading] if self._loading else [])):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        try:
            written = await asyncio.gather(*(s.snapshot.remote(True) for s in self._shards))
            log.info("history snapshots: %s", [w for w in written if w])
        except Exception:
            log.exception("history snapshot at shutdown failed")
        await asyncio.gather(*(node.close.remote() for node in self._nodes), return_exceptions=True)
        for actor in (*self._nodes, *self._shards):
            ray.kill(actor)
        if self._started_ray:
            ray.shutdown()

    # ---- RolloutBackend ----

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def engine_names(self) -> list[str]:
        return [name for _, _, name in self._engines]

    async def ready(self) -> bool:
        return bool(self._engines) and self._loading is not None and self._loading.done() \
            and self.load_error is None

    async def check(self, groups: Sequence[GroupRequest]) -> None:
        node = self._engines[0][0]
        refused = await node.check.remote(list(groups))
        if refused is not None:
            raise GroupInputError(*refused)

    def place(self, groups: Sequence[GroupRequest]) -> list[list[tuple[int, GroupRequest]]]:
        """Per engine, the (batch index, group) pairs it runs, longest predicted first (`with_length_predictions`
        tags the groups)."""
        tagged = with_length_predictions(self._predictor, groups)
        placement = place_groups([g.n * float(g.predicted_tokens) for g in tagged], len(self._engines))
        return [[(int(i), tagged[int(i)]) for i in order] for order in placement.order]

    async def generate(self, groups: Sequence[GroupRequest]) -> AsyncGenerator[tuple[int, SampleResult], None]:
        import ray

        placed = [(engine, items) for engine, items in zip(self._engines, self.place(groups)) if items]
        generators = [node.run.remote(local, items) for (node, local, _), items in placed]
        names = [name for (_, _, name), _ in placed]

        async def relay(generator: Any, engine: str) -> AsyncIterator[tuple[int, SampleResult]]:
            try:
                async for ref in generator:
                    for item in await ref:
                        yield item
            except ray.exceptions.RayActorError as exc:
                self.load_error = f"engine {engine} died"
                log.error("engine %s died; the service is no longer ready: %s", engine, exc)
                raise RuntimeError(f"engine {engine} died: {exc}") from None

        try:
            async with contextlib.aclosing(merge_streams([relay(g, n) for g, n in zip(generators, names)])) as merged:
                async for index, sample in merged:
                    if sample.finish_reason in ("stop", "length"):
                        self._book.history(sample.problem_id).add_length(sample.policy_version,
                                                                         len(sample.token_ids),
                                                                         sample.finish_reason)
                    yield index, sample
        finally:
            for generator in generators:
                ray.cancel(generator)

    async def reload_weights(self, path: str | os.PathLike[str], version: int) -> int:
        versions = await asyncio.gather(*(node.reload_weights.remote(str(path), version) for node in self._nodes))
        self._version = int(versions[0])
        return self._version

    async def add_history(self, records: list[dict[str, Any]]) -> int:
        validate_rollouts(records)
        by_shard: dict[int, list[dict[str, Any]]] = {}
        for record in records:
            by_shard.setdefault(shard_of(record["problem_id"], len(self._shards)), []).append(record)
        counts = await asyncio.gather(*(self._shards[s].put.remote("import", rs) for s, rs in by_shard.items()))
        for record in sorted(records, key=lambda r: r["policy_version"]):
            self._book.add_record(RolloutRecord.from_dict(record))
        return int(sum(counts))

    async def history(self, problem_id: str) -> ProblemSummary | None:
        shard = self._shards[shard_of(problem_id, len(self._shards))]
        summary: ProblemSummary | None = await shard.summary.remote(problem_id)
        return summary

    def stats(self) -> BackendStats:
        return self._stats

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
        """Reads every node's and shard's figures now (the background job does it every stats_interval_s)."""
        nodes = await asyncio.gather(*(node.stats.remote() for node in self._nodes)) if self._engines else []
        shards = await asyncio.gather(*(s.stats.remote() for s in self._shards))
        self._stats = BackendStats(
            engines=tuple(load for n in nodes for load in n.engines), engines_ready=len(self._engines),
            history_problems=sum(s.problems for s in shards), history_tokens=sum(s.output_tokens for s in shards),
            resident_bytes={"history_store": sum(s.resident_bytes for s in shards),
                            "node_engine": sum(n.resident_bytes for n in nodes)})

    async def _snapshot(self) -> None:
        await asyncio.gather(*(s.snapshot.remote() for s in self._shards))

