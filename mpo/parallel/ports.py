"""A free TCP port on this host (for rendezvous, engine servers and weight-update groups started here)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS just reported free. Another process may take it before it is bound again; callers that start
    a server on it retry or fail loudly."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
