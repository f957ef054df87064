"""A trace per rollout: OpenTelemetry spans of each batch and each of its samples, exported over OTLP/HTTP
(protobuf) when the gateway is given a collector (`GatewayConfig.otlp_traces_endpoint`, `das serve
--otlp-traces-endpoint URL`). Without one the gateway never imports this module: no tracer provider, no exporter
thread, and its work per sample is one `is None` check.

Spans, all in the gateway's process (the coordinator runs there too; an engine's timings come back on its samples):

- `rollout.batch`, one per batch the gateway admits (`POST /v1/rollouts` and the OpenAI routes, whose coalesced
  requests share one batch): from the request's admission to the batch's end. A W3C `traceparent` header on the
  request makes it a child of the trainer's span (read by OTel's TraceContext propagator); of coalesced OpenAI
  requests the first one carrying one is the parent and the others' are links. Events `admitted` (checks passed,
  batch registered) and `dispatched` (past the pause hold and the reload lock: the coordinator places its groups
  now). Attributes `das.batch_id`, `das.route`, `das.groups`, `das.samples_expected`, at the end `das.status`,
  `das.samples`, `das.output_tokens`, `das.draft_tokens`, `das.accepted_tokens`; status ERROR with the batch's
  error when it failed. A request attaching to a batch that runs already (a repeated batch_id) adds no span.
- `rollout.sample`, one per sample, child of its batch's span: from the batch's dispatch to the sample's delivery
  (its record stored and the batch's readers woken). Attributes `das.problem_id`, `das.group_index`,
  `das.sample_index`, `das.predicted_tokens` (the length placement planned with), `das.engine`,
  `das.output_tokens`, `das.draft_tokens` (proposed), `das.accepted_tokens`, `das.finish_reason`,
  `das.redispatches` (engine deaths it was drawn again after), `das.policy_version`; status ERROR with its error.
  Events `engine.started` (its engine began its request: placement, the Ray hop and a re-dispatch lie before it;
  the engine's queue and prefill between it and the next) and `engine.first_token` (generation after it). The
  engine measures both as durations in its own process (SampleResult.total_s, first_token_s), placed back from the
  sample's arrival here, so no clocks are compared across nodes; the hop back from the engine counts as engine time.
  An event `redispatched` per engine death the sample was drawn again after, at the time the coordinator saw the
  death (SampleResult.engine_deaths; the coordinator runs in this process, on this clock), attributes
  `das.dead_engine` (the engine that died running it) and `das.deaths` (1 for the first death, then 2, ...).

The engines' own spans, under the sample's: each sample's span id is fixed at dispatch, a hash of the batch's span id
and the sample's (group index, sample index) (`BatchTrace.parents`), and travels to its engine as a W3C traceparent
(GroupRequest.trace_parents: through the coordinator, a re-dispatch included, and the engine actor). Under the
sample's span rather than the batch's: a slow sample's queue, prefill and decode then sit under that sample, and a
sample drawn again after a death hangs both engines' requests under its one span. With the endpoint `das serve` starts
the vLLM engines with vLLM's own OTLP tracing pointed at the same collector (service/engine/vllm/engine.py): vLLM's
`llm_request` span (its queue, prefill, decode and end-to-end times, prompt and output tokens) joins the sample's
span, in service `das-rollout-engine`. vLLM makes that span when the request finishes, in the engine actor's process,
from the request's own times: a request cut off by its engine's death leaves none, and the engine's clock is that
node's. vLLM samples by its parent alone, so it makes spans only under a sampled sample's span (none for its
start-up, none for a batch that is not traced). An engine started without the endpoint, or one that does not trace
(the stub: it keeps the headers it was given, for tests), ignores the parents.

Sampling: a batch whose request carries a trainer's `traceparent` is traced if that says sampled; any other batch
with probability `GatewayConfig.otlp_traces_sample_ratio` (das serve --otlp-traces-sample-ratio, default 1: every
batch), by its trace id. A batch not traced costs a non-recording span: no sample spans, no engine spans.

Cost, with a collector: a span per sample through the SDK's public API, about 0.1 ms on the event loop on a
shared 2-core machine, and as much again in the exporter's thread (protobuf encoding). A collector that is slow or
gone never holds a rollout up: spans wait in the BatchSpanProcessor's queue (2048) and are dropped when it is full,
an export gives up after `EXPORT_TIMEOUT_S`, and one warning says so until exports succeed again.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Mapping, Sequence

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import Link, SpanContext, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from das.service.config import traces_url
from das.service.wire.api import BatchStatus, GroupRequest, SampleResult

log = logging.getLogger(__name__)

SERVICE_NAME = "das-rollout"

EXPORT_TIMEOUT_S = 5.0  # one export's sends and retries together; then its spans are dropped

_propagator = TraceContextTextMapPropagator()


class _ExportFailures(logging.Filter):
    """Held on the OTLP exporter's logger: it logs every retry and failure of every export, which against a collector
    that is gone is a line every few seconds. They are swallowed here, the first of an export kept for `_WarnOnce`'s
    warning (it names the cause; the last says only that the retries ran out). One per process
    (`_export_failures`): a logger's first filter to refuse a record is the last to see it."""

    def __init__(self) -> None:
        super().__init__()
        self.first: str | None = None  # since `_WarnOnce` began its latest export

    def filter(self, record: logging.LogRecord) -> bool:
        if self.first is None:
            self.first = record.getMessage()
        return False


