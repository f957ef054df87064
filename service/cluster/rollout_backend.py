"""What the HTTP gateway talks to: `RolloutBackend`, and `EngineBackend`: one in-process `Engine`
(service/engine/protocol.py), no Ray and no history store (embedding in a single process; over a `StubEngine`, the
backend of the gateway's tests and load tests).

The Ray service (service/cluster/coordinator.py `RayBackend`) implements the same protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from das.service.cluster.group_aborts import GroupAborts
from das.service.cluster.group_streams import merge_groups
from das.service.cluster.history_store import ShardStats
from das.service.engine.contract import EngineInputError, EngineTally, StepPartTotals
from das.service.engine.control import apply_control
from das.service.engine.protocol import Engine
from das.service.engine.runner_choice import RunnerChoice
from das.service.wire.api import GroupRequest, ProblemSummary, SampleResult
from das.service.wire.engine_control import EngineControl
from das.service.wire.sample_progress import SampleProgress
from das.service.wire.weight_transfer import TransferBackend


ProgressSink = Callable[[int, SampleProgress], None]
"""Hears a batch's token progress: (index of the group in the batch, the sample's new tokens). Called on the event
loop, so it must not block."""


class GroupInputError(EngineInputError):
    """A batch refused before anything ran, because of group `group_index`; the message names the field."""

    def __init__(self, group_index: int, message: str) -> None:
        super().__init__(message)
        self.group_index = group_index


class HistoryUnavailable(Exception):
    """The backend keeps no history store (GET /v1/history answers 501)."""


class WeightUpdateConflict(Exception):
    """A weight-transfer call out of turn (an update already open, none open, the engines changed since the group
    was formed): nothing was done (409)."""


@dataclass(frozen=True)
class EngineLoad:
    """One engine's counters and proposer cost at its latest report: `tally`, its queues, steps, prefix-cache and
    verified draft counts (EngineTally, whatever the speculative method); speculate times in seconds (None: the
    engine does not run our proposer); `drafts_by_source`: source kind -> (draft tokens proposed, accepted) by our
    proposer since the engine started; `step_cost`: the live cost fit (budget_hook.PolicyBudget.stats);
    `runner`: what vLLM runs (None: a stand-in engine); `step_parts`: the timed steps' parts (`profile_steps`)."""

    engine: str
    tally: EngineTally = field(default_factory=EngineTally)
    speculate_p50_s: float | None = None
    speculate_p99_s: float | None = None
    drafts_by_source: dict[str, tuple[int, int]] = field(default_factory=dict)
    step_cost: dict[str, Any] = field(default_factory=dict)
    runner: RunnerChoice | None = None
    step_parts: StepPartTotals = field(default_factory=StepPartTotals)

    @classmethod
    def of(cls, engine: str, tally: EngineTally, drafter: dict[str, Any] | None = None,
           runner: RunnerChoice | None = None, step_parts: StepPartTotals | None = None) -> EngineLoad:
        """An engine's load from its tally and its proposer's `stats()` (DasProposer.stats; None or empty: it
        runs no proposer)."""
        drafter = drafter or {}
        p50, p99 = drafter.get("step_us_p50"), drafter.get("step_us_p99")
        by_source = {kind: (c["proposed"], c["accepted"]) for kind, c in drafter.get("by_source", {}).items()}
        return cls(engine, replace(tally), p50 / 1e6 if p50 is not None else None,
                   p99 / 1e6 if p99 is not None else None, by_source, drafter.get("cost", {}), runner,
                   step_parts or StepPartTotals())


