"""A free TCP port on this host (for rendezvous, engine servers and weight-update groups started here), and whether
a host name is this host's loopback."""

from __future__ import annotations

import ipaddress
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS just reported free. Another process may take it before it is bound again; callers that start
    a server on it retry or fail loudly."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def is_loopback(host: str) -> bool:
    """True when every address `host` names is a loopback address (127.0.0.0/8, ::1, "localhost"). An empty host
    or 0.0.0.0 means every interface: not loopback. A name that does not resolve counts as not loopback."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    if not host:
        return False
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)
