"""Prometheus metrics of the gateway (prefix `das_`, units in the names, docs/design.md "Metrics").

The gateway updates plain counters and bucket arrays on its event loop, per sample as it streams; prometheus-client
reads them at scrape time through a custom collector. Why not its Counter/Histogram objects: each update takes a
lock and checks (2-5 us on this machine), a sample touches six of them, and in a profile of the load test that was
a third of the gateway's per-sample work. Each `GatewayMetrics` has its own CollectorRegistry, so several apps in
one process (tests, an embedded service beside a trainer) never register the same name twice.
"""

from __future__ import annotations

import bisect
import statistics
from collections import Counter as Tally
from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from das.service.cluster.history_store import resident_bytes
from das.service.cluster.rollout_backend import BackendStats
from das.service.http.batch_journal import BatchJournal
from das.service.wire.api import SampleResult
from das.service.cluster.sessions import Session, SessionBook
from das.service.http.session_journal import SessionJournal

CONTENT_TYPE = CONTENT_TYPE_LATEST  # what `render()` produces

_LENGTH_BUCKETS = tuple(float(2**k) for k in range(4, 16))  # 16 .. 32768 tokens
_SECONDS_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 3600)
_SHARE_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
_RATIO_BUCKETS = (1.0, 1.25, 1.5, 2, 3, 4, 6, 8, 12, 16, 32)
_TURN_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
_ACCEPT_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2, 2.5, 3, 4, 5, 6, 8, 12, 16)
LENGTH_CLASSES = ("short", "medium", "long")


def length_class(length: int, max_tokens: int) -> str:
    """A sample's length class by its output length as a share of its max_tokens: short < 1/4 <= medium < 3/4 <=
    long. By the final length, so the dashboard shows where the drafts went: the length-aware budget should give
    the long class most of them."""
    share = length / max_tokens if max_tokens > 0 else 1.0
    return "short" if share < 0.25 else "medium" if share < 0.75 else "long"


class _Histogram:
    """Bucket counts of one histogram; `le` semantics: a value equal to a bound falls in that bound's bucket."""

    def __init__(self, name: str, doc: str, bounds: Sequence[float]) -> None:
        self.name, self.doc = name, doc
        self._bounds = tuple(float(b) for b in bounds)
        self._counts = [0] * (len(self._bounds) + 1)  # the last one: above every bound (+Inf only)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, value)] += 1
        self._sum += value

    def buckets(self) -> list[tuple[str, float]]:
        cumulative, buckets = 0, []
        for bound, count in zip((*self._bounds, float("inf")), self._counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        return buckets

    def family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.doc, buckets=self.buckets(), sum_value=self._sum)


class _LabelledHistogram:
    """One `_Histogram` per value of one label, created on first use."""

    def __init__(self, name: str, doc: str, bounds: Sequence[float], label: str) -> None:
        self.name, self.doc, self.label = name, doc, label
        self._bounds = bounds
        self._by_value: dict[str, _Histogram] = {}

    def observe(self, value: str, x: float) -> None:
        histogram = self._by_value.get(value)
        if histogram is None:
            histogram = self._by_value[value] = _Histogram(self.name, self.doc, self._bounds)
        histogram.observe(x)

    def family(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.doc, labels=[self.label])
        for value, histogram in sorted(self._by_value.items()):
            family.add_metric([value], histogram.buckets(), histogram._sum)  # noqa: SLF001 -- same module
        return family