@dataclass(frozen=True)
class BackendStats:
    """What /metrics shows of the backend, as of its latest refresh (a few seconds old at most; the engine failure
    figures are current). `engines_ready`: engines serving now. `resident_bytes`: memory by component (history_store,
    node_engine), summed over that component's processes. `engine_restarts`: per engine, restarts after a death
    since the service started; `samples_redispatched`: samples a dead engine owed that were run again on another (or
    the restarted) engine; `samples_given_up`: samples ended with an error instead, their group having run through
    `FailureConfig.max_group_deaths` engine deaths; `engine_recovery_s`: per engine, seconds from its latest
    death noticed to serving again. `history_outbox_records`: finished rollouts the engine actors hold because no
    history snapshot has them yet (lost if their actor dies); `history_records_given_up`: rollouts the engine actors
    dropped (an outbox over its token cap while a shard stayed down, or a record a shard refused), summed over the
    actors' current processes. `engine_placed_tokens`: per engine, the predicted output tokens of the samples placed
    there that have not reached the client (current; what placement balances). `engine_load_failures`: per (engine,
    reason) the loads that failed since the service started (service/cluster/load_failure.py: the reason says whether
    a retry could mend it); `engines_failed`: per engine that stays down, why (its cause and what to do).
    `engine_stream_items`: Ray objects received from the engine actors' streams since the start (each carries up to
    64 finished samples, or a progress report: the coordinator's per-event work); `placement_s` / `placements`:
    seconds spent placing groups on engines, and the placements (one per batch, plus one per re-dispatch after a
    death)."""

    engines: tuple[EngineLoad, ...] = ()
    engines_ready: int = 0
    history_problems: int = 0
    history_tokens: int = 0
    history_shards: tuple[ShardStats, ...] = ()  # in shard order: snapshot health (fallbacks, age)
    resident_bytes: dict[str, int] = field(default_factory=dict)
    engine_restarts: dict[str, int] = field(default_factory=dict)
    samples_redispatched: int = 0
    samples_given_up: int = 0
    engine_recovery_s: dict[str, float] = field(default_factory=dict)
    history_outbox_records: int = 0
    history_records_given_up: int = 0
    engine_placed_tokens: dict[str, float] = field(default_factory=dict)
    engine_load_failures: dict[tuple[str, str], int] = field(default_factory=dict)
    engines_failed: dict[str, str] = field(default_factory=dict)
    engine_stream_items: int = 0
    placement_s: float = 0.0
    placements: int = 0


class RolloutBackend(Protocol):
    """Runs batches of groups. Every method may be called concurrently from one event loop."""

    @property
    def policy_version(self) -> int:
        """The version of the weights that new samples are drawn from."""
        ...

    async def ready(self) -> bool:
        """True once the engines have loaded and while batches can run (at least one engine serves)."""
        ...

    async def live(self) -> bool:
        """False once the backend cannot serve again without a restart of the process (/healthz fails)."""
        ...

    async def check(self, groups: Sequence[GroupRequest]) -> None:
        """Raises GroupInputError for the first group the backend would refuse; schedules nothing."""
        ...

    def generate(self, groups: Sequence[GroupRequest], on_progress: ProgressSink | None = None,
                 aborts: GroupAborts | None = None) -> AsyncGenerator[tuple[int, SampleResult], None]:
        """Every sample of every group exactly once, as (index of its group in `groups`, sample), in finishing
        order. `on_progress` (optional) hears each sample's tokens while it runs (service/wire/sample_progress.py: at
        most every ~50 ms per engine, contiguous per sample, its result holding them all). Closing the iterator
        early aborts the samples still running. A group aborted through `aborts` (service/cluster/group_aborts.py)
        stops on its engine and its samples not delivered yet come with finish_reason "abort"; the others run on."""
        ...

    async def history(self, problem_id: str) -> ProblemSummary | None:
        """What the history store holds for a problem (None: nothing). HistoryUnavailable without a store."""
        ...

    def stats(self) -> BackendStats:
        """The latest engine and history figures; cheap (no I/O), called at every scrape."""
        ...

    async def control(self, message: EngineControl) -> Any:
        """A control verb (service/wire/engine_control.py) on every engine, its replies combined as the verb says.

        vLLM's RL control plane: Pause "abort" ends the samples in flight with finish_reason "abort" (delivered with
        the tokens they had), "wait" returns once they have finished, "keep" freezes them until Resume; in every
        mode samples that start meanwhile are held until Resume. AbortSamples ends every sample in flight without
        pausing (its batch goes on). ValueError for what an engine refuses.

        ReloadWeights loads a checkpoint directory as the policy version given once running samples have finished
        (at once while paused); EngineInputError for a bad path or version. AddHistory imports finished rollouts for
        drafting (where the backend keeps a history store, into the store); EngineInputError naming the record and
        field if any is invalid (then none is stored).

        vLLM's weight transfer (docs/design.md "vLLM's RL control plane"): a push is StartWeightUpdate, UpdateWeights
        (one or more), FinishWeightUpdate, after InitWeightTransfer has formed the trainer's group (laid out trainer
        first, then engine by engine); AbortWeightUpdate gives an open push up everywhere, ShutdownWeightTransfer
        leaves the group. A step out of turn (a push already open, none open, the engines changed since the group
        was formed) raises WeightUpdateConflict and does nothing; a step that fails gives the push up everywhere and
        nothing is loaded (gloo): EngineInputError for refused init info, name, shape or dtype, else RuntimeError
        naming the cause. EnginesDisagree where the engines' replies must agree and do not."""
        ...

    # vLLM's weight transfer: what the routes ask before any step (the steps are control messages)

    @property
    def weight_transfer(self) -> TransferBackend | None:
        """The backend the engines were started with; None: no transfer (the routes answer 501)."""
        ...

    def transfer_world_size(self) -> int:
        """Model workers of every serving engine (vLLM's /get_world_size)."""
        ...


