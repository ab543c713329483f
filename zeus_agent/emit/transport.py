"""The publisher's socket: connect, send without blocking, queue a little, else drop and count.

The event methods (`publisher.py`) call `Transport.send` directly and come back here only
when it raises, so everything else in this module is the slow path: reconnecting (at most
once per `reconnect_interval_s`), the bounded backlog that waits out a full agent queue
(`EAGAIN`: Linux queues only `net.unix.max_dgram_qlen` datagrams per receiver, 10 by
default), counting drops by reason, and `close`. Nothing here blocks or raises into training.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import select
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

from zeus_agent.wire.trainer import Kind, encode_request

logger = logging.getLogger("zeus_agent.emit")

NO_AGENT_ERRNOS = frozenset(
    {errno.ECONNREFUSED, errno.ENOENT, errno.ENOTCONN, errno.ECONNRESET, errno.EPIPE}
)
"""A send or receive failing with one of these means nobody listens at the socket."""
NO_AGENT = "no_agent"
BUFFER_FULL = "buffer_full"
ERROR = "error"
"""The drop reasons, keys of `PublisherStats.dropped_by_reason`."""

_monotonic_ns = time.monotonic_ns


class Transport:
    """The socket to the agent and the delivery of events through it.

    The socket is non-blocking and autobound to an abstract address so the agent can answer
    with `sendto`; requests (`requests.py`) use it directly (`sock`). Events go through
    `send`, which always does what an event's send must do now, so the hot path tests
    nothing: the socket's own `send` while connected (or, once the HELLO reply named the
    GPU's doorbell, the `send` of a second socket connected to it: `use_doorbell`), the
    backlog's `_enqueue` while events wait in it, `_send_detached` while disconnected.
    Only `_route` rebinds it. When `send` raises, the caller hands the event to `failed`.

    Attributes:
        socket_path: The agent's socket.
        sock: The socket (requests send and receive on it; replies come to it).
        send: Send one event datagram (may raise; then call `failed`).
        connected: Whether `sock` is connected to the agent.
        closed: Whether `close` was called.
    """

    def __init__(
        self,
        socket_path: str,
        *,
        pid: int,
        ids: Iterator[int],
        backlog: int,
        reconnect_interval_s: float,
        on_reconnect: Callable[[], None],
        detached: Callable[[], bool],
    ) -> None:
        """Open the socket and try to connect.

        Args:
            socket_path: The agent's socket.
            pid: This process's id, sent with the goodbye.
            ids: Request ids, shared with the requests (the goodbye takes one).
            backlog: Events kept locally while the agent's queue is full.
            reconnect_interval_s: After a failure, try to reconnect at most this often.
            on_reconnect: Called when an event's send found the agent again after a
                failure (to re-introduce the process); not on the first connection, nor on
                a connection a request makes.
            detached: Whether the process runs without an agent on purpose (the owner's
                `detached`): dropped events are then expected and not warned about.
        """
        self.socket_path = socket_path
        self.connected = False
        self.closed = False
        self._detached = detached
        self._pid = pid
        self._ids = ids
        self._on_reconnect = on_reconnect
        self._drops: dict[str, int] = {NO_AGENT: 0, BUFFER_FULL: 0, ERROR: 0}
        self._warned_drops = False
        self._backlog: collections.deque[bytes] = collections.deque()
        self._backlog_max = backlog
        self._retry_interval_ns = int(reconnect_interval_s * 1e9)
        self._retry_at_ns = 0
        self._doorbell: str | None = None
        """The bound GPU's doorbell (the HELLO reply's): events go there while connected."""
        self._bell: socket.socket | None = None
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self.sock.bind("")  # Autobind to an abstract address: the agent replies there.
        self.send: Callable[[bytes], Any] = self._send_detached
        self.connect(_monotonic_ns())

    # ------------------------------------------------------------------ counters
    @property
    def queued(self) -> int:
        """Events waiting in the backlog."""
        return len(self._backlog)

    def dropped_by_reason(self) -> dict[str, int]:
        """A copy of the drop counters, by reason."""
        return dict(self._drops)

    # ------------------------------------------------------------------ connection
    def _route(self) -> None:
        """Point `send` at what an event's send must do in the current state."""
        if not self.connected:
            self.send = self._send_detached
        elif self._backlog:
            self.send = self._enqueue  # Behind the waiting events, in order.
        else:
            self.send = (self._bell or self.sock).send

    def connect(self, now_ns: int) -> bool:
        """Try to connect `sock` (the next try is due `reconnect_interval_s` after `now_ns`)."""
        self._retry_at_ns = now_ns + self._retry_interval_ns
        try:
            self.sock.connect(self.socket_path)
        except OSError:
            return False
        self.connected = True
        self._open_bell()  # A restarted agent opens its doorbells at the same paths.
        return True

    def use_doorbell(self, path: str) -> None:
        """Send events through the GPU's doorbell at `path` (a HELLO reply named it)."""
        if path != self._doorbell or self._bell is None:
            self._doorbell = path
            self._open_bell()

    def _open_bell(self) -> None:
        """While connected: send events through the GPU's doorbell, if the agent named one.

        A second socket connected to it: the events' order is kept (one socket), and the
        doorbell's thread applies a scheduled clock one wake-up sooner than the agent's loop.
        Replies and schedule notices still come to the first socket. If the doorbell cannot
        be reached, events go to the trainers' socket with them.
        """
        self._close_bell()
        if self.connected and self._doorbell is not None:
            self._bell = _connected_socket(self._doorbell)
        self._route()

    def _events_socket(self) -> socket.socket:
        """Where events go while connected: the doorbell's socket, else the trainers'."""
        return self._bell or self.sock

    def _close_bell(self) -> None:
        bell, self._bell = self._bell, None
        if bell is not None:
            bell.close()

    def disconnect(self) -> None:
        """The agent is gone: drop the backlog (counted) and send detached until it is back."""
        self._close_bell()
        self.connected = False
        self._retry_at_ns = _monotonic_ns() + self._retry_interval_ns
        if self._backlog:
            self._drops[NO_AGENT] += len(self._backlog)
            self._backlog.clear()
        self._route()

    def _send_detached(self, data: bytes) -> None:
        """`send` while disconnected: drop, unless it is time to try reconnecting."""
        now = _monotonic_ns()
        if now >= self._retry_at_ns and not self.closed and self.connect(now):
            self._on_reconnect()
            self.send(data)  # Errors go to the caller's handler.
            return
        self._drops[NO_AGENT] += 1
        self._first_drop()

    # ------------------------------------------------------------------ failures and backlog
    def failed(self, data: bytes, exc: Exception) -> None:
        """Slow path of an event send: classify, queue or drop, and count. Never raises."""
        try:
            if isinstance(exc, BlockingIOError):
                self._enqueue(data)
                return
            if isinstance(exc, OSError) and exc.errno in NO_AGENT_ERRNOS:
                self.disconnect()
                self._drops[NO_AGENT] += 1
            else:
                if self._bell is not None:  # The doorbell refuses (EPERM...): go without it.
                    self._close_bell()
                    self._route()
                    with contextlib.suppress(OSError):
                        self.sock.send(data)
                        return
                self._drops[ERROR] += 1
                logger.debug("zeus_agent.emit: event send failed: %r", exc)
            self._first_drop()
        except Exception:  # the hot path must never raise.
            pass

    def _enqueue(self, data: bytes) -> None:
        """Flush the backlog, then send `data` or queue it (bounded)."""
        self._flush_backlog()
        if not self.connected:
            self._drops[NO_AGENT] += 1
            return
        if not self._backlog:
            try:
                self._events_socket().send(data)
                return
            except BlockingIOError:
                pass
            except OSError as e:
                self.failed(data, e)
                return
        if len(self._backlog) < self._backlog_max:
            self._backlog.append(data)
            self._route()
        else:
            self._drops[BUFFER_FULL] += 1
            self._first_drop()

    def _flush_backlog(self) -> None:
        backlog = self._backlog
        if not backlog:
            return
        send = self._events_socket().send
        while backlog and self.connected:
            try:
                send(backlog[0])
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno in NO_AGENT_ERRNOS:
                    self.disconnect()  # Counts the backlog as dropped.
                    return
                self._drops[ERROR] += 1
            backlog.popleft()
        self._route()

    def _first_drop(self) -> None:
        if not self._warned_drops:
            self._warned_drops = True
            if not self._detached():
                logger.warning(
                    "zeus_agent.emit: events to the agent at %s are being dropped (is it "
                    "running and keeping up?); training continues. See emit.stats().",
                    self.socket_path,
                )

    def flush(self) -> None:
        """Try to send events waiting in the backlog (never blocks, never raises)."""
        with contextlib.suppress(Exception):
            self._flush_backlog()

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Flush the backlog (at most 0.1 s), send BYE (best effort), close. Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            deadline = time.monotonic() + 0.1  # Bounded: let the agent take the backlog.
            self._flush_backlog()
            while self._backlog and self.connected and time.monotonic() < deadline:
                select.select([], [self._events_socket()], [], 0.01)
                self._flush_backlog()
            if self.connected:  # After the events, through the same socket.
                send = self._events_socket().send
                send(encode_request(Kind.BYE, self._pid, next(self._ids), {}))
        except Exception:  # Best effort.
            pass
        self._close_bell()
        self.connected = False
        self._route()
        self.sock.close()


def _connected_socket(path: str) -> socket.socket | None:
    """A non-blocking datagram socket connected to `path`, or None if it cannot be."""
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    except OSError:  # (Out of file descriptors: the trainers' socket will do.)
        return None
    try:
        sock.setblocking(False)
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    return sock
