"""A stand-in for an OpenTelemetry collector: an HTTP server on a free loopback port that answers OTLP/HTTP trace
exports (`POST /v1/traces`, protobuf) with success and keeps their bodies, for `das serve --otlp-traces-endpoint`
in the tests and in gateway_throughput.py. Bodies are decoded (opentelemetry-proto's ExportTraceServiceRequest)
only when asked for, so a load test pays the receiving alone."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                      ExportTraceServiceResponse)


@dataclass(frozen=True)
class ExportedSpan:
    """One span as a collector received it: ids in hex (trace 32 digits, span 16; parent "" for a root), times in
    ns since the epoch, attribute values as Python values, events as (name, time)."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, int]]
    links: list[str]  # the linked spans' trace ids
    status_code: int  # 0 unset, 1 ok, 2 error
    service_name: str


class OtlpCollector:
    """`with OtlpCollector() as collector:` serves on `collector.url` until the block ends; `requests` holds
    (path, body) of every POST received, in order."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, bytes]] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                collector.requests.append((self.path, body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
                return  # one line per export on stderr would drown a test's output

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-collector", daemon=True)

    def __enter__(self) -> OtlpCollector:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def spans(self) -> list[ExportedSpan]:
        """Every span of every request received so far, decoded."""
        spans = []
        for _, body in list(self.requests):
            request = ExportTraceServiceRequest.FromString(body)
            for resource_spans in request.resource_spans:
                resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        spans.append(ExportedSpan(
                            name=span.name, trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(), start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            attributes={kv.key: _value(kv.value) for kv in span.attributes},
                            events=[(e.name, e.time_unix_nano) for e in span.events],
                            links=[link.trace_id.hex() for link in span.links], status_code=span.status.code,
                            service_name=str(resource.get("service.name", ""))))
        return spans


def _value(value: Any) -> Any:
    """An OTLP AnyValue (string, bool, int or double: what the gateway's spans carry) as a Python value."""
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind is not None else None
