"""Admission of new connections to mpo's engine: a connection gets one of the server's few slots (a thread) only
once its request headers, and a small body with them, have arrived whole, within a total deadline.

Without this, a slot was taken at accept and the idle timeout applied per read: connections trickling one header
byte every few seconds held every slot indefinitely, keeping authorized clients at 503, before a key was ever
checked. Here one thread waits for the headers of every new connection at once (a selector: an unfinished
connection costs a socket and a buffer, no thread), closes any that has not sent them whole within
`header_timeout_s` of connecting, and, when more than `max_pending` are waiting, closes the oldest (a client with
the key sends its headers in one go and is never the oldest for long). A connection whose headers are complete is
handed on with the bytes read so far; the key is the first thing checked there.

A request whose body the handler will read (the server's `body_bytes` judges it from the headers: it has the key, or
the engine has none, and the body is small) is held here until that body has arrived too, under the same deadline:
clients trickling a body (headers complete, body one byte a second) took every slot of a keyless engine for as long
as they liked, /health answering 503. Larger bodies (weight buckets) are read by the handler, under a total deadline
that grows with their size (RequestReader.begin_body).
"""

from __future__ import annotations

import collections
import contextlib
import io
import logging
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger(__name__)

# Handed a connection whose request headers are complete, with every byte read from it so far.
Ready = Callable[[socket.socket, Any, bytes], None]
# Given a request's line and headers: how many body bytes to await before handing the connection on (0: none).
BodyBytes = Callable[[bytes], int]

_TIMED_OUT = (b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nConnection: close\r\n"
              b"Content-Length: %d\r\n\r\n%s")
_TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Type: application/json\r\n"
              b"Connection: close\r\nContent-Length: %d\r\n\r\n%s")


def _answer(head: bytes, message: str) -> bytes:
    body = b'{"success": false, "message": "%s"}' % message.encode()
    return head % (len(body), body)


def header_end(data: bytes) -> int | None:
    """The index just past the empty line that ends the request line and headers (CRLF or bare LF lines, as
    http.server reads them), or None while it has not arrived."""
    at = data.find(b"\n") + 1  # past the request line
    while at:
        nl = data.find(b"\n", at)
        if nl < 0:
            return None
        if data[at:nl] in (b"", b"\r"):
            return nl + 1
        at = nl + 1
    return None


@dataclass
class _Pending:
    sock: socket.socket
    address: Any
    deadline: float
    data: bytearray = field(default_factory=bytearray)
    need: int | None = None  # bytes to hold before the hand-over (headers and awaited body), once headers are in


