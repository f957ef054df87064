"""What the gateway does before a route sees a request, against clients that send too much, too slowly or without
a token (issue 48):

- `RequestGuard`, an ASGI middleware: the bearer token is checked from the headers, and a body over the limit
  (by its Content-Length) refused, before one byte of the body is read; the body must then arrive within
  `body_timeout_s` of the headers, else 408. A refusal while a body may still be coming says `Connection: close`,
  so the server drops the connection instead of reading the rest.
- `header_deadline_protocol(seconds)`: uvicorn's HTTP protocol with a deadline on the request line and headers
  (uvicorn has none: its keep-alive timeout ends at the first byte of the next request, and a fresh connection
  has no timeout at all), so a slowloris sender is answered 408 and closed.
- `OffloopJsonRoute`: FastAPI's route, with a large JSON body parsed and validated against the route's body model
  in a worker thread that yields the interpreter between objects, so a 60 MB history import does not stall
  `/healthz` while it is read.
"""

from __future__ import annotations

import asyncio
import email.message
import hmac
import json
from collections.abc import Callable, Coroutine
from typing import Any

import uvicorn
from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.datastructures import DefaultPlaceholder
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import SecretStr
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

try:  # uvicorn's default parser when installed (uvicorn[standard], vLLM's dependency); h11 otherwise
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _Parser
except ImportError:  # pragma: no cover - httptools is installed wherever vLLM is
    _Parser = H11Protocol  # type: ignore[assignment, misc]

# Bodies from this size on are parsed off the event loop; below it the parse takes well under a millisecond.
OFFLOOP_JSON_BYTES = 1 << 20

ErrorBody = Callable[[str, int, str], dict[str, Any]]
"""(path, status, message) -> the JSON error body in the shape the route at `path` answers in."""


def _header(scope: Scope, name: bytes) -> bytes | None:
    return next((v for k, v in scope["headers"] if k == name), None)


def _body_may_follow(scope: Scope) -> bool:
    """Whether the client may still be sending a body: a Content-Length above 0, or a chunked one."""
    length = _header(scope, b"content-length")
    return (length is not None and length.strip() not in (b"", b"0")) or _header(scope, b"transfer-encoding") \
        is not None


