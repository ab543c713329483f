"""`coordinator.bulk`: many messages' protocol commands, byte for byte what nats-py writes."""

from __future__ import annotations

from typing import Any

import pytest

from coordinator import bulk
from tests.core.nats_bytes_kit import nats_py_bytes


def test_commands_are_what_nats_py_writes() -> None:
    lease = {"Zeus-Lease": "r1 3f2a 17 1765100000.250000 0123abcd"}
    messages = [("z.gpu.node0001.0.cmd", "_INBOX.a.0", b"\x81\xa2op\xa4info", lease),
                ("z.gpu.node0001.1.cmd", "", b"", None),
                ("$KV.b.rank.ab.7", "_INBOX.a.1", b"x" * 5000, {"A": "1", "B-c": "two words"})]
    built = b"".join(bulk.command(s, r, None if h is None else bulk.header_block(h), p)
                     for s, r, p, h in messages)
    assert built == nats_py_bytes(messages)


@pytest.mark.parametrize("headers", [{"Bad Name": "1"}, {"A": " padded "}, {"A": "a\r\nb"},
                                     {"": "1"}, {"A": "caf\u00e9"}])
def test_headers_nats_py_would_change_are_not_built(headers: dict[str, str]) -> None:
    """A header nats-py would refuse or rewrite goes nats-py's way (`header_block` refuses)."""
    with pytest.raises(ValueError):
        bulk.header_block(headers)


class _Connected:
    is_connected = True
    is_draining_pubs = False
    max_payload = 100

    async def _send_command(self, cmd: bytes) -> None: ...

    async def _flush_pending(self) -> None: ...


def test_what_goes_through_the_buffer_and_what_does_not() -> None:
    nc: Any = _Connected()
    assert bulk.sendable(nc, ["a.b", "$KV.x.y"], [b"1", b"x" * 100])
    assert not bulk.sendable(nc, ["a.b"], [b"x" * 101])  # over the server's limit
    assert not bulk.sendable(nc, ["a b"], [b""])  # a subject nats-py refuses
    assert not bulk.sendable(nc, [""], [b""])
    assert not bulk.sendable(nc, ["a.\u00e9"], [b""])
    nc.is_connected = False  # (Reconnecting: nats-py's rules.)
    assert not bulk.sendable(nc, ["a.b"], [b""])
    assert not bulk.sendable(object(), ["a.b"], [b""])