class HeaderGate:
    """Collects request headers of new connections on one thread; see the module docstring."""

    def __init__(self, ready: Ready, *, header_timeout_s: float, max_pending: int, max_header_bytes: int,
                 body_bytes: BodyBytes = lambda head: 0) -> None:
        self.ready, self.header_timeout_s, self.body_bytes = ready, header_timeout_s, body_bytes
        self.max_pending, self.max_header_bytes = max_pending, max_header_bytes
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._incoming: collections.deque[tuple[socket.socket, Any]] = collections.deque()
        self._lock = threading.Lock()
        self._pending: dict[socket.socket, _Pending] = {}  # in arrival order (dicts keep insertion order)
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="mpo-engine-headers", daemon=True)
        self._thread.start()

    def add(self, sock: socket.socket, address: Any) -> None:
        """A connection just accepted (called by the accept loop; returns at once)."""
        with self._lock:
            self._incoming.append((sock, address))
        self._wake()

    def close(self) -> None:
        self._stopped = True
        self._wake()
        self._thread.join(10)
        for pending in list(self._pending.values()):
            self._drop(pending)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):  # already woken (the pipe is full) or closing
            self._wake_w.send(b"x")

    def _run(self) -> None:
        while not self._stopped:
            now = time.monotonic()
            timeout = min((p.deadline for p in self._pending.values()), default=now + 3600.0) - now
            for key, _ in self._selector.select(max(0.0, timeout)):
                if key.fileobj is self._wake_r:
                    with contextlib.suppress(BlockingIOError, OSError):
                        while self._wake_r.recv(4096):
                            pass
                else:
                    pending = self._pending.get(key.fileobj)
                    if pending is not None:
                        self._read(pending)
            self._admit_incoming()
            self._expire()
        self._selector.close()

    def _admit_incoming(self) -> None:
        with self._lock:
            incoming, self._incoming = list(self._incoming), collections.deque()
        for sock, address in incoming:
            sock.setblocking(False)
            pending = _Pending(sock, address, time.monotonic() + self.header_timeout_s)
            self._pending[sock] = pending
            self._selector.register(sock, selectors.EVENT_READ)
            self._read(pending)  # a client's headers are often here already
        while len(self._pending) > self.max_pending:  # the oldest waits longest for its headers: it goes first
            self._drop(next(iter(self._pending.values())))

    def _read(self, pending: _Pending) -> None:
        try:
            chunk = pending.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:  # the client closed or reset
            self._drop(pending)
            return
        pending.data += chunk
        # the request line and headers have arrived (http.server also ends them at a bare LF line)
        if pending.need is None and (b"\r\n\r\n" in pending.data or b"\n\n" in pending.data):
            end = header_end(bytes(pending.data))
            if end is None:  # an empty line before the request line: http.server answers it, not this gate
                end = len(pending.data)
            try:
                pending.need = end + max(0, self.body_bytes(bytes(pending.data[:end])))
            except Exception:  # noqa: BLE001 - the handler parses these headers again and answers them
                log.exception("mpo engine: judging a request's body from its headers failed")
                pending.need = end
        if pending.need is not None and len(pending.data) >= pending.need:
            self._forget(pending)
            try:
                pending.sock.setblocking(True)
                self.ready(pending.sock, pending.address, bytes(pending.data))
            except Exception:  # noqa: BLE001 - one connection's hand-over must never stop the gate
                log.exception("mpo engine: handing over a connection failed")
                self._close(pending.sock)
        elif pending.need is None and len(pending.data) > self.max_header_bytes:
            self._drop(pending, _answer(_TOO_LARGE, f"request headers exceed {self.max_header_bytes} bytes"))

    def _expire(self) -> None:
        now = time.monotonic()
        for pending in [p for p in self._pending.values() if p.deadline <= now]:
            what = "request headers" if pending.need is None else "request body"
            self._drop(pending, _answer(_TIMED_OUT, f"{what} not received within {self.header_timeout_s:g} s "
                                                    f"(--header-timeout-s)"))

    def _forget(self, pending: _Pending) -> None:
        self._pending.pop(pending.sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(pending.sock)

    def _drop(self, pending: _Pending, answer: bytes = b"") -> None:
        self._forget(pending)
        if answer:
            with contextlib.suppress(OSError):
                pending.sock.send(answer)  # non-blocking: a client that does not read gets nothing
        self._close(pending.sock)

    @staticmethod
    def _close(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()


class RequestReader(io.RawIOBase):
    """A connection's input as its handler reads it: first the bytes the gate read, then the socket.

    Between begin_headers() and end_headers() (a kept-alive connection's next request line and headers), the wait
    for the request's first byte is bounded by `idle_timeout_s` and everything after it by one total deadline,
    `header_timeout_s` from that byte, however the bytes trickle in; other reads (bodies) by `idle_timeout_s` each.
    A missed deadline raises TimeoutError, which the handler answers by closing the connection.

    Between begin_body() and the next begin_headers(), the body is read under a deadline that moves with what has
    arrived: `body_timeout_s` plus one second per `min_body_bytes_per_s` bytes received, counted from
    begin_body(). A body at least that fast is never cut (its total bound is body_timeout_s + size / rate); one
    trickled slower loses its slot after about body_timeout_s, whatever size it declared."""

    def __init__(self, sock: socket.socket, prefix: bytes, *, idle_timeout_s: float, header_timeout_s: float,
                 body_timeout_s: float = 10.0, min_body_bytes_per_s: float = float(1 << 20)) -> None:
        super().__init__()
        self._sock, self._prefix, self._at = sock, prefix, 0
        self.idle_timeout_s, self.header_timeout_s = idle_timeout_s, header_timeout_s
        self.body_timeout_s, self.min_body_bytes_per_s = body_timeout_s, min_body_bytes_per_s
        self._deadline: float | None = None
        self._armed = False  # the next byte received starts the header deadline
        self._body_start: float | None = None  # set while a body is read: its deadline moves with its bytes
        self._body_received = 0

    def readable(self) -> bool:
        return True

    def begin_headers(self) -> None:
        self._armed, self._deadline, self._body_start = True, None, None

    def end_headers(self) -> None:
        self._armed, self._deadline = False, None

    def begin_body(self) -> None:
        """The handler reads a request body from now on (see the class docstring for its deadline)."""
        self._armed, self._deadline = False, None
        self._body_start, self._body_received = time.monotonic(), 0

    def limit(self, seconds: float) -> None:
        """Bound every read from now on by one total deadline (draining a refused request's body)."""
        self._armed, self._deadline, self._body_start = False, time.monotonic() + seconds, None

    def readinto(self, buffer: Any) -> int:
        if self._at < len(self._prefix):
            n = min(len(buffer), len(self._prefix) - self._at)
            buffer[:n] = self._prefix[self._at:self._at + n]
            self._at += n
            return n
        timeout = self.idle_timeout_s
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"request not received within {self.header_timeout_s:g} s")
            timeout = min(timeout, left)
        if self._body_start is not None:
            left = (self._body_start + self.body_timeout_s + self._body_received / self.min_body_bytes_per_s
                    - time.monotonic())
            if left <= 0:
                raise TimeoutError(f"request body arrived slower than {self.min_body_bytes_per_s:g} bytes/s after "
                                   f"{self.body_timeout_s:g} s")
            timeout = min(timeout, left)
        self._sock.settimeout(timeout)
        n = self._sock.recv_into(buffer)
        if n and self._armed:
            self._armed, self._deadline = False, time.monotonic() + self.header_timeout_s
        if self._body_start is not None:
            self._body_received += n
        return n
