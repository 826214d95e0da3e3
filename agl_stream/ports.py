"""Free TCP ports on a host, chosen by binding port 0 (the local stack, its roles and the tests)."""

from __future__ import annotations

import socket

from agl_stream.errors import AglError

__all__ = ["free_port", "free_port_run", "free_ports"]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports free right now (all held open while choosing, so no repeats)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port_run(count: int, host: str = "127.0.0.1") -> int:
    """The first of ``count`` consecutive ports free right now (a local cluster's ports, for tests)."""
    for _ in range(200):
        first = free_ports(1, host)[0]
        if first + count > 65535:
            continue
        sockets = []
        try:
            for port in range(first, first + count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(sock)
                sock.bind((host, port))
            return first
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise AglError(f"found no {count} consecutive free ports on {host}")


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on ``host`` (for tests)."""
    return free_ports(1, host)[0]
