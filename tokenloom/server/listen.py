"""The server's listening socket, bound before anything slow happens (standard library only).

`tokenloom serve` binds its address first: a port already in use fails in a fraction of a second
with a message naming it, instead of after the model has loaded (uvicorn binds only at start-up).
The bound socket is handed to uvicorn (vLLM's api_server does the same). It does not listen until
uvicorn starts, so clients see 'connection refused' while the model loads, as before.
"""

from __future__ import annotations

import errno
import socket


class PortUnavailableError(OSError):
    """The address cannot be bound (in use, not this machine's, or a privileged port)."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not yet listening; uvicorn's own way (SO_REUSEADDR, IPv6 when
    the host has a colon). Raises PortUnavailableError with a message a user can act on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and the
    # accepted connections inherit it. With proto 0 every response waited ~40 ms on Nagle + delayed ACK
    # (uvicorn writes headers and body separately), which GET /v1/models showed at 44 ms instead of 1.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        reason = exc.strerror or str(exc)
        hint = " (another server is running there? stop it or choose another --port)" \
            if exc.errno == errno.EADDRINUSE else ""
        error = PortUnavailableError(f"cannot listen on {where}: {reason}{hint}")
        error.errno = exc.errno
        raise error from None
    return sock
