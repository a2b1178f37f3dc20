"""Serving the viewer: a listening socket first (so a taken port is a clear error), then uvicorn."""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Sequence

import uvicorn
from starlette.applications import Starlette

from attnlab.errors import UsageError

__all__ = ["listen", "make_server", "is_loopback", "url_of", "allowed_hosts", "LOOPBACK_HOSTS"]

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
"""Host names every viewer answers to (the only ones, when it listens on a loopback address)."""
_LABEL = r"[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?"
_HOST_NAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*")
"""A DNS name: dot-separated labels of letters, digits, ``_`` and inner ``-``; no port, no wildcard."""


def allowed_hosts(
    host: str, names: Sequence[str], *, host_flag: str = "host", names_flag: str = "allowed host"
) -> tuple[str, ...]:
    """The Host header names a viewer listening on ``host`` answers to: :data:`LOOPBACK_HOSTS` and
    ``names`` (the ``--allow-host`` values), lower case, IPv6 addresses without brackets. Errors
    name the two settings as ``host_flag`` and ``names_flag`` (the CLI passes its flags).

    A viewer on a non-loopback address answers only to names given explicitly, so that a web page
    elsewhere cannot reach it through a DNS name of its own (DNS rebinding).

    Raises:
        UsageError: ``host`` is not a loopback address and ``names`` is empty, or a name is not a
            host name or IP address (a port, a scheme or a wildcard in it).
    """
    if not names and not is_loopback(host):
        raise UsageError(
            f"{host_flag} {host} is not a loopback address: name each host name the viewer may answer to "
            f"with {names_flag} NAME (repeatable), e.g. {names_flag} myhost.local"
        )
    return tuple(dict.fromkeys([*LOOPBACK_HOSTS, *(_check_host_name(name, names_flag) for name in names)]))


def _check_host_name(name: str, flag: str) -> str:
    bare = name[1:-1] if name.startswith("[") and name.endswith("]") else name
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        pass
    if _HOST_NAME.fullmatch(bare):
        return bare.lower()
    raise UsageError(
        f"{flag} {name!r}: not a host name or IP address; give it without a scheme, port or "
        "wildcard, like myhost.local or 192.168.1.20"
    )


def listen(host: str, port: int, *, host_flag: str = "host") -> socket.socket:
    """A socket bound to ``host:port`` and listening (port 0 picks a free port); an address that
    does not resolve is named after ``host_flag``."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, UnicodeError) as error:
        raise UsageError(f"{host_flag} {host!r}: {error}") from None
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
