"""The viewer's web app (Starlette): the page, its static files and the JSON API of ``API.md``.

The app holds one loaded run and answers every request from it; model runs take a lock, because
capturing attention registers recorders on the model for the length of a forward pass. Library
errors (:class:`~attnlab.errors.AttnlabError`) become status 400 with ``{"error": message}``.
Every response forbids framing and inline scripts (a Content-Security-Policy), as defence in
depth: the page itself only ever puts token text into text nodes.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from attnlab.errors import AttnlabError, UsageError
from attnlab.experiment import LoadedRun
from attnlab.head_ids import head_ids
from attnlab.viewer.importance import MAX_IMPORTANCE_BYTES, Importance, parse_importance
from attnlab.viewer.payload import describe_model, run_payload
from attnlab.viewer.requests import parse_run_request

__all__ = ["create_app", "STATIC_DIR", "MAX_BODY_BYTES", "SECURITY_HEADERS"]

STATIC_DIR = Path(__file__).with_name("static")
MAX_BODY_BYTES = MAX_IMPORTANCE_BYTES + 4096
"""Largest request body read (an importance CSV fits); a larger one gets status 413."""

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
    loaded: LoadedRun, *, importance: Importance | None = None, allowed_hosts: Sequence[str] | None = None
) -> Starlette:
    """The viewer app for ``loaded``; ``importance`` colours heads from the start.

    ``allowed_hosts`` limits the Host header (against DNS rebinding when serving on localhost);
    None accepts any host.
    """
    heads = frozenset(head_ids(loaded.model))
    lock = threading.Lock()

    def locked_run(body: Any) -> dict[str, Any]:
        request = parse_run_request(body, heads)
        with lock:
            return run_payload(loaded, request)

    async def index(_: Request) -> Response:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html; charset=utf-8")

    async def model_info(_: Request) -> Response:
        return JSONResponse(describe_model(loaded, importance))

    async def run(request: Request) -> Response:
        if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            raise UsageError("send the request as JSON, with Content-Type: application/json")
        body = await _read_body(request)
        try:
            decoded = json.loads(body)
        except (ValueError, UnicodeDecodeError) as error:
            raise UsageError(f"the request body is not valid JSON: {error}") from None
        return JSONResponse(await run_in_threadpool(locked_run, decoded))

    async def load_importance(request: Request) -> Response:
        body = await _read_body(request)
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            raise UsageError("the importance CSV must be UTF-8 text") from None
        return JSONResponse({"importance": parse_importance(text, heads, source="importance CSV")})

    routes = [
        Route("/", index),
        Route("/api/model", model_info),
        Route("/api/run", run, methods=["POST"]),
        Route("/api/importance", load_importance, methods=["POST"]),
        Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
    ]
    middleware = [Middleware(_SecurityHeaders)]
    if allowed_hosts is not None:
        middleware.append(Middleware(_HostCheck, allowed=frozenset(allowed_hosts)))
    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        AttnlabError: _bad_request,
        HTTPException: _http_error,
    }
    return Starlette(routes=routes, middleware=middleware, exception_handlers=handlers)


async def _read_body(request: Request) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise HTTPException(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise HTTPException(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _bad_request(_: Request, error: Exception) -> Response:
    return JSONResponse({"error": str(error)}, status_code=400)


async def _http_error(_: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    return JSONResponse({"error": error.detail}, status_code=error.status_code, headers=error.headers)


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


class _HostCheck:
    """Answers 400 unless the Host header names one of ``allowed`` (a guard against DNS rebinding)."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str]) -> None:
        self.app, self.allowed = app, allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = Headers(scope=scope).get("host", "")
            name = urlsplit(f"//{host}").hostname or ""  # without the port and the brackets of [::1]
            if name not in self.allowed:
                response = JSONResponse({"error": f"this viewer only answers to {', '.join(sorted(self.allowed))}"}, 400)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