class RequestGuard:
    """ASGI middleware in front of every route. Paths in `open_paths` (the probes, the schema) need no token.

    Invariants: a request without the token is answered 401 from its headers alone, its body never read; a
    Content-Length over `max_body_bytes` is 413 the same way; a body that has not fully arrived `body_timeout_s`
    after the headers is 408, however it trickles. Bytes received beyond the limit (a chunked body) are 413 as soon
    as they pass it. A refusal that leaves a body unread closes the connection."""

    def __init__(self, app: ASGIApp, *, token: SecretStr | None, max_body_bytes: int, body_timeout_s: float,
                 open_paths: frozenset[str], error_body: ErrorBody,
                 on_body_timeout: Callable[[], None] | None = None) -> None:
        self.app = app
        self._token = token.get_secret_value().encode() if token is not None else None
        self._limit = max_body_bytes
        self._body_timeout_s = body_timeout_s
        self._open = open_paths
        self._error_body = error_body
        self._on_body_timeout = on_body_timeout

    def _authorized(self, scope: Scope) -> bool:
        if self._token is None or scope["path"] in self._open:
            return True
        scheme, _, given = (_header(scope, b"authorization") or b"").partition(b" ")
        # compare_digest on every request, even without the Bearer scheme: no timing tells a wrong scheme apart
        return hmac.compare_digest(given.strip(), self._token) and scheme.lower() == b"bearer"

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, status: int, message: str,
                      headers: dict[str, str] | None = None) -> None:
        headers = dict(headers or {})
        if _body_may_follow(scope):
            headers["Connection"] = "close"
        await JSONResponse(self._error_body(scope["path"], status, message), status, headers)(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self._authorized(scope):
            await self._refuse(scope, receive, send, 401, "missing or wrong bearer token",
                               {"WWW-Authenticate": "Bearer"})
            return
        too_large = f"the request body is over {self._limit} bytes (max_body_bytes)"
        declared = _header(scope, b"content-length") or b""
        if declared.isdigit() and int(declared) > self._limit:
            await self._refuse(scope, receive, send, 413, too_large)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._body_timeout_s
        received = 0
        body_done = not _body_may_follow(scope)
        responded = False

        async def guarded_receive() -> Message:
            nonlocal received, body_done
            if body_done or responded:  # what is left to hear is the disconnect: no deadline on that
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                if self._on_body_timeout is not None:
                    self._on_body_timeout()
                # FastAPI's body reading passes an HTTPException on as it is; the app's handlers answer it
                raise HTTPException(408, f"the request body did not arrive within {self._body_timeout_s:g} s "
                                         f"(body_timeout_s)", headers={"Connection": "close"}) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self._limit:
                    raise HTTPException(413, too_large, headers={"Connection": "close"})
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        async def watched_send(message: Message) -> None:
            nonlocal responded
            responded = True
            await send(message)

        await self.app(scope, guarded_receive, watched_send)


def header_deadline_protocol(header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (pass it as `uvicorn.Config(http=...)`) with a deadline on request heads: a
    connection must complete a request's line and headers within `header_timeout_s` of opening, or of the first
    byte of its next request; else it gets 408 and is closed. Idle time between requests stays uvicorn's
    `timeout_keep_alive`. Parser-agnostic: a request's head is complete once the protocol starts its cycle."""

    class HeaderDeadline(_Parser):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None
        _waiting_cycle: object = None  # the cycle that was current when the timer was armed

        def _arm(self) -> None:
            self._waiting_cycle = self.cycle
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._head_timer is not None and self.cycle is not self._waiting_cycle:
                self._disarm()  # the head is complete: the app runs (or waits behind the one running)
            if (self._head_timer is None and not self.transport.is_closing() and self.cycle is not None
                    and self.cycle.response_complete):
                self._arm()  # the first bytes of the next request on a kept-alive connection

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or self.cycle is not self._waiting_cycle:
                return
            body = json.dumps({"detail": f"the request head did not arrive within {header_timeout_s:g} s "
                                         f"(header_timeout_s)"}).encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
            self.transport.close()

    return HeaderDeadline


def server_config(app: ASGIApp, header_timeout_s: float, **options: Any) -> uvicorn.Config:
    """uvicorn's Config for serving the gateway: its HTTP protocol with the header deadline
    (`header_deadline_protocol`); `options` are uvicorn's own (host, port, log_level, ...)."""
    return uvicorn.Config(app, http=header_deadline_protocol(header_timeout_s), **options)


def _dict_yielding(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # A Python-level hook: the interpreter may switch threads here, between objects (the C parser never releases
    # the GIL by itself), so the event loop's thread runs while a large body parses.
    return dict(pairs)


def parse_json_yielding(body: bytes) -> Any:
    """`json.loads(body)`, letting other threads run between the objects it builds."""
    return json.loads(body, object_pairs_hook=_dict_yielding)


def _short_errors(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validation errors without the echoed input: the input of a large body's error can be the whole body (a
    record list's own validator reports on the list), which would be encoded and sent back on the event loop. The
    location and message say what was wrong."""
    return [{"type": e["type"], "loc": e["loc"], "msg": e["msg"]} for e in errors]


class OpenRoute(APIRoute):
    """A route that needs no token (the probes): the gateway passes every such route's path to `RequestGuard` as
    open, so being open is a property of the route, not a list kept elsewhere."""


def open_paths(app: FastAPI) -> frozenset[str]:
    """The paths `RequestGuard` lets through without a token: every `OpenRoute`'s, and FastAPI's schema and docs."""
    routes = {route.path for route in app.routes if isinstance(route, OpenRoute)}
    docs = {app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url}
    return frozenset(routes | {path for path in docs if path is not None})


class OffloopJsonRoute(APIRoute):
    """A route whose JSON body, when larger than OFFLOOP_JSON_BYTES, is parsed and validated in a worker thread:
    Starlette's `Request.json()` returns what is cached on the request, and FastAPI's own validation of an instance
    of the body model returns it as it is (pydantic does not revalidate instances), so the loop does neither.

    Invariant: the answers are FastAPI's own (a body that is not JSON is 422 `json_invalid` at the position; an
    invalid one 422 naming each field at fault) except that a large body's validation errors do not echo their
    input (`_short_errors`). The parse yields the interpreter between objects, and so does validation wherever it
    runs Python (the history records' checks); pydantic's compiled part holds it for about 1 us a record.
    Routes with several body parameters (FastAPI embeds them) are parsed off the loop and validated by FastAPI."""

    def _parsed_as_json(self, content_type: str | None) -> bool:
        """Whether FastAPI parses a body with this Content-Type as JSON (fastapi.routing's rule, mirrored)."""
        if content_type is None:
            strict = self.strict_content_type
            return not (strict.value if isinstance(strict, DefaultPlaceholder) else strict)
        message = email.message.Message()
        message["content-type"] = content_type
        subtype = message.get_content_subtype()
        return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))

    def _parse_and_validate(self, body: bytes) -> Any:
        """Runs in a worker thread: the parsed body, as the route's body model when FastAPI validates it as one.
        RequestValidationError as FastAPI's would be, with `_short_errors`."""
        try:
            parsed = parse_json_yielding(body)
        except json.JSONDecodeError as exc:
            raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos),
                                           "msg": "JSON decode error", "input": {}, "ctx": {"error": exc.msg}}]
                                         ) from None
        # FastAPI validates a single body parameter as the whole body; embedded ones it validates field by field
        if self.body_field is None or getattr(self, "_embed_body_fields", True):
            return parsed
        value, errors = self.body_field.validate(parsed, {}, loc=("body",))
        if errors:
            raise RequestValidationError(_short_errors(errors))
        return value

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def parse_off_loop(request: Request) -> Response:
            if _body_may_follow(request.scope) and self._parsed_as_json(request.headers.get("content-type")):
                body = await request.body()
                if len(body) >= OFFLOOP_JSON_BYTES:
                    try:
                        request._json = await asyncio.to_thread(self._parse_and_validate, body)
                    except (UnicodeDecodeError, RecursionError):  # FastAPI's own answer: it fails as fast (at the
                        pass  # decoding, or at the nesting depth)
            return await handler(request)

        return parse_off_loop
