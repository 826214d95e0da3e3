"""What every HTTP role (gateway, inference backend, LLM proxy) shares to serve with uvicorn."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import uvicorn

from agl_stream.errors import AglError


class QuietServer(uvicorn.Server):
    """uvicorn without its own signal handling: the role that runs it decides when it stops."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A bound (not yet listening) TCP socket; a taken port is an AglError that says what to do."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    # Accepted connections inherit it. Without it uvicorn's separate header and body writes meet
    # the client's delayed ACK: every response took ~44 ms instead of ~2 (measured on the gateway).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise AglError(f"cannot listen on {host}:{port} ({error}); choose another port (0 picks a free one)") from error
    return sock


def listen(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A listening, non-blocking socket to hand to uvicorn (port 0 is resolved by the caller)."""
    sock = bind(host, port, reuse_port=reuse_port)
    sock.listen(2048)
    sock.setblocking(False)
    return sock
