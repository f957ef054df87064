"""Schemathesis over the gateway's OpenAPI schema, in process (its ASGI transport, one event loop), on a stub backend
with bearer auth on: the batch API, weights, history, the OpenAI-compatible routes, vLLM's RL control routes and
the probes. Every operation gets schema-valid requests (positive) and requests that break the schema (negative:
wrong types, missing fields, out-of-range values, a missing or malformed Authorization header); positive requests
carry the token, negative ones may lose it. Every answer must be documented in the schema (status, content type,
body) and none may be a server error: the only 5xx allowed is a documented 501 (vLLM's weight transfer, refused by
design). A positive request is never refused for a rule the schema states (STATED_RULES: int64 bounds, one prompt
per group, history records' fields). Bounded: fixed examples per operation, derandomized, no shrinking, a timeout on
every call (streams included), so the run is reproducible and takes seconds."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import jsonschema
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.errors import FailureGroup
from schemathesis.python.asgi import shutdown_lifespans
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from das.service.engine.stub_engine import StubEngine, StubEngineConfig
from das.service.http.gateway import create_app
from das.service.config import GatewayConfig
from das.service.wire.api import MSGPACK, ProblemSummary
from das.service.wire.engine_control import AddHistory, EngineControl
from tests.service.stub_backend import RecordingBackend

TOKEN = "fuzz-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# Examples per generation mode; the routes with the richest bodies get more. Operations with few distinct inputs
# (no parameters, no body) run fewer: Hypothesis stops once it has tried them all.
EXAMPLES = {"POST /v1/rollouts": 110, "POST /v1/completions": 90, "POST /v1/chat/completions": 90,
            "POST /v1/weights": 50, "POST /v1/history": 50, "POST /update_weights": 50, "POST /abort_requests": 40,
            "POST /pause": 40}
DEFAULT_EXAMPLES = 25
MIN_CASES = 1000
CALL_TIMEOUT_S = 10  # a stream that never ends (a batch held by a pause) fails its case instead of hanging the run
CHECKS = [status_code_conformance, content_type_conformance, response_schema_conformance]
# Refusals of rules the schema states (int64 bounds as exact integers, the one-prompt rule, history records' fields):
# a schema-valid (positive) request must never get one. Other refusals of positive requests stay allowed: what the
# schema cannot say (a prompt over the context, a batch id in use, a version not newer, `x-` rules).
STATED_RULES = ("9223372036854775807", "9223372036854775808", "int64", "give exactly one of",
                "prompt_token_ids is empty", "messages is empty", "at least one message", "not both", "missing",
                "not a field of the format",
                "Field required")


def refusal_messages(response: Any) -> str:
    """The messages of a 400/422 answer, without the echoed input (which may hold any text)."""
    body = response.json()
    if "error" in body:
        return str(body["error"]["message"])
    detail = body.get("detail")
    return " ".join(str(d.get("msg")) for d in detail) if isinstance(detail, list) else str(detail)


def schema_valid_body(document: dict[str, Any], raw: dict[str, Any], body: Any) -> bool:
    """Whether `body` is valid under the operation's JSON request body schema (refs resolved in `document`).
    Schemathesis' positive generation can miss a oneOf, so its positive cases are checked, not trusted."""
    schema = raw.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
    if schema is None:
        return True
    validator = jsonschema.Draft202012Validator({**schema, "components": document["components"]})
    return validator.is_valid(body)


class HistoryStub(RecordingBackend):
    """The stub engine's backend with a history store (rollouts counted per problem), so GET
    /v1/history/{problem_id} answers 200 or 404 as over the Ray service rather than the in-process backend's 501."""

    def __init__(self, **config: Any) -> None:
        super().__init__(StubEngine(StubEngineConfig(**config)))
        self.held: dict[str, int] = {}

    async def control(self, message: EngineControl) -> Any:
        reply = await super().control(message)
        if isinstance(message, AddHistory):
            for record in message.rollouts:
                self.held[record["problem_id"]] = self.held.get(record["problem_id"], 0) + 1
        return reply

    async def history(self, problem_id: str) -> ProblemSummary | None:
        if problem_id not in self.held:
            return None
        return ProblemSummary(problem_id=problem_id, rollouts=self.held[problem_id], output_tokens=0,
                              policy_versions=[0], prompt_tokens=0, length_p50=None, length_max=None,
                              finish_reasons={})


