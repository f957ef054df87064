"""`Dispatcher`: a batch's groups placed on the serving engines, run there and merged back into one stream (the
coordinator, service/cluster/coordinator.py `RayBackend`, composes it with the engine supervision).

Per batch it predicts each group's length from the difficulty records (scheduler.length; `with_length_predictions`),
places groups on engines longest-predicted first onto the least loaded engine (scheduler.placement; a group's samples
stay together so they share the drafter's live segment), starts each engine's groups longest first, and merges the
streams as samples finish, recording each finished length in the difficulty book. Placement, load and failure go
per engine; the Ray work goes per engine actor: one run call and one stream for all the engines an actor hosts in
the batch (`NodeEngine.run`), so an actor hosting many stub engines costs the coordinator what one engine does. An
engine's load counts every batch running at once (`PlacedWork`): the predicted output tokens of the samples placed
there that have not arrived, so batches of one group each (a trainer that sends a request per prompt, as
OpenAI-style clients do) spread over the engines instead of all landing on the first; and a problem whose samples
already run on an engine gets its next groups there, so siblings from separate requests share the live segment
too. A session's turns (groups with a session_id, service/cluster/sessions.py) go to the engine holding the
session's prefix while it serves and is not overloaded, and idle sessions' predicted remaining work counts in their
engine's load (`attach_sessions`).

Invariants: every sample index of a batch reaches the caller exactly once. The samples a dead engine owed that had
not arrived run again elsewhere as a group with n = their count, renumbered back to the missing indices
(service/cluster/engine_failure.py `Share`), each resuming from the tokens it had delivered (the engines report each
sample's new tokens every `stream_interval`); a group that ran through `max_group_deaths` deaths ends with errors
instead; each death travels with the samples it moved (SampleResult.engine_deaths: the engine, the time), for
their trace, and each sample keeps its trace parent through a re-dispatch (GroupRequest.trace_parents). Every
sample is held in `PlacedWork` once from its placement until it arrives or its job ends. The engines
and their deaths are the supervisor's (service/cluster/engine_supervisor.py): dispatch reports a death it sees and
re-places what the engine owed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import replace

import numpy as np

from das.scheduler.difficulty import DifficultyBook
from das.scheduler.length import LengthPredictor
from das.scheduler.placement import place_groups
from das.service.cluster.engine_failure import GivenUpPrompts, Share
from das.service.cluster.engine_supervisor import ActorRecord, EngineRef, EngineSupervisor, ServedPolicy, lost_errors
from das.service.cluster.group_aborts import GroupAborts, aborted_sample
from das.service.cluster.node_engine import PROGRESS_INTERVAL_S
from das.service.cluster.rollout_backend import BackendStats, ProgressSink
from das.service.cluster.sessions import SessionBook
from das.service.config import ServiceConfig
from das.service.engine.pause_gate import PauseGate
from das.service.wire.api import GroupRequest, LengthCurveSpec, SampleResult
from das.service.wire.sample_progress import SampleProgress

log = logging.getLogger(__name__)

# The longest interval between an actor's stream items (`stream_interval`): a finished sample waits on its actor this
# long at most, whatever the number of actors.
_MAX_STREAM_INTERVAL_S = 5.0

# What a batch's jobs hand its stream: (group index, sample or progress), None at a job's end, or its error.
_Out = asyncio.Queue[tuple[int, SampleResult | SampleProgress] | BaseException | None]
Placement = list[list[tuple[int, GroupRequest]]]  # per engine, (batch index, group) pairs in start order
_Part = tuple[EngineRef, list[tuple[Share, GroupRequest]]]  # an engine and the shares it runs


def _by_actor(parts: Sequence[_Part]) -> list[list[_Part]]:
    """`parts` grouped by the actor hosting their engine, in the order of each actor's first part: one run call and
    one stream each (`Dispatcher._run`)."""
    runs: dict[ActorRecord, list[_Part]] = {}
    for part in parts:
        runs.setdefault(part[0][0], []).append(part)
    return list(runs.values())


def _sample_load(group: GroupRequest) -> float:
    """What one sample of a group placed by `with_length_predictions` weighs in placement: its predicted output
    tokens."""
    return float(group.predicted_tokens or 0.0)


def stream_interval(actors: int, items_per_s: float) -> float:
    """Seconds between an engine actor's stream items (finished samples and progress of all its engines travel
    together) with `actors` engine actors: 50 ms, longer once their streams together would send more than
    `items_per_s` (`ServiceConfig.stream_items_per_s`), at most 5 s. A finished sample waits up to this long on its
    actor (not the last ones of the actor's run), and a death loses up to this long of a sample's tokens."""
    return min(_MAX_STREAM_INTERVAL_S, max(PROGRESS_INTERVAL_S, actors / items_per_s))


class PlacedWork:
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


class Dispatcher:
    """Places and runs batches over the engines `supervisor` keeps. Every dispatch to an engine waits in `hold`
    while the service is paused; `book` learns every finished length; `given_up` remembers the prompts whose groups
    were given up."""

    def __init__(self, config: ServiceConfig, supervisor: EngineSupervisor, policy: ServedPolicy, hold: PauseGate,
                 book: DifficultyBook, given_up: GivenUpPrompts) -> None:
        self.config = config
        self._supervisor = supervisor
        self._policy = policy
        self._hold = hold
        self._book = book
        self._given_up_prompts = given_up  # what the coordinator's `check` refuses for a while
        self.predictor = LengthPredictor(book)
        self.placed = PlacedWork()
        self._sessions: SessionBook | None = None  # the gateway's (attach_sessions): where sessions' prefixes are
        self._redispatched = 0
        self._given_up = 0  # samples ended with an error after max_group_deaths engine deaths
        self._stream_items = 0  # Ray objects received from engine streams (samples or progress)
        self._placement_s = 0.0  # seconds spent in `place`, over `_placements` calls
        self._placements = 0

    def attach_sessions(self, book: SessionBook) -> None:
        """The gateway's session book: a session's turns go to the engine holding its prefix, and idle sessions'
        predicted remaining work counts in their engine's load (`place`)."""
        self._sessions = book

    def stats(self, figures: BackendStats) -> BackendStats:
        """`figures` with dispatch's own: samples run again and given up, placed work, stream items, placement
        time."""
        return replace(figures, samples_redispatched=self._redispatched, samples_given_up=self._given_up,
                       engine_placed_tokens={name: self.placed.load(name) for _, _, name in self._supervisor.engines},
                       engine_stream_items=self._stream_items, placement_s=self._placement_s,
                       placements=self._placements)

    # ---- placement ----

    def place(self, groups: Sequence[GroupRequest], serving: Sequence[EngineRef]) -> Placement:
        """Per engine of `serving`, the (batch index, group) pairs it would run, longest predicted first
        (`with_length_predictions` tags the groups), given the work already placed there. A session's turn goes to
        the engine holding its prefix while that one serves and is not overloaded (SessionBook.engine_for; each
        session is its own unit, so a problem's trajectories spread); a problem's other groups go where its samples
        already run, if they run on a serving engine; the rest, a problem's groups of this batch together, by LPT
        from the engines' placed loads plus the idle sessions' reserved work. Timed into `placement_s`."""
        started = time.perf_counter()
        try:
            return self._place_timed(groups, serving)
        finally:
            self._placement_s += time.perf_counter() - started
            self._placements += 1

    def _place_timed(self, groups: Sequence[GroupRequest], serving: Sequence[EngineRef]) -> Placement:
        tagged = with_length_predictions(self.predictor, groups)
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
        existing = np.array([self.placed.load(name) for name in names], dtype=np.float64)
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
                engine = self.placed.engine_of(group.problem_id, index)
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
        per_engine: Placement = [[] for _ in names]
        for i in np.argsort(-loads, kind="stable").tolist():
            per_engine[int(assignment[i])].append((i, tagged[i]))
        return per_engine

    async def _least_loaded(self) -> EngineRef:
        """The serving engine with the least predicted work outstanding, once one serves. RuntimeError once none
        ever will."""
        serving = await self._supervisor.wait_serving()
        return min(serving, key=lambda engine: self.placed.load(engine[2]))

    # ---- running ----

    async def generate(self, groups: Sequence[GroupRequest], on_progress: ProgressSink | None = None,
                       aborts: GroupAborts | None = None) -> AsyncGenerator[tuple[int, SampleResult], None]:
        """The batch's samples as (group index, sample) as they finish; progress reports go to `on_progress`."""
        aborts = aborts or GroupAborts()
        serving = self._supervisor.serving() or [await self._least_loaded()]
        placed = [(engine, [(Share(i, tuple(range(g.n))), g) for i, g in items])
                  for engine, items in zip(serving, self.place(groups, serving)) if items]
        # Held now, before anything awaits: a batch placed at the same moment sees this one's work.
        for engine, work in placed:
            self.placed.hold(engine[2], work)
        # Each job puts (group index, sample or progress) pairs, then None at its end, or the exception that ended it.
        out: _Out = asyncio.Queue()
        jobs = [asyncio.create_task(self._job(parts, out, aborts)) for parts in _by_actor(placed)]
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

    async def _job(self, parts: list[_Part], out: _Out, aborts: GroupAborts) -> None:
        """Runs `parts` (engines of one actor, each with its work) there (`_run`), putting their samples on `out` as
        they arrive, renumbered as the batch's. Ends with None on `out`, or the exception that failed the batch. The
        caller has put each part's work in `placed` on its engine."""
        try:
            await self._run(parts, out, aborts)
            out.put_nowait(None)
        except Exception as exc:  # handed to the batch, which owns the error
            out.put_nowait(exc)

    async def _run(self, parts: list[_Part], out: _Out, aborts: GroupAborts) -> None:
        """Runs each part's work (held in `placed` on its engine) on its engine, every part's engine hosted by one
        actor: one run call and one stream for all of them (`NodeEngine.run`), so the Ray work per batch goes with
        the actors, not the engines. The samples go to `out` as they arrive and leave the ledger on their engine;
        what never arrived leaves it when this ends. When the actor dies, what any of its engines had not delivered
        runs again (`_run_again`), placed engine by engine as a batch is. A group aborted through `aborts` is
        aborted on the engine alone (NodeEngine.abort_group), or not sent at all if it was aborted before. Returns
        once every sample of every part has reached `out`."""
        import ray

        actor = parts[0][0][0]
        incarnation = actor.incarnation
        rest: list[tuple[Share, GroupRequest]] | None = None  # what a death left owed
        run_id = uuid.uuid4().hex
        # Every share of the run as (engine index in the actor, engine name, share, group); its position is the
        # index the actor tags its samples with, unique across the actor's engines.
        items = [(local, name, share, group) for (_, local, name), work in parts for share, group in work]
        names = ", ".join(engine[2] for engine, _ in parts)

        def abort_group(group_index: int) -> None:
            indices = [k for k, (_, _, share, _) in enumerate(items) if share.group_index == group_index]
            if indices:
                actor.handle.abort_group.remote(run_id, indices)

        with aborts.listening(abort_group):
            try:
                await self._hold.resumed()  # first dispatches and re-dispatches alike reach engines that have resumed
                for (_, _, name), work in parts:
                    self._end_aborted(name, [item for item in work if aborts.aborted(item[0].group_index)], out)
                request: dict[int, list[tuple[int, GroupRequest]]] = {}  # per engine, its groups in start order
                for k, (local, _, share, group) in enumerate(items):
                    if share.missing():
                        request.setdefault(local, []).append((k, share.request(group)))
                if not request:
                    return
                interval = stream_interval(self._supervisor.actors_served, self.config.stream_items_per_s)
                generator = actor.handle.run.remote(list(request.items()), progress_interval_s=interval,
                                                    item_interval_s=interval, run_id=run_id)
                try:
                    async for ref in generator:
                        self._stream_items += 1
                        for k, sample in await ref:
                            _, name, share, group = items[k]
                            if isinstance(sample, SampleProgress):
                                report = share.progress(sample)
                                if report is not None:
                                    out.put_nowait((share.group_index, report))
                                continue
                            taken = share.take(sample)
                            if taken is not None:
                                taken.predicted_tokens = group.predicted_tokens
                                self.placed.arrived(name, group)
                                out.put_nowait((share.group_index, taken))
                except lost_errors() as exc:
                    self._supervisor.engine_died(actor, incarnation, exc)
                    if actor.state == "failed" and not actor.node_left:  # past its restart cap: its batches fail
                        raise RuntimeError(actor.error) from None
                    died = time.time()  # the trace's clock (the gateway's process): the sample spans' event time
                    rest = [(share, group) for _, name, owed, group in items
                            if (share := owed.remainder(name, died)) is not None]
                finally:
                    with contextlib.suppress(Exception):
                        ray.cancel(generator)
                missing = sum(len(share.missing()) for _, _, share, _ in items)
                if rest is None and missing:
                    raise RuntimeError(f"engine {names} ended its stream with {missing} samples missing")
            finally:
                for (_, _, name), work in parts:
                    self.placed.release(name, work)
        if rest is not None:
            await self._run_again(names, rest, out, aborts)

    async def _run_again(self, dead: str, work: list[tuple[Share, GroupRequest]],
                         out: _Out, aborts: GroupAborts) -> None:
        """Runs the shares that the engines `dead` (their names) owed when their actor died. A share that has run
        through `max_group_deaths` deaths is given up (`_give_up`). One whose next death would give it up runs alone,
        one share after another, so that a group that only ran beside the one that kills engines is not given up with
        it; the rest are placed again over the serving engines (`place`, as a batch is) and run at once, one run per
        actor."""
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
            serving = self._supervisor.serving() or [await self._least_loaded()]
            placement = self.place([share.request(group) for share, group in together], serving)
            placed = [(engine, [together[i] for i, _ in items]) for engine, items in zip(serving, placement) if items]
            for engine, part in placed:
                self.placed.hold(engine[2], part)
            runs += [self._run(parts, out, aborts) for parts in _by_actor(placed)]
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
            self.placed.hold(engine[2], [item])
            await self._run([(engine, [item])], out, aborts)

    def _end_aborted(self, name: str, work: list[tuple[Share, GroupRequest]], out: _Out) -> None:
        """Ends the shares' missing samples (held in `placed` on engine `name`) with finish_reason "abort": their
        group was aborted alone before they were sent (again) to an engine."""
        for share, group in work:
            for index in share.missing():
                share.received.add(index)
                self.placed.arrived(name, group)
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
