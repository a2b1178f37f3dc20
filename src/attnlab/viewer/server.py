"""The viewer's web app (Starlette): the page, its static files and the JSON API of ``API.md``.

The app holds one loaded run and answers every request from it; model runs take a lock, because
capturing attention registers recorders on the model for the length of a forward pass. Library
errors (:class:`~attnlab.errors.AttnlabError`) become status 400 with ``{"error": message}`` (and
``"field"``, the part at fault, for a :class:`~attnlab.viewer.requests.RequestError`, answered
with its own status). A body is read only after its ``Content-Length`` is checked against the
route's cap, then checked as UTF-8, for its nesting depth and as JSON before it is parsed
(:func:`~attnlab.viewer.requests.decode_json_body`): no request body gets anything but 200, 400 or
413. A body refused before it is read is first read and thrown away (up to
:data:`MAX_DRAIN_BYTES`), so that a client that sends its whole body before it reads the answer
(``Connection: close``, as Python's urllib sends) gets the answer, not a connection reset. A
client that disconnects before its body is whole gets no answer and leaves no traceback. Any other
exception (a bug) is answered 500 with ``{"error": message}`` and reported in one line on stderr,
where the caller gives ``internal_error`` (``attnlab view`` does); else it reaches the server.
Every response forbids framing and inline scripts (a Content-Security-Policy), as defence in
depth: the page itself only ever puts token text into text nodes.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from attnlab.errors import AttnlabError
from attnlab.head_ids import head_ids
from attnlab.run.loaded import LoadedRun
from attnlab.viewer.importance import MAX_IMPORTANCE_BYTES, Importance, parse_importance
from attnlab.viewer.payload import describe_model, run_limits, run_payload
from attnlab.viewer.requests import BodyTooLarge, RequestError, cut, decode_json_body, parse_run_request

__all__ = [
    "create_app",
    "host_name",
    "STATIC_DIR",
    "MAX_BODY_BYTES",
    "MAX_RUN_BODY_BYTES",
    "MAX_DRAIN_BYTES",
    "SECURITY_HEADERS",
]

STATIC_DIR = Path(__file__).with_name("static")
MAX_BODY_BYTES = MAX_IMPORTANCE_BYTES + 4096
"""Largest body of ``POST /api/importance`` (an importance CSV fits); a larger one gets status 413."""
MAX_RUN_BODY_BYTES = 128 * 1024
"""Largest body of ``POST /api/run``: a pretrained LM's 4,096-character input written entirely as
``\\u`` escapes (surrogate pairs: 12 bytes a character) and all 270 heads of SmolLM2 switched off
fit; a larger one gets status 413."""
MAX_DRAIN_BYTES = 64 * 1024 * 1024
"""Most bytes of a refused body (over its cap, or without a ``Content-Length``) the viewer reads and
throws away before it answers, so that a client still sending reads the answer rather than a
connection reset. A body announced as larger, or sent after ``Expect: 100-continue`` (which the
answer tells the client not to send), is answered at once, unread."""

SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'none'"
    ),
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}


def create_app(
    loaded: LoadedRun,
    *,
    importance: Importance | None = None,
    allowed_hosts: Sequence[str] | None = None,
    internal_error: Callable[[Exception], str | None] | None = None,
) -> Starlette:
    """The viewer app for ``loaded``; ``importance`` colours heads from the start.

    ``allowed_hosts`` limits the Host header (against DNS rebinding): names without a port, IPv6
    addresses without brackets, compared case-insensitively; any other Host header gets status
    400. None accepts any host (``attnlab view`` always passes a list).

    ``internal_error`` gives the one-line message of an exception no handler takes (a bug): the
    request is answered 500 with ``{"error": message}`` and the message is printed on stderr,
    instead of the server's traceback. Where it returns None, or is None, the exception reaches
    the server (Starlette answers 500, the server prints the traceback).
    """
    heads = frozenset(head_ids(loaded.model))
    limits = run_limits(loaded)
    lock = threading.Lock()

    def locked_run(body: Any) -> dict[str, Any]:
        request = parse_run_request(body, heads, limits)
        with lock:
            return run_payload(loaded, request)

    async def index(_: Request) -> Response:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html; charset=utf-8")

    async def model_info(_: Request) -> Response:
        return JSONResponse(describe_model(loaded, importance))

    async def run(request: Request) -> Response:
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            raise RequestError("send the request as JSON, with Content-Type: application/json", "Content-Type")
        decoded = decode_json_body(await _read_body(request, MAX_RUN_BODY_BYTES))
        return JSONResponse(await run_in_threadpool(locked_run, decoded))

    async def load_importance(request: Request) -> Response:
        body = await _read_body(request, MAX_BODY_BYTES)
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError("the importance CSV must be UTF-8 text", "body") from None
        return JSONResponse({"importance": parse_importance(text, heads, source="importance CSV")})

    routes = [
        Route("/", index),
        Route("/api/model", model_info),
        Route("/api/run", run, methods=["POST"]),
        Route("/api/importance", load_importance, methods=["POST"]),
        Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
    ]
    middleware = [] if internal_error is None else [Middleware(_InternalErrors, describe=internal_error)]
    middleware.append(Middleware(_SecurityHeaders))
    if allowed_hosts is not None:
        middleware.append(Middleware(_HostCheck, allowed=frozenset(name.lower() for name in allowed_hosts)))
    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        AttnlabError: _bad_request,
        HTTPException: _http_error,
        ClientDisconnect: _client_gone,
    }
    return Starlette(routes=routes, middleware=middleware, exception_handlers=handlers)


async def _read_body(request: Request, cap: int) -> bytes:
    """The body of ``request``, refused unless a Content-Length of at most ``cap`` bytes announces
    it (400 without one, 413 over the cap, after :func:`_discard`); the bytes read are counted too.

    Raises:
        RequestError: (field ``"Content-Length"``) no Content-Length, or one that is not a number.
        BodyTooLarge: the announced length, or the bytes read, over ``cap``.
        ClientDisconnect: the client went away before the body was whole.
    """
    declared = request.headers.get("content-length")
    if declared is None:
        await _discard(request, None)
        raise RequestError("send the request body with a Content-Length header", "Content-Length")
    if not re.fullmatch(r"[0-9]{1,20}", declared.strip()):
        raise RequestError(f"Content-Length {cut(declared, 40)!r} is not a number of bytes", "Content-Length")
    if int(declared) > cap:
        await _discard(request, int(declared))
        raise BodyTooLarge(f"the request body is {int(declared)} bytes; the viewer takes at most {cap}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise BodyTooLarge(f"the request body is larger than {cap} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _discard(request: Request, declared: int | None) -> None:
    """Read and throw away the body of a request about to be refused, up to :data:`MAX_DRAIN_BYTES`:
    none where ``declared`` (its Content-Length) is larger or the client waits for
    ``100 Continue`` before sending it."""
    waits = request.headers.get("expect", "").strip().lower() == "100-continue"
    if waits or (declared is not None and declared > MAX_DRAIN_BYTES):
        return
    read = 0
    async for chunk in request.stream():
        read += len(chunk)
        if read > MAX_DRAIN_BYTES:
            return


class _ErrorResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: an error message quoting any input renders."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _error_json(message: str, status: int, field: str | None = None, headers: Any = None) -> Response:
    content = {"error": message} if field is None else {"error": message, "field": field}
    return _ErrorResponse(content, status_code=status, headers=headers)


async def _bad_request(_: Request, error: Exception) -> Response:
    return _error_json(str(error), getattr(error, "status", 400), getattr(error, "field", None))


async def _client_gone(_: Request, error: Exception) -> Response:
    """The client disconnected before its body was whole: nobody reads an answer, and the server
    (which drops it) prints nothing."""
    return Response(status_code=400)


async def _http_error(_: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    return _error_json(str(error.detail), error.status_code, headers=error.headers)


class _InternalErrors:
    """Prints ``error: METHOD PATH: message`` on stderr for an exception that no handler took, with
    ``message = describe(error)``, and answers it with status 500 and ``{"error": message}`` where
    the response has not started; ``describe`` returning None lets the exception through."""

    def __init__(self, app: ASGIApp, describe: Callable[[Exception], str | None]) -> None:
        self.app, self.describe = app, describe

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as error:  # noqa: BLE001 - the last resort: one line, never a traceback
            message = self.describe(error)
            if message is None:
                raise
            path = cut(" ".join(scope["path"].split()), 200)  # one line, whatever the path holds
            print(f"error: {scope['method']} {path}: {message}", file=sys.stderr, flush=True)
            if not started:
                await _SecurityHeaders(_error_json(message, 500))(scope, receive, send)


class _SecurityHeaders:
    """Adds :data:`SECURITY_HEADERS` to every HTTP response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.decode("latin-1") not in SECURITY_HEADERS]
                headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in SECURITY_HEADERS.items()]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def host_name(header: str) -> str | None:
    """The host name of a Host header, lower case, without the port or an IPv6 address's brackets;
    None for a header that is not ``name``, ``name:port``, ``[address]`` or ``[address]:port``."""
    match = re.fullmatch(r"(?:\[([0-9a-fA-F:.]+)\]|([^:\[\]@/\s]+))(?::[0-9]*)?", header.strip())
    if match is None:
        return None
    return (match[1] or match[2]).lower()


class _HostCheck:
    """Answers 400 unless the Host header names one of ``allowed`` (a guard against DNS rebinding)."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str]) -> None:
        self.app, self.allowed = app, allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and host_name(Headers(scope=scope).get("host", "")) not in self.allowed:
            message = f"this viewer only answers to the host names {', '.join(sorted(self.allowed))}"
            await _error_json(message, 400, "Host")(scope, receive, send)
            return
        await self.app(scope, receive, send)
