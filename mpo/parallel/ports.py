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


def is_local_host(host: str) -> bool:
    """True when `host` is this machine: a loopback name, this host's name, or an address of one of its interfaces
    (the address the kernel would send from to reach it is the address itself)."""
    if is_loopback(host):
        return True
    if not host:
        return False
    if host in (socket.gethostname(), socket.getfqdn()):
        return True
    try:
        addresses = {info[4][0].split("%")[0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    for address in addresses:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.bind((address, 0))  # only an address of this host can be bound
            return True
        except OSError:
            continue
    return False


def routable_address(peer_host: str) -> str:
    """This host's address on the route to peer_host (what a peer should dial to reach us): the source address the
    kernel picks for a UDP 'connection' to it (no packet is sent). Loopback for a loopback peer."""
    if is_loopback(peer_host):
        return "127.0.0.1"
    family = socket.AF_INET6 if ":" in peer_host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((peer_host.strip("[]"), 9))
        return probe.getsockname()[0]
