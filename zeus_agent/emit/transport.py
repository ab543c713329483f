"""The publisher's socket: connect, send without blocking, queue a little, else drop and count.

The event methods (`publisher.py`) call `_send` directly and come here only when it raises or
the backlog is not empty, so everything in this module is the slow path: reconnecting (at most
once per `reconnect_interval_s`), the bounded backlog that waits out a full agent queue
(`EAGAIN`: Linux queues only `net.unix.max_dgram_qlen` datagrams per receiver, 10 by
default), counting drops by reason, and `close`. Nothing here blocks or raises into training.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import itertools
import logging
import select
import socket
import time
from collections.abc import Callable
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
    """The socket and its delivery state, the base of `Publisher`.

    `Publisher.__init__` sets the state below (one constructor for every layer) and opens the
    socket: non-blocking, autobound to an abstract address so the agent can answer with
    `sendto`. `_send` is the socket's `send` while connected (or, once the HELLO reply named
    the GPU's doorbell, the `send` of a second socket connected to it: `_open_bell`) and
    `_send_detached` otherwise, so the hot path never tests the connection.
    """

    socket_path: str
    connected: bool
    detached: bool
    _sock: socket.socket
    _send: Callable[[bytes], Any]
    _pid: int
    _ids: itertools.count[int]
    _drops: dict[str, int]
    _warned_drops: bool
    _backlog: collections.deque[bytes]
    _backlog_max: int
    _retry_interval_ns: int
    _retry_at_ns: int
    _closed: bool
    _doorbell: str | None
    _bell: socket.socket | None

    # ------------------------------------------------------------------ connection
    def _connect(self, now_ns: int) -> bool:
        self._retry_at_ns = now_ns + self._retry_interval_ns
        try:
            self._sock.connect(self.socket_path)
        except OSError:
            return False
        self._send = self._sock.send
        self.connected = True
        self._open_bell()  # A restarted agent opens its doorbells at the same paths.
        return True

    def _open_bell(self) -> None:
        """While connected: send events through the GPU's doorbell, if the agent named one.

        A second socket connected to it: the events' order is kept (one socket), and the
        doorbell's thread applies a scheduled clock one wake-up sooner than the agent's loop.
        Replies and schedule notices still come to the first socket. If the doorbell cannot
        be reached, events go to the trainers' socket with them.
        """
        self._close_bell()
        if not self.connected:
            return
        self._send = self._sock.send
        if self._doorbell is None:
            return
        try:
            bell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        except OSError:  # (Out of file descriptors: the trainers' socket will do.)
            return
        try:
            bell.setblocking(False)
            bell.connect(self._doorbell)
        except OSError:
            bell.close()
            return
        self._bell = bell
        self._send = bell.send

    def _events_socket(self) -> socket.socket:
        """Where events go while connected: the doorbell's socket, else the trainers'."""
        return self._bell or self._sock

    def _close_bell(self) -> None:
        bell, self._bell = self._bell, None
        if bell is not None:
            bell.close()

    def _disconnect(self) -> None:
        self._close_bell()
        self._send = self._send_detached
        self.connected = False
        self._retry_at_ns = _monotonic_ns() + self._retry_interval_ns
        if self._backlog:
            self._drops[NO_AGENT] += len(self._backlog)
            self._backlog.clear()

    def _send_detached(self, data: bytes) -> None:
        """`_send` while disconnected: drop, unless it is time to try reconnecting."""
        now = _monotonic_ns()
        if now >= self._retry_at_ns and not self._closed and self._connect(now):
            self._rebind()
            self._send(data)  # Errors go to the caller's handler.
            return
        self._drops[NO_AGENT] += 1
        self._first_drop()

    def _rebind(self) -> None:
        """Re-introduce the process to an agent found after a failure (`Requests` does)."""

    # ------------------------------------------------------------------ failures and backlog
    def _failed(self, data: bytes, exc: Exception) -> None:
        """Slow path of an event send: classify, queue or drop, and count. Never raises."""
        try:
            if isinstance(exc, BlockingIOError):
                self._enqueue(data)
                return
            if isinstance(exc, OSError) and exc.errno in NO_AGENT_ERRNOS:
                self._disconnect()
                self._drops[NO_AGENT] += 1
            else:
                if self._bell is not None:  # The doorbell refuses (EPERM...): go without it.
                    self._close_bell()
                    self._send = self._sock.send
                    with contextlib.suppress(OSError):
                        self._sock.send(data)
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
                self._send(data)
                return
            except BlockingIOError:
                pass
            except OSError as e:
                self._failed(data, e)
                return
        if len(self._backlog) < self._backlog_max:
            self._backlog.append(data)
        else:
            self._drops[BUFFER_FULL] += 1
            self._first_drop()

    def _flush_backlog(self) -> None:
        backlog = self._backlog
        send = self._events_socket().send
        while backlog and self.connected:
            try:
                send(backlog[0])
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in NO_AGENT_ERRNOS:
                    self._disconnect()  # Counts the backlog as dropped.
                    return
                self._drops[ERROR] += 1
            backlog.popleft()

    def _first_drop(self) -> None:
        if not self._warned_drops:
            self._warned_drops = True
            if not self.detached:
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
        if self._closed:
            return
        self._closed = True
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
        self._send = self._send_detached
        self.connected = False
        self._sock.close()