async def merge_batches(streams: Sequence[AsyncIterator[Any]], max_items: int, min_interval_s: float = 0.0
                        ) -> AsyncGenerator[list[Any], None]:
    """The items of all `streams` in the order they arrive, in lists of what is ready at once (1 to `max_items`
    items). With `min_interval_s`, a list follows the start, or the previous list, by at least that many seconds
    unless `max_items` are waiting or every stream has ended: items that arrive in between travel together (fewer,
    fuller lists; an item waits `min_interval_s` at most, and the last ones do not wait: a run shorter than the
    interval is one list). The first stream to raise ends the merge with its exception; closing the merge (or an
    error) cancels every stream still running and waits for them."""
    loop = asyncio.get_running_loop()
    last = loop.time()  # when the previous list was yielded, or the merge started
    done = object()  # a stream's end marker in the merged queue
    merged: asyncio.Queue[Any] = asyncio.Queue()
    ended = 0  # streams that have ended (put their marker or their error)
    wake = asyncio.Event()  # set when a full list waits or every stream has ended: the interval is cut short

    async def pump(stream: AsyncIterator[Any]) -> None:
        nonlocal ended
        try:
            async for item in stream:
                merged.put_nowait(item)
                if merged.qsize() + 1 >= max_items:
                    wake.set()
            merged.put_nowait(done)
        except Exception as exc:  # handed to the consumer, which owns the error
            merged.put_nowait(exc)
        ended += 1
        if ended == len(streams):
            wake.set()

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        running = len(tasks)
        while running:
            ready = [await merged.get()]
            wait = last + min_interval_s - loop.time()
            if wait > 0 and merged.qsize() + 1 < max_items and ended < len(streams):
                wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), wait)
            while len(ready) < max_items and not merged.empty():
                ready.append(merged.get_nowait())
            items = []
            for item in ready:
                if item is done:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    items.append(item)
            if items:
                yield items
                last = loop.time()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class EngineBackend:
    """One in-process `Engine`; runs all groups of a batch at once and merges their streams in finishing order
    (service/cluster/group_streams.py: a reader task per group, one queue per batch). `name`: the engine's name in
    the stats and on its samples (SampleResult.engine), as an engine actor names its engines. No weight transfer
    (`weight_transfer` None: the routes answer 501): forming the trainer's group over engines is the Ray service's
    (service/cluster/weight_relay.py)."""

    name = "local"
    weight_transfer: TransferBackend | None = None

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    async def ready(self) -> bool:
        # An engine exists only once it has loaded (service/engine/factory.py `create_engine`).
        return True

    async def live(self) -> bool:
        # One in-process engine is not restarted: once its core has died, only a restart of the process helps.
        return not self.engine.dead

    async def check(self, groups: Sequence[GroupRequest]) -> None:
        for i, group in enumerate(groups):
            try:
                self.engine.prompt_token_ids(group)
            except EngineInputError as exc:
                raise GroupInputError(i, str(exc)) from None

    def generate(self, groups: Sequence[GroupRequest], on_progress: ProgressSink | None = None,
                 aborts: GroupAborts | None = None) -> AsyncGenerator[tuple[int, SampleResult], None]:
        def open_stream(index: int, group: GroupRequest) -> AsyncIterator[SampleResult]:
            report = None if on_progress is None else functools.partial(on_progress, index)
            return self.engine.generate(group, report)

        return merge_groups(groups, open_stream, self.name, aborts, lambda: self.engine.policy_version)

    async def history(self, problem_id: str) -> ProblemSummary | None:
        raise HistoryUnavailable("no history store: one in-process engine keeps its history inside its drafter only")

    def stats(self) -> BackendStats:
        # the proposer's figures need an await on the engine (a scrape is synchronous): queues and prefix cache only
        return BackendStats(engines=(EngineLoad.of(self.name, self.engine.tally),), engines_ready=1)

    async def control(self, message: EngineControl) -> Any:
        return await apply_control([self.engine], message)

    def transfer_world_size(self) -> int:
        return 0