_EXPORTER_LOGGER = "opentelemetry.exporter.otlp.proto.http.trace_exporter"


def _export_failures() -> _ExportFailures:
    """The process's `_ExportFailures`, put on the exporter's logger at the first call."""
    logger = logging.getLogger(_EXPORTER_LOGGER)
    held = next((f for f in logger.filters if isinstance(f, _ExportFailures)), None)
    if held is None:
        held = _ExportFailures()
        logger.addFilter(held)
    return held


class _WarnOnce(SpanExporter):
    """The OTLP exporter, with one warning when exports start failing (and a note when they succeed again) instead
    of its own lines per export. Once failing, what is left at shutdown is dropped at once, not retried."""

    def __init__(self, exporter: SpanExporter, url: str, failures: _ExportFailures) -> None:
        self._exporter = exporter
        self._url = url
        self._failures = failures
        self.failing = False
        self.stopping = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self.failing and self.stopping:
            return SpanExportResult.FAILURE
        self._failures.first = None
        result = self._exporter.export(spans)
        if result is SpanExportResult.SUCCESS:
            if self.failing:
                log.info("traces: exports to %s succeed again", self._url)
            self.failing = False
        elif not self.failing:
            self.failing = True
            log.warning("traces: could not export %d spans to %s (%s); spans are dropped until the collector "
                        "takes them, rollouts go on", len(spans), self._url, self._failures.first or "no reason given")
        return result

    def shutdown(self) -> None:
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._exporter.force_flush(timeout_millis)


class _ChosenSpanIds(RandomIdGenerator):
    """OTel's random ids, except that the next span started takes the span id in `chosen` when it is set: a sample's
    span gets the id its engine was told as its parent at dispatch (`BatchTrace.parents`). Set and used on the event
    loop, in one call (`BatchTrace.sample`)."""

    def __init__(self) -> None:
        super().__init__()
        self.chosen: int | None = None

    def generate_span_id(self) -> int:
        chosen, self.chosen = self.chosen, None
        return super().generate_span_id() if chosen is None else chosen


class RolloutTracer:
    """Makes the spans of rollouts (`batch`) and hands them to `processor` (a BatchSpanProcessor over the OTLP
    exporter in `otlp`; tests give an in-memory one). Its own TracerProvider, not OTel's global one: several gateways
    in one process keep theirs apart. `sample_ratio`: the share of batches without a trainer's `traceparent` that
    are traced (by trace id, OTel's `TraceIdRatioBased`); a trainer's traceparent decides for its batch by its
    sampled flag. A batch not traced records nothing and tells its engines no parents."""

    def __init__(self, processor: SpanProcessor, exporter: _WarnOnce | None = None, sample_ratio: float = 1.0) -> None:
        self._ids = _ChosenSpanIds()
        self._provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}),
                                        id_generator=self._ids, sampler=ParentBased(TraceIdRatioBased(sample_ratio)))
        self._provider.add_span_processor(processor)
        self._tracer = self._provider.get_tracer(__name__)
        self._exporter = exporter

    @classmethod
    def otlp(cls, endpoint: str, sample_ratio: float = 1.0) -> RolloutTracer:
        """Spans batched to the OTLP/HTTP collector at `endpoint` (`traces_url`) by a background thread."""
        url = traces_url(endpoint)
        exporter = _WarnOnce(OTLPSpanExporter(endpoint=url, timeout=EXPORT_TIMEOUT_S), url, _export_failures())
        return cls(BatchSpanProcessor(exporter), exporter, sample_ratio)

    def batch(self, batch_id: str, route: str, groups: Sequence[GroupRequest], start_ns: int,
              headers: Sequence[Mapping[str, str]] = ()) -> BatchTrace:
        """The span of a batch admitted from `start_ns` (time.time_ns()), child of the first `traceparent` among
        the requests' `headers` (the others' linked), else the root of a trace of its own."""
        contexts = [context for h in headers if (context := _remote_context(h)) is not None]
        parent = trace.set_span_in_context(trace.NonRecordingSpan(contexts[0])) if contexts else None
        span = self._tracer.start_span(
            "rollout.batch", context=parent, start_time=start_ns, links=[Link(c) for c in contexts[1:]],
            attributes={"das.batch_id": batch_id, "das.route": route, "das.groups": len(groups),
                        "das.samples_expected": sum(g.n for g in groups)})
        return BatchTrace(self._tracer, self._ids, span, start_ns)

    def shutdown(self) -> None:
        """Exports what is queued and stops the exporter's thread (blocks: at most about `EXPORT_TIMEOUT_S` per
        queued export while the collector answers, none once it has failed)."""
        if self._exporter is not None:
            self._exporter.stopping = True
        self._provider.shutdown()