def test_the_gateway_answers_every_fuzzed_request_as_its_schema_says(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()  # a checkpoint the weights routes can load
    # Small limits keep every batch short; no coalescing window, so no request waits for siblings. The context holds
    # a prompt under 64 tokens at the default max_tokens (256).
    app = create_app(HistoryStub(tokens=4, max_model_len=320),
                     GatewayConfig(token=TOKEN, weights_root=tmp_path, max_batch_samples=64, openai_coalesce_s=0))
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    document = app.openapi()
    resume = schema["/resume"]["POST"]
    failures: list[str] = []
    cases = 0
    start = time.perf_counter()
    try:
        for result in schema.get_all_operations():
            operation = result.ok()
            raw = operation.definition.raw
            documented_501 = "501" in raw["responses"]
            modes = [GenerationMode.POSITIVE]
            if raw.get("parameters") or raw.get("requestBody") or raw.get("security"):
                modes.append(GenerationMode.NEGATIVE)  # nothing to break in a route without inputs
            for mode in modes:
                @settings(max_examples=EXAMPLES.get(operation.label, DEFAULT_EXAMPLES), derandomize=True,
                          database=None, deadline=None, phases=[Phase.explicit, Phase.generate],
                          suppress_health_check=list(HealthCheck))
                @given(case=operation.as_strategy(generation_mode=mode))
                def fuzz(case: schemathesis.Case) -> None:
                    nonlocal cases
                    cases += 1
                    headers = AUTH
                    if mode is GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
                        case.body["model"] = "das"  # the served model: past the 404, into batches and streams
                    if case.operation.label == "POST /v1/rollouts" and cases % 2:
                        headers = {**AUTH, "Accept": MSGPACK}  # half the batches stream msgpack
                    try:
                        response = case.call(headers=headers, timeout=CALL_TIMEOUT_S)
                    except Exception as exc:  # a timeout (the case hung), or an error the app let out (a 500)
                        failures.append(f"{case.operation.label}: {type(exc).__name__}: {exc}")
                        return
                    if response.status_code >= 500 and not (response.status_code == 501 and documented_501):
                        failures.append(f"{case.operation.label}: {response.status_code} {response.text[:300]!r}\n"
                                        f"{case.as_curl_command(headers=headers)}")
                    if (mode is GenerationMode.POSITIVE and response.status_code in (400, 422)
                            and any(rule in refusal_messages(response) for rule in STATED_RULES)
                            and schema_valid_body(document, raw, case.body)):
                        failures.append(f"{case.operation.label}: a schema-valid request refused by a rule the "
                                        f"schema states: {refusal_messages(response)[:300]!r}\n"
                                        f"{case.as_curl_command(headers=headers)}")
                    try:
                        case.validate_response(response, checks=CHECKS, headers=headers)
                    except FailureGroup as exc:  # what the schema does not say
                        failures.append(str(exc)[:1500])
                    if case.operation.label == "POST /pause" and response.status_code == 200:
                        resume.Case(headers=AUTH).call(timeout=CALL_TIMEOUT_S)  # held batches would hang later cases

                fuzz()
    finally:
        shutdown_lifespans()  # the gateway's shutdown: batches still running are aborted
    elapsed = time.perf_counter() - start
    assert not failures, f"{len(failures)} of {cases} cases failed; the first:\n\n" + "\n\n".join(failures[:10])
    assert cases >= MIN_CASES, f"only {cases} cases ran in {elapsed:.0f} s"
    print(f"{cases} cases in {elapsed:.1f} s")
