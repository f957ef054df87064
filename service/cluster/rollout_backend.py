"""What the HTTP gateway talks to: `RolloutBackend`, with two implementations here.

- `EngineBackend`: one in-process `Engine` (service/engine/protocol.py), no Ray and no history store (embedding in a
  single process).
- `StubBackend`: precomputed samples and no model, for tests and load tests of the gateway.

The Ray service (service/cluster/coordinator.py `RayBackend`) implements the same protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from das.service.engine.pause_gate import PauseGate
from das.service.cluster.group_aborts import GroupAborts, abortable
from das.service.cluster.history_store import ShardStats
from das.service.engine.contract import EngineInputError, EngineTally, StepPartTotals, validate_rollouts
from das.service.engine.control import apply_control
from das.service.engine.protocol import Engine
from das.service.engine.runner_choice import RunnerChoice
from das.service.wire.api import GroupRequest, PauseMode, ProblemSummary, SampleResult, ToolCall
from das.service.wire.engine_control import EngineControl
from das.service.wire.sample_progress import SampleProgress
from das.service.wire.weight_transfer import TransferBackend


ProgressSink = Callable[[int, SampleProgress], None]
"""Hears a batch's token progress: (index of the group in the batch, the sample's new tokens). Called on the event
loop, so it must not block."""
# (group, a sample's text, its token ids) -> (content, tool calls): what an engine's tool-call parsing returns
ToolParsing = Callable[[GroupRequest, str, Sequence[int]], tuple[str | None, list[ToolCall]]]


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

    async def reload_weights(self, path: str | os.PathLike[str], version: int) -> int:
        """Loads the checkpoint directory `path` as policy `version` once running samples have finished; returns
        the version now served. EngineInputError for a bad path or version."""
        ...

    async def add_history(self, records: list[dict[str, Any]]) -> int:
        """Imports finished rollouts (history-format dicts) for drafting; returns how many were stored.
        EngineInputError naming the record and field if any is invalid (then none is stored)."""
        ...

    async def history(self, problem_id: str) -> ProblemSummary | None:
        """What the history store holds for a problem (None: nothing). HistoryUnavailable without a store."""
        ...

    def stats(self) -> BackendStats:
        """The latest engine and history figures; cheap (no I/O), called at every scrape."""
        ...

    async def control(self, message: EngineControl) -> Any:
        """vLLM's RL control verb (service/wire/engine_control.py) on every engine, its replies combined. Pause:
        "abort" ends the samples in flight with finish_reason "abort" (delivered with the tokens they had), "wait"
        returns once they have finished, "keep" freezes them until Resume; in every mode samples that start
        meanwhile are held until Resume. AbortSamples ends every sample in flight without pausing (its batch goes
        on). ValueError for what an engine refuses."""
        ...

    # vLLM's weight transfer (docs/design.md "vLLM's RL control plane"): a push is start, update(s), finish.

    @property
    def weight_transfer(self) -> TransferBackend | None:
        """The backend the engines were started with; None: no transfer (the routes answer 501)."""
        ...

    def transfer_world_size(self) -> int:
        """Model workers of every serving engine (vLLM's /get_world_size)."""
        ...

    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """Every serving engine's workers join the trainer's group, laid out trainer first, then engine by engine.
        EngineInputError for init info that cannot form the group."""
        ...

    async def start_weight_update(self) -> None:
        """Opens a push: each engine waits for its running samples unless paused. WeightUpdateConflict when the
        engines are not those of the group."""
        ...

    async def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Every engine receives one chunk (staged). On any failure the push is given up everywhere and nothing
        is loaded (gloo): EngineInputError for a refused name, shape or dtype, else RuntimeError naming the cause."""
        ...

    async def finish_weight_update(self, version: int) -> int:
        """Every engine loads what it received and serves it as `version`; the push ends. Returns the version."""
        ...

    async def abort_weight_update(self) -> None:
        """Gives the open push up everywhere, if any."""
        ...

    async def shutdown_weight_transfer(self) -> None:
        """The engines leave the trainer's group."""
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


async def merge_streams(streams: Sequence[AsyncIterator[Any]]) -> AsyncGenerator[Any, None]:
    """`merge_batches` one item at a time."""
    async with contextlib.aclosing(merge_batches(streams, 1)) as batches:
        async for (item,) in batches:
            yield item


class NoWeightTransfer:
    """The weight-transfer part of `RolloutBackend` for a backend without it (the routes answer 501 before any of
    these is called): the stub, and one in-process engine (the transfer is the Ray service's)."""

    weight_transfer: TransferBackend | None = None

    def transfer_world_size(self) -> int:
        return 0

    async def init_weight_transfer(self, init_info: dict[str, Any]) -> None:
        raise WeightUpdateConflict("this backend has no weight transfer")

    async def start_weight_update(self) -> None:
        raise WeightUpdateConflict("this backend has no weight transfer")

    async def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        raise WeightUpdateConflict("this backend has no weight transfer")

    async def finish_weight_update(self, version: int) -> int:
        raise WeightUpdateConflict("this backend has no weight transfer")

    async def abort_weight_update(self) -> None:
        pass

    async def shutdown_weight_transfer(self) -> None:
        pass


class EngineBackend(NoWeightTransfer):
    """One in-process `Engine`; runs all groups of a batch at once and merges their streams in finishing order."""

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

    async def generate(self, groups: Sequence[GroupRequest], on_progress: ProgressSink | None = None,
                       aborts: GroupAborts | None = None) -> AsyncGenerator[tuple[int, SampleResult], None]:
        async def indexed(index: int, group: GroupRequest) -> AsyncIterator[tuple[int, SampleResult]]:
            report = None if on_progress is None else lambda progress: on_progress(index, progress)
            samples = abortable(self.engine.generate(group, report), group,
                                aborts.event(index) if aborts is not None else None,
                                lambda: self.engine.policy_version)
            async for sample in samples:
                yield index, sample

        async with contextlib.aclosing(merge_streams([indexed(i, g) for i, g in enumerate(groups)])) as merged:
            async for item in merged:
                yield item

    async def reload_weights(self, path: str | os.PathLike[str], version: int) -> int:
        return await self.engine.reload_weights(path, version)

    async def add_history(self, records: list[dict[str, Any]]) -> int:
        return await self.engine.add_history(records)

    async def history(self, problem_id: str) -> ProblemSummary | None:
        raise HistoryUnavailable("one in-process engine keeps its history inside its drafter only")

    def stats(self) -> BackendStats:
        # the proposer's figures need an await on the engine (a scrape is synchronous): queues and prefix cache only
        return BackendStats(engines=(EngineLoad.of("local", self.engine.tally),), engines_ready=1)

    async def control(self, message: EngineControl) -> Any:
        return await apply_control([self.engine], message)


class StubBackend(NoWeightTransfer):
    """Precomputed samples, no model. Each group yields its n samples of `output_tokens` tokens (capped by the
    group's max_tokens), interleaved across groups (sample 0 of every group, then sample 1, ...).

    Timing: the first sample `first_delay_s` seconds after `generate` starts, then one every `interval_s` seconds
    (emitted in bursts when the event loop's timer is coarser); with both 0 as fast as possible. When
    `log_emissions` is set, `emissions` records (group index, sample index, time.perf_counter()) of every
    sample at the moment it is yielded, so a load test can measure the latency added downstream.

    `max_prompt_tokens` refuses longer prompts like an engine with that context (prompt_token_ids count tokens;
    text counts whitespace-separated words), and stop token ids outside `vocab_size` are refused like the engine
    does; everything else an engine refuses the API's own bounds refuse (service/wire/api.py). `runs` counts `generate`
    calls, `received` keeps the groups of each. With `on_progress`, each sample's tokens but its last are reported
    in `progress_reports` pieces just before it is emitted.

    `text`: every sample's text (None: no tokenizer ran, as the stub engine); `tool_parsing`, given a text, is
    what an engine applies to it for a group naming a tool_parser (service/engine/vllm/tool_calls.py's
    `ToolCallParsing.parse`, which tests pass in: this layer loads no vLLM), so the route's tool-call path runs on a
    text the test chose.

    Pause as an engine does (`RolloutBackend.control` with a Pause), per emission: a batch that starts while paused
    waits for `resume`; under "keep" no sample is emitted until `resume`; "abort" ends the samples not yet emitted with
    finish_reason "abort" and no tokens; "wait" returns once the batches running have ended. A group aborted
    through `generate`'s `aborts` ends its samples not yet emitted the same way.
    """

    def __init__(self, *, output_tokens: int = 16, first_delay_s: float = 0.0, interval_s: float = 0.0,
                 max_prompt_tokens: int | None = None, ready: bool = True, log_emissions: bool = False,
                 vocab_size: int = 32000, progress_reports: int = 4, text: str | None = None,
                 tool_parsing: ToolParsing | None = None) -> None:
        self.output_tokens = output_tokens
        self.text = text
        self.tool_parsing = tool_parsing
        self.progress_reports = progress_reports
        self.first_delay_s = first_delay_s
        self.interval_s = interval_s
        self.max_prompt_tokens = max_prompt_tokens
        self.runs = 0
        self.received: list[list[GroupRequest]] = []
        self.history_records = 0
        self.emissions: list[tuple[int, int, float]] | None = [] if log_emissions else None
        self._ready = ready
        self._version = 0
        self._vocab_size = vocab_size
        self._tokens = [(7 * i + 3) % vocab_size for i in range(output_tokens)]
        self._logprobs = [-0.5] * output_tokens
        self._gate = PauseGate()
        self._running = 0
        self._unemitted = 0  # samples of running batches not emitted yet

    @property
    def policy_version(self) -> int:
        return self._version

    def mark_ready(self) -> None:
        self._ready = True

    async def ready(self) -> bool:
        return self._ready

    async def live(self) -> bool:
        return True

    async def check(self, groups: Sequence[GroupRequest]) -> None:
        for i, group in enumerate(groups):
            outside = [t for t in group.sampling.stop_token_ids if t >= self._vocab_size]
            if outside:
                raise GroupInputError(i, f"sampling.stop_token_ids: {outside[0]} is outside the vocabulary "
                                         f"[0, {self._vocab_size})")
            if self.max_prompt_tokens is None:
                continue
            if group.prompt_token_ids is not None:
                length = len(group.prompt_token_ids)
            elif group.prompt is not None:
                length = len(group.prompt.split())
            else:
                length = sum(len((m.content or "").split()) for m in group.messages or ())
            if length >= self.max_prompt_tokens:
                raise GroupInputError(i, f"prompt is {length} tokens; the context holds {self.max_prompt_tokens} "
                                         f"and at least one output token must fit")

    async def generate(self, groups: Sequence[GroupRequest], on_progress: ProgressSink | None = None,
                       aborts: GroupAborts | None = None) -> AsyncGenerator[tuple[int, SampleResult], None]:
        self.runs += 1
        self.received.append(list(groups))
        epoch = await self._gate.admit()
        order = [(gi, j) for j in range(max((g.n for g in groups), default=0))
                 for gi, g in enumerate(groups) if j < g.n]
        templates = [self._template(g) for g in groups]
        paced = self.first_delay_s > 0 or self.interval_s > 0
        start = time.perf_counter()
        self._running += 1
        self._unemitted += len(order)
        emitted = 0
        try:
            for k, (gi, j) in enumerate(order):
                if paced:
                    wait = start + self.first_delay_s + k * self.interval_s - time.perf_counter()
                    if wait > 0:
                        await asyncio.sleep(wait)
                elif k % 64 == 63:
                    await asyncio.sleep(0)  # unpaced: still let the loop write what is ready to the sockets
                await self._gate.unfrozen(epoch)
                update: dict[str, Any] = {"sample_index": j, "total_s": time.perf_counter() - start}
                if self._gate.abort_epoch != epoch or (aborts is not None and aborts.aborted(gi)):
                    update.update(token_ids=[], logprobs=[], finish_reason="abort", accepted_tokens=0,
                                  draft_tokens=0, decode_steps=0)
                sample = templates[gi].model_copy(update=update)
                if on_progress is not None:
                    self._report(gi, sample, on_progress)
                if self.emissions is not None:
                    self.emissions.append((gi, j, time.perf_counter()))
                self._unemitted -= 1
                emitted += 1
                yield gi, sample
        finally:
            self._unemitted -= len(order) - emitted
            self._running -= 1
            self._gate.notify()

    def _report(self, group_index: int, sample: SampleResult, on_progress: ProgressSink) -> None:
        """The sample's tokens but its last, as `progress_reports` progress reports (as an engine reports a sample
        before its result)."""
        shown = len(sample.token_ids) - 1
        step = max(1, -(-shown // self.progress_reports))
        for at in range(0, shown, step):
            end = min(at + step, shown)
            on_progress(group_index, SampleProgress(sample.sample_index, at, sample.token_ids[at:end],
                                                    sample.logprobs[at:end], "", sample.policy_version))

    def _template(self, group: GroupRequest) -> SampleResult:
        """The group's samples differ only in index and time: each is a shallow copy of this one (they share
        its token and logprob lists), because building a pydantic model per sample would cost the load test
        time in the gateway's process that a real engine spends elsewhere."""
        length = min(self.output_tokens, group.sampling.max_tokens)
        accepted = length // 4
        content, calls = None, None
        if group.tool_parser is not None and self.tool_parsing is not None and self.text is not None:
            content, calls = self.tool_parsing(group, self.text, self._tokens[:length])
        return SampleResult.model_construct(
            problem_id=group.problem_id, sample_index=0, token_ids=self._tokens[:length],
            logprobs=self._logprobs[:length], finish_reason="length" if length < self.output_tokens else "stop",
            policy_version=self._version, draft_tokens=length // 2, accepted_tokens=accepted,
            decode_steps=length - accepted, first_token_s=None, total_s=0.0, error=None, text=self.text, engine="stub-0",
            prompt_token_ids=list(group.prompt_token_ids) if group.prompt_token_ids is not None else None,
            tool_calls=calls, content=content)

    async def reload_weights(self, path: str | os.PathLike[str], version: int) -> int:
        if version <= self._version:
            raise EngineInputError(f"version: {version} is not newer than the served {self._version}")
        self._version = version
        return version

    async def add_history(self, records: list[dict[str, Any]]) -> int:
        # the engine's checks, so tests see the engine's errors; off the loop, as the coordinator runs them
        await asyncio.to_thread(validate_rollouts, records)
        self.history_records += len(records)
        return len(records)

    async def history(self, problem_id: str) -> ProblemSummary | None:
        raise HistoryUnavailable("the stub backend keeps no history")

    def stats(self) -> BackendStats:
        """One synthetic engine, so every engine series of /metrics exists with the stub too; its placed tokens are
        the samples not yet emitted at the stub's output length."""
        return BackendStats(engines=(EngineLoad("stub-0", speculate_p50_s=0.0,
                                                speculate_p99_s=0.0, drafts_by_source={"live": (0, 0)}),),
                            engines_ready=1 if self._ready else 0, resident_bytes={"node_engine": 0},
                            engine_placed_tokens={"stub-0": float(self._unemitted * self.output_tokens)})

    async def control(self, message: EngineControl) -> Any:
        """As one engine: the verb on this backend's own pause, resume, is_paused and abort_samples."""
        return await apply_control([self], message)

    async def pause(self, mode: PauseMode = "abort", clear_cache: bool = True) -> None:
        self._gate.pause(mode)
        if mode == "wait":
            await self._gate.until(lambda: not self._running)

    async def resume(self) -> None:
        self._gate.resume()

    async def is_paused(self) -> bool:
        return self._gate.mode is not None

    async def abort_samples(self) -> int:
        aborted = self._unemitted
        self._gate.abort()
        return aborted