class GatewayMetrics:
    """The gateway's metrics; `render()` is the /metrics body. Call from the event loop thread only.
    `backend_stats` gives the engine and history figures at scrape time (it must not block)."""

    def __init__(self, backend_stats: Callable[[], BackendStats] = BackendStats) -> None:
        self.backend_stats = backend_stats
        self.samples: Tally[str] = Tally()  # by finish reason
        self.output_tokens = 0
        self.draft_proposed: Tally[str] = Tally()  # by length class
        self.draft_accepted: Tally[str] = Tally()
        self.current_batch_longest = 0  # tokens, the most recently started batch
        self.batches: Tally[str] = Tally()  # ended, by status
        self.batches_in_flight = 0
        self.policy_version = 0
        self.weight_transfers = 0  # pushes finished (vLLM's weight transfer: /finish_weight_update)
        self.weight_transfer_bytes = 0  # their tensors' bytes, once per push (the group broadcasts them)
        self.history_imported = 0
        self.previous_run_refusals = 0  # requests for a batch id an earlier run of the service accepted
        self.requests_abandoned: Tally[str] = Tally()  # by route: clients that left before their work was done
        self.body_timeouts = 0  # requests answered 408: the body did not arrive within body_timeout_s
        self.batch_journal: BatchJournal | None = None  # the gateway's, when it has a state directory
        self.acceptance_length = _LabelledHistogram(
            "das_acceptance_length_tokens", "Output tokens per decode step of a sample (1 = no draft accepted), "
            "by length class.", _ACCEPT_BUCKETS, "length_class")
        self.generated_length = _Histogram("das_generated_length_tokens", "Output length of a sample.",
                                           _LENGTH_BUCKETS)
        self.makespan = _Histogram("das_batch_makespan_seconds", "Start of a batch to its last sample.",
                                   _SECONDS_BUCKETS)
        self.tail_share = _Histogram("das_batch_tail_share_ratio",
                                     "Share of the makespan after the median sample finished.", _SHARE_BUCKETS)
        self.straggler = _Histogram("das_batch_straggler_ratio", "Longest / median output length of a batch.",
                                    _RATIO_BUCKETS)
        self.reload_duration = _Histogram("das_weight_reload_seconds",
                                          "A weight reload, including the wait for running batches.",
                                          _SECONDS_BUCKETS)
        self.transfer_duration = _Histogram("das_weight_transfer_seconds", "A weight transfer (push), "
                                            "/start_weight_update to /finish_weight_update, including the wait for "
                                            "running batches.", _SECONDS_BUCKETS)
        self.sessions: SessionBook | None = None  # the gateway's
        self.session_journal: SessionJournal | None = None  # the gateway's, when it has a state directory
        self.session_makespan = _Histogram("das_session_makespan_seconds", "An agent trajectory (session) that "
                                           "ended: its first turn's start to its last turn's end, tool time "
                                           "included.", _SECONDS_BUCKETS)
        self.session_turns = _Histogram("das_session_trajectory_turns", "Turns of a trajectory (session) that "
                                        "ended.", _TURN_BUCKETS)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def observe_sample(self, sample: SampleResult, max_tokens: int) -> None:
        """One finished sample, as soon as the backend hands it over; `max_tokens` is its group's limit."""
        length = len(sample.token_ids)
        cls = length_class(length, max_tokens)
        self.samples[sample.finish_reason] += 1
        self.output_tokens += length
        self.generated_length.observe(length)
        self.draft_proposed[cls] += sample.draft_tokens
        self.draft_accepted[cls] += sample.accepted_tokens
        if sample.decode_steps:
            self.acceptance_length.observe(cls, length / sample.decode_steps)

    def body_timed_out(self) -> None:
        """A request body that did not arrive in time (service/http/request_guard.py)."""
        self.body_timeouts += 1

    def observe_session(self, session: Session, reason: str) -> None:
        """A session that ended (closed, aborted, expired or evicted), if any turn of it finished."""
        if session.turns and session.ended_s is not None:
            self.session_makespan.observe(session.ended_s - session.opened_s)
            self.session_turns.observe(len(session.turns))

    def observe_batch(self, status: str, makespan_s: float, finish_times_s: Sequence[float],
                      lengths: Sequence[int]) -> None:
        """A batch that ended; the shape metrics (makespan, tail, stragglers) only for completed, non-empty ones.
        `finish_times_s`: each sample's finish, seconds after the batch started."""
        self.batches[status] += 1
        if status != "done" or not lengths:
            return
        self.makespan.observe(makespan_s)
        if makespan_s > 0:
            self.tail_share.observe((makespan_s - statistics.median(finish_times_s)) / makespan_s)
        median_length = statistics.median(lengths)
        if median_length > 0:
            self.straggler.observe(max(lengths) / median_length)

    def collect(self) -> Iterator[Metric]:
        """prometheus-client's collector hook: the current values as metric families."""
        yield _labelled("das_samples_served", "Samples finished and streamed, by finish reason.", "finish_reason",
                        self.samples)
        yield CounterMetricFamily("das_output_tokens", "Output tokens of served samples.",
                                  value=self.output_tokens)
        yield _labelled("das_draft_tokens_proposed", "Draft tokens proposed and verified, by the sample's length "
                        "class.", "length_class", self.draft_proposed)
        yield _labelled("das_draft_tokens_accepted", "Draft tokens accepted by verification, by the sample's length "
                        "class.", "length_class", self.draft_accepted)
        yield _labelled("das_batches", "Batches ended, by status (done, aborted, failed).", "status", self.batches)
        yield GaugeMetricFamily("das_batches_in_flight", "Batches accepted and not yet ended.",
                                value=self.batches_in_flight)
        yield GaugeMetricFamily("das_policy_version", "Policy version being served.", value=self.policy_version)
        yield CounterMetricFamily("das_weight_transfers", "Weight pushes served (vLLM's weight transfer), each "
                                  "loaded by every engine.", value=self.weight_transfers)
        yield CounterMetricFamily("das_weight_transfer_bytes", "Bytes of the tensors those pushes carried (once "
                                  "per push, whatever the number of engines).", value=self.weight_transfer_bytes)
        yield CounterMetricFamily("das_history_records_imported", "Rollout records imported for drafting.",
                                  value=self.history_imported)
        yield GaugeMetricFamily("das_current_batch_longest_tokens", "Longest output among the samples finished "
                                "so far in the most recently started batch.", value=self.current_batch_longest)
        yield CounterMetricFamily("das_batches_from_previous_run_refused", "Requests refused (409) because an "
                                  "earlier run of the service accepted their batch id.",
                                  value=self.previous_run_refusals)
        yield _labelled("das_requests_abandoned", "Requests whose client left before all their samples came, by "
                        "route; their work is given up (a batch is aborted once nothing reads it).", "route",
                        self.requests_abandoned)
        yield CounterMetricFamily("das_request_body_timeouts", "Requests answered 408 because their body did not "
                                  "arrive within body_timeout_s.", value=self.body_timeouts)
        if self.batch_journal is not None:
            journal = self.batch_journal.counters()
            yield CounterMetricFamily("das_batch_journal_torn_records", "Torn records dropped from the end of the "
                                      "batch journal at start.", value=journal.torn_records)
            yield CounterMetricFamily("das_batch_journal_quarantined", "Damaged batch journal files set aside "
                                      "(renamed .bad-<reason>-<time>) at start.", value=journal.quarantined_files)
            yield CounterMetricFamily("das_batch_journal_write_failures", "Batch journal records or compactions "
                                      "that could not be written (those batches are not protected against a "
                                      "second run after a restart).", value=journal.write_failures)
        yield from self._backend_families()
        yield from self._session_families()
        for histogram in (self.acceptance_length, self.generated_length, self.makespan, self.tail_share,
                          self.straggler, self.reload_duration, self.transfer_duration, self.session_makespan,
                          self.session_turns):
            yield histogram.family()

    def _backend_families(self) -> Iterator[Metric]:
        stats = self.backend_stats()
        running = GaugeMetricFamily("das_engine_requests_running", "Requests in the engine's running batch.",
                                    labels=["engine"])
        waiting = GaugeMetricFamily("das_engine_requests_waiting", "Requests queued in the engine.",
                                    labels=["engine"])
        speculate = GaugeMetricFamily("das_speculate_latency_seconds", "Proposer time per decode step (whole "
                                      "batch), over the engine's recent steps.", labels=["engine", "quantile"])
        proposed = CounterMetricFamily("das_source_draft_tokens_proposed", "Draft tokens proposed by our drafter "
                                       "since the engine started, by the source they came from (live, prompt, "
                                       "global, sealed-age-<a>: the rollouts of the policy a versions back, "
                                       "context: an agent session's, same-key: the sample's key's previous "
                                       "sample).",
                                       labels=["engine", "source"])
        accepted = CounterMetricFamily("das_source_draft_tokens_accepted", "Draft tokens accepted, by source.",
                                       labels=["engine", "source"])
        cost = {key: GaugeMetricFamily(name, doc, labels=["engine"]) for key, name, doc in (
            ("c_base_s", "das_engine_step_base_seconds", "The engine's live step cost fit: seconds a decode step "
             "costs however few tokens it verifies."),
            ("c_tok_s", "das_engine_step_token_seconds", "The live step cost fit: seconds per token verified."),
            ("c_spec_s", "das_engine_step_spec_seconds", "The live step cost fit: the extra seconds of a step that "
             "verifies drafts, whatever its size."),
            ("c_spec_req_s", "das_engine_step_spec_request_seconds", "The live step cost fit: the extra seconds of a "
             "step that verifies drafts, per running request."),
            ("fit_error", "das_engine_step_fit_error_ratio", "Recent relative RMS error of the step cost fit."),
            ("guard_price", "das_engine_guard_price_ratio", "The never-a-loss guard's extra price on a drafted step, "
             "as a share of a plain step (0: not backing off)."))}
        prompt = CounterMetricFamily("das_engine_prompt_tokens", "Prompt tokens of the requests the engine "
                                     "scheduled (each sample of a group counts its prompt).", labels=["engine"])
        cached = CounterMetricFamily("das_engine_prompt_tokens_cached", "Prompt tokens found in the engine's prefix "
                                     "cache instead of computed (a group's samples share their prompt's full KV "
                                     "blocks).", labels=["engine"])
        steps = CounterMetricFamily("das_engine_steps", "Engine steps (one forward pass over the running requests).",
                                    labels=["engine"])
        busy = CounterMetricFamily("das_engine_busy_seconds", "Seconds of the engine's steps (pauses over a second "
                                   "waiting for work left out): busy / steps is the mean step time.", labels=["engine"])
        verified = CounterMetricFamily("das_engine_draft_tokens", "Draft tokens the engine verified, whatever the "
                                       "speculative method (vLLM's own count).", labels=["engine"])
        verified_ok = CounterMetricFamily("das_engine_draft_tokens_accepted", "Draft tokens the engine accepted.",
                                          labels=["engine"])
        rejected = CounterMetricFamily("das_engine_step_fit_rejected", "Measured steps (what=step) and fits "
                                       "(what=fit) the online cost model rejected.", labels=["engine", "what"])
        runner = GaugeMetricFamily("das_engine_runner_info", "What vLLM runs for the engine (1): platform, model "
                                   "runner, async scheduling, and whether every sampled token is our keyed draw "
                                   "(the same samples with and without speculation).",
                                   labels=["engine", "platform", "model_runner", "async_scheduling", "keyed"])
        parts = CounterMetricFamily("das_engine_step_part_seconds", "With das serve --profile-steps: seconds of the "
                                    "engine's steps by part: forward_s (of which model_s, the forward pass: device "
                                    "work), sample_s, propose_s (of which budget_s), rest_s, gap_s "
                                    "(service/engine/vllm/step_profile.py).", labels=["engine", "part"])
        profiled = CounterMetricFamily("das_engine_profiled_steps", "With das serve --profile-steps: the steps "
                                       "timed by part.", labels=["engine"])
        for load in stats.engines:
            if load.runner is not None:
                r = load.runner
                runner.add_metric([load.engine, r.platform, r.model_runner, str(r.async_scheduling).lower(),
                                   str(r.keyed).lower()], 1)
            if load.step_parts.steps:
                profiled.add_metric([load.engine], load.step_parts.steps)
                for part, seconds in load.step_parts.seconds:
                    parts.add_metric([load.engine, part], seconds)
            for key, family in cost.items():
                if isinstance(load.step_cost.get(key), (int, float)):
                    family.add_metric([load.engine], float(load.step_cost[key]))
            for what in ("step", "fit"):
                if isinstance(load.step_cost.get(f"rejected_{what}s"), int):
                    rejected.add_metric([load.engine, what], load.step_cost[f"rejected_{what}s"])
            for source, (p, a) in sorted(load.drafts_by_source.items()):
                proposed.add_metric([load.engine, source], p)
                accepted.add_metric([load.engine, source], a)
            running.add_metric([load.engine], load.tally.running)
            prompt.add_metric([load.engine], load.tally.prompt_tokens)
            cached.add_metric([load.engine], load.tally.cached_prompt_tokens)
            steps.add_metric([load.engine], load.tally.steps)
            busy.add_metric([load.engine], load.tally.busy_s)
            verified.add_metric([load.engine], load.tally.draft_tokens)
            verified_ok.add_metric([load.engine], load.tally.accepted_tokens)
            waiting.add_metric([load.engine], load.tally.waiting)
            for q, value in (("0.5", load.speculate_p50_s), ("0.99", load.speculate_p99_s)):
                if value is not None:
                    speculate.add_metric([load.engine, q], value)
        yield from (running, waiting, speculate, proposed, accepted, prompt, cached, steps, busy, verified, verified_ok,
                    *cost.values(), rejected, runner, parts, profiled)
        yield GaugeMetricFamily("das_engines_ready", "Engines loaded and serving.", value=stats.engines_ready)
        restarts = CounterMetricFamily("das_engine_restarts", "Restarts of an engine after it died (its actor "
                                       "process or its vLLM engine core).", labels=["engine"])
        recovery = GaugeMetricFamily("das_engine_last_recovery_seconds", "The engine's latest recovery: its death "
                                     "noticed to serving again (restart, model load, weights).", labels=["engine"])
        for engine, count in sorted(stats.engine_restarts.items()):
            restarts.add_metric([engine], count)
        for engine, seconds in sorted(stats.engine_recovery_s.items()):
            recovery.add_metric([engine], seconds)
        yield restarts
        yield recovery
        load_failures = CounterMetricFamily("das_engine_load_failures", "Loads of an engine that failed, by reason "
                                            "(service/cluster/load_failure.py: missing_package, missing_model, "
                                            "vllm_version, config and tensor_parallel leave it down for good; died, "
                                            "out_of_memory and error restart it).", labels=["engine", "reason"])
        for (engine, reason), count in sorted(stats.engine_load_failures.items()):
            load_failures.add_metric([engine, reason], count)
        yield load_failures
        placed = GaugeMetricFamily("das_engine_placed_tokens", "Predicted output tokens of the samples placed on the "
                                   "engine that have not reached the client, over every batch running (what "
                                   "placement balances).", labels=["engine"])
        for engine, tokens in sorted(stats.engine_placed_tokens.items()):
            placed.add_metric([engine], tokens)
        yield placed
        yield CounterMetricFamily("das_engine_stream_items", "Ray objects the coordinator received from the "
                                  "engine actors' streams (each up to 64 finished samples, or a progress report).",
                                  value=stats.engine_stream_items)
        yield CounterMetricFamily("das_placement_seconds", "Seconds the coordinator spent placing groups on "
                                  "engines (over das_placements placements).", value=stats.placement_s)
        yield CounterMetricFamily("das_placements", "Placements of groups on engines: one per batch, one per "
                                  "re-dispatch after an engine death.", value=stats.placements)
        yield CounterMetricFamily("das_samples_redispatched", "Samples a dead engine owed that had not reached the "
                                  "client, run again on a serving engine.", value=stats.samples_redispatched)
        yield CounterMetricFamily("das_samples_given_up", "Samples ended with finish_reason error, not run again: "
                                  "their group was running on an engine at each of max_group_deaths engine "
                                  "deaths (a prompt that may crash the engine).", value=stats.samples_given_up)
        yield GaugeMetricFamily("das_history_problems_stored", "Problems with rollouts in the history store.",
                                value=stats.history_problems)
        yield GaugeMetricFamily("das_history_tokens_stored", "Output tokens of the rollouts in the history store.",
                                value=stats.history_tokens)
        yield GaugeMetricFamily("das_history_outbox_records", "Finished rollouts the engines hold until a history "
                                "snapshot holds them (lost if their engine actor dies; grows while a shard is down).",
                                value=stats.history_outbox_records)
        yield CounterMetricFamily("das_history_records_given_up", "Rollouts the engines dropped instead of storing "
                                  "them: an outbox over its token cap while a shard stayed down, or a record a shard "
                                  "refused (summed over the engine actors' current processes).",
                                  value=stats.history_records_given_up)
        yield from _history_snapshot_families(stats)
        memory = GaugeMetricFamily("das_memory_resident_bytes", "Resident memory by component (summed over its "
                                   "processes).", labels=["component"])
        for component, value in sorted({**stats.resident_bytes, "gateway": resident_bytes()}.items()):
            memory.add_metric([component], value)
        yield memory

    def _session_families(self) -> Iterator[Metric]:
        """Agent sessions (service/cluster/sessions.py): open ones, turns, moves off their engine, ends by reason."""
        book = self.sessions
        if book is None:
            return
        book.expire()  # a scrape sees expired sessions gone even when no turn arrives to expire them
        yield GaugeMetricFamily("das_session_open", "Agent sessions open (idle between turns or running one).",
                                value=book.open_sessions)
        yield GaugeMetricFamily("das_session_context_tokens", "Context tokens (latest prompt + output) summed over "
                                "the open sessions (bounded by SessionConfig.max_context_tokens).",
                                value=book.context_tokens)
        yield CounterMetricFamily("das_session_turns", "Session turns finished.", value=book.turns)
        yield _labelled("das_session_moves", "Session turns placed away from the engine holding the session's "
                        "prefix, by reason (not_serving: the engine died, drains or recovers; overload).", "reason",
                        book.moves)
        yield _labelled("das_session_ended", "Sessions ended, by reason (closed, aborted, expired, evicted).",
                        "reason", book.closed)
        reserved = GaugeMetricFamily("das_session_reserved_tokens", "Predicted remaining output tokens of the idle "
                                     "sessions whose prefix the engine holds (added to its placed work).",
                                     labels=["engine"])
        for engine, tokens in sorted(book.reserved().items()):
            reserved.add_metric([engine], tokens)
        yield reserved
        if self.session_journal is not None:
            journal = self.session_journal
            yield CounterMetricFamily("das_session_journal_skipped_records", "Torn or corrupt session journal "
                                      "records skipped at start.", value=journal.skipped_records)
            yield CounterMetricFamily("das_session_journal_write_failures", "Session journal writes that failed "
                                      "(those session changes would not outlive a restart).",
                                      value=journal.write_failures)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


