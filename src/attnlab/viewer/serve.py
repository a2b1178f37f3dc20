"""Serving the viewer: a listening socket first (so a taken port is a clear error), then uvicorn."""

from __future__ import annotations

import ipaddress
import socket

import uvicorn
from starlette.applications import Starlette

from attnlab.errors import UsageError

__all__ = ["listen", "make_server", "is_loopback", "url_of", "LOOPBACK_HOSTS"]

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
"""Host names a viewer listening on a loopback address answers to."""


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` and listening (port 0 picks a free port)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, UnicodeError) as error:
        raise UsageError(f"--host {host!r}: {error}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(64)
    except OSError as error:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    sock.set_inheritable(True)
    return sock


def make_server(app: Starlette, *, log_level: str = "warning") -> uvicorn.Server:
    """A uvicorn server for ``app``; run it with ``server.run(sockets=[listen(...)])``."""
    return uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="off"))


def is_loopback(host: str) -> bool:
    """True when ``host`` names this machine only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def url_of(sock: socket.socket) -> str:
    """The http URL of a listening socket."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"