def _remote_context(headers: Mapping[str, str]) -> SpanContext | None:
    """The trainer's span a request names in its `traceparent` header, if it names a valid one."""
    context = trace.get_current_span(_propagator.extract(headers)).get_span_context()
    return context if context.is_valid else None


class BatchTrace:
    """One batch's span and its samples' spans. Methods are called on the event loop, in the batch's order:
    `admitted`, `dispatched` (then `parents` for the groups it sends), `sample` per sample, `end` once.

    A sample's span id is a function of the batch's span id and the sample's (group index, sample index)
    (`_sample_span_id`), so the id its engine is given as a parent at dispatch is the id its span takes when it is
    made, at delivery, with nothing kept per sample in between."""

    def __init__(self, tracer: trace.Tracer, ids: _ChosenSpanIds, span: trace.Span, start_ns: int) -> None:
        self._tracer = tracer
        self._ids = ids
        self._span = span
        self._recording = span.is_recording()  # False for a batch not sampled (the trainer's flag, or the ratio)
        self._parent = trace.set_span_in_context(span)
        self._dispatched_ns = start_ns
        context = span.get_span_context()
        self._trace_id = f"{context.trace_id:032x}"
        self._flags = f"{context.trace_flags:02x}"
        self._seed = context.span_id.to_bytes(8, "big")

    def admitted(self) -> None:
        self._span.add_event("admitted")

    def dispatched(self) -> None:
        self._dispatched_ns = time.time_ns()
        self._span.add_event("dispatched", timestamp=self._dispatched_ns)

    def parents(self, groups: Sequence[GroupRequest]) -> list[GroupRequest]:
        """The batch's `groups` as they are sent to the engines: each sample's `trace_parents` entry names its
        sample's span (made at delivery, `sample`), so an engine that traces (vLLM's request span) hangs its span
        of the sample under it. Unchanged when the batch records nothing (not sampled)."""
        if not self._recording:
            return list(groups)
        return [g.model_copy(update={"trace_parents": tuple(
            f"00-{self._trace_id}-{self._sample_span_id(i, j):016x}-{self._flags}" for j in range(g.n))})
            for i, g in enumerate(groups)]

    def _sample_span_id(self, group_index: int, sample_index: int) -> int:
        """The span id of sample `sample_index` of group `group_index`: 64 bits of a hash of the batch's span id
        and the two indices (never 0, which OTel reads as no span)."""
        digest = hashlib.blake2b(f"{group_index}:{sample_index}".encode(), digest_size=8, key=self._seed).digest()
        return int.from_bytes(digest, "big") or 1

    def sample(self, group_index: int, sample: SampleResult) -> None:
        """The span of `sample` (of the batch's group `group_index`), delivered now, with the id `parents` gave its
        engine."""
        if not self._recording:
            return
        end = time.time_ns()
        attributes: dict[str, str | int | float] = {
            "das.problem_id": sample.problem_id, "das.group_index": group_index,
            "das.sample_index": sample.sample_index, "das.output_tokens": len(sample.token_ids),
            "das.draft_tokens": sample.draft_tokens, "das.accepted_tokens": sample.accepted_tokens,
            "das.finish_reason": sample.finish_reason, "das.redispatches": sample.redispatches,
            "das.policy_version": sample.policy_version}
        if sample.predicted_tokens is not None:
            attributes["das.predicted_tokens"] = sample.predicted_tokens
        if sample.engine is not None:
            attributes["das.engine"] = sample.engine
        self._ids.chosen = self._sample_span_id(group_index, sample.sample_index)
        span = self._tracer.start_span("rollout.sample", context=self._parent, start_time=self._dispatched_ns,
                                       attributes=attributes)
        self._ids.chosen = None  # not taken when the provider has shut down: it must not name another span
        for deaths, death in enumerate(sample.engine_deaths or (), start=1):
            span.add_event("redispatched", {"das.dead_engine": death.engine, "das.deaths": deaths},
                           timestamp=int(death.unix_s * 1e9))
        if sample.total_s > 0:
            started = max(self._dispatched_ns, end - int(sample.total_s * 1e9))
            span.add_event("engine.started", timestamp=started)
            if sample.first_token_s is not None:
                span.add_event("engine.first_token", timestamp=min(end, started + int(sample.first_token_s * 1e9)))
        if sample.finish_reason == "error":
            span.set_status(Status(StatusCode.ERROR, sample.error))
        span.end(end_time=end)

    def end(self, status: BatchStatus, error: str | None, samples: int, tokens: int, draft_tokens: int,
            accepted_tokens: int) -> None:
        """Ends the batch's span: its status (done, aborted, failed), its error and its totals."""
        self._span.set_attributes({"das.status": status, "das.samples": samples, "das.output_tokens": tokens,
                                   "das.draft_tokens": draft_tokens, "das.accepted_tokens": accepted_tokens})
        if status == "failed":
            self._span.set_status(Status(StatusCode.ERROR, error))
        self._span.end()
