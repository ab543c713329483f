"""`coordinator.bulk` refuses what nats-py's `publish` refuses: a connection draining its
publishers (`is_connected` is still True then, `publish` raises `ConnectionDrainingError`).

On main the buffer took the commands: a GPU command `request_all` sent while the replica's
connection drained went out with nats-py's last flush, its reply lost (the inbox was
drained): reported as not taken, though the GPU took it.
"""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client
from nats.errors import ConnectionDrainingError

from coordinator import bulk


def _draining() -> Client:
    nc = Client()
    nc._status = Client.DRAINING_PUBS  # noqa: SLF001 - nats-py's state while drain() ends
    return nc


def test_nats_py_refuses_a_publish_while_its_publishers_drain() -> None:
    nc = _draining()
    assert nc.is_connected  # (nats-py says so while it drains.)
    with pytest.raises(ConnectionDrainingError):
        asyncio.run(nc.publish("a.b", b"x"))


def test_bulk_does_not_send_while_the_publishers_drain() -> None:
    assert not bulk.sendable(_draining(), ["a.b"], [b"x"])