def _history_snapshot_families(stats: BackendStats) -> Iterator[Metric]:
    """Snapshot health of the history shards: counters summed over the shards' current processes (a restarted
    shard starts its own from zero), the snapshot time per shard."""
    shards = stats.history_shards
    yield CounterMetricFamily("das_history_snapshot_fallbacks", "Shard starts that restored the previous snapshot "
                              "generation because the newest was missing or unreadable.",
                              value=sum(s.snapshot_fallbacks for s in shards))
    yield CounterMetricFamily("das_history_snapshot_quarantined", "Unreadable snapshot files set aside (renamed "
                              ".bad-<reason>-<time>) at shard start.",
                              value=sum(s.snapshot_quarantined for s in shards))
    yield CounterMetricFamily("das_history_snapshot_failures", "History snapshots that could not be written.",
                              value=sum(s.snapshot_failures for s in shards))
    last = GaugeMetricFamily("das_history_last_snapshot_timestamp_seconds", "Unix time the shard's snapshot on disk "
                             "was written (absent: none yet).", labels=["shard"])
    for index, shard in enumerate(shards):
        if shard.last_snapshot_unix_s is not None:
            last.add_metric([str(index)], shard.last_snapshot_unix_s)
    yield last


def _labelled(name: str, documentation: str, label: str, counts: Mapping[str, int]) -> CounterMetricFamily:
    """A counter family with one sample per label value, in label order."""
    family = CounterMetricFamily(name, documentation, labels=[label])
    for value, count in sorted(counts.items()):
        family.add_metric([value], count)
    return family
