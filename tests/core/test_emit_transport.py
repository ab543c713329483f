"""`emit.transport.Transport` routes: `send` always does what an event's send must do now.

The event methods call `Transport.send` without testing anything, so the transport must
rebind it whenever its state changes: the socket's own `send` while connected and nothing
waits, the backlog's `_enqueue` while events wait (new events go behind them, in order), the
doorbell's `send` once one is open, `_send_detached` once the agent is gone.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from zeus_agent.emit.publisher import Publisher
from zeus_agent.emit.transport import Transport
from zeus_agent.wire.trainer import EventDatagram, Kind, decode_datagram


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "agent.sock"))
    sock.setblocking(False)
    yield sock
    sock.close()


def _drain(sock: socket.socket) -> list[EventDatagram]:
    events = []
    while True:
        try:
            datagram = decode_datagram(sock.recv(65536))
        except BlockingIOError:
            return events
        if isinstance(datagram, EventDatagram):
            events.append(datagram)


def _fill(pub: Publisher) -> None:
    """Step until the agent's queue is full and events wait in the backlog."""
    for _ in range(1000):
        pub.step_begin()
        if pub.stats().queued:
            return
    raise AssertionError("the receiver's queue never filled")


def test_send_follows_the_backlog_and_the_doorbell(tmp_path: Path, receiver: socket.socket):
    pub = Publisher(socket_path=str(tmp_path / "agent.sock"), gpu_index=0)
    transport: Transport = pub._transport
    try:
        assert transport.send == transport.sock.send
        _fill(pub)
        assert transport.send == transport._enqueue  # behind the waiting events
        pub.step_end()
        assert pub.stats().queued == 2

        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as bell:
            bell.bind(str(tmp_path / "agent.sock.gpu0"))
            bell.setblocking(False)
            transport.use_doorbell(str(tmp_path / "agent.sock.gpu0"))
            assert transport._bell is not None
            assert transport.send == transport._enqueue  # the doorbell waits its turn too
            events = _drain(receiver)
            pub.flush()
            assert pub.stats().queued == 0
            assert transport.send == transport._bell.send
            pub.step_begin()
            events += _drain(receiver) + _drain(bell)
        kinds = [e.kind for e in events]
        assert kinds[-2:] == [Kind.STEP_END, Kind.STEP_BEGIN]
        steps = [e.a for e in events if e.kind is Kind.STEP_BEGIN]
        assert steps == list(range(len(steps)))  # in order, none lost
        assert pub.stats().dropped == 0
    finally:
        pub.close()
    assert transport.send == transport._send_detached


def test_a_lost_agent_drops_the_backlog_and_sends_detached(
    tmp_path: Path, receiver: socket.socket
) -> None:
    pub = Publisher(socket_path=str(tmp_path / "agent.sock"), gpu_index=0,
                    reconnect_interval_s=60)
    transport = pub._transport
    try:
        _fill(pub)
        queued = pub.stats().queued
        receiver.close()
        os.unlink(tmp_path / "agent.sock")
        pub.step_begin()  # the flush finds nobody
        stats = pub.stats()
        assert not stats.connected and stats.queued == 0
        assert stats.dropped_by_reason["no_agent"] == queued + 1
        assert transport.send == transport._send_detached
        pub.step_end()
        assert pub.stats().dropped_by_reason["no_agent"] == queued + 2
        assert pub.stats().sent + pub.stats().dropped == pub.stats().events
    finally:
        pub.close()
