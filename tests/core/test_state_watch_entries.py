"""`coordinator.state.watch.kv_entry`: what a KV watch's message says, read as nats-py reads it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from coordinator.state.watch import kv_entry, operation


def msg(key: str, reply: str | None, headers: dict[str, str] | None = None) -> SimpleNamespace:
    return SimpleNamespace(subject=f"$KV.b.{key}", reply=reply, data=b"value", headers=headers)


V1 = "$JS.ACK.KV_b.cons.1.42.7.1700000000000000000.3"
V2 = "$JS.ACK.dom.acchash.KV_b.cons.1.43.8.1700000000000000000.0.rand"


@pytest.mark.parametrize(("reply", "revision", "pending"), [(V1, 42, 3), (V2, 43, 0)])
def test_an_entry_carries_its_key_value_revision_and_pending(reply: str, revision: int,
                                                              pending: int) -> None:
    entry, left = kv_entry(msg("v.rank.h.1", reply), "b", "$KV.b.")
    assert entry is not None
    assert (entry.bucket, entry.key, entry.value) == ("b", "v.rank.h.1", b"value")
    assert (entry.revision, entry.delta, left, entry.operation) == (revision, pending, pending,
                                                                     None)


@pytest.mark.parametrize(("headers", "expected"), [
    (None, (True, None)),
    ({"Nats-Expected-Last-Subject-Sequence": "0"}, (True, None)),  # A create's, kept stored.
    ({"KV-Operation": "DEL"}, (True, "DEL")),
    ({"KV-Operation": "PURGE"}, (True, "PURGE")),
    ({"Nats-Marker-Reason": "MaxAge"}, (True, "PURGE")),
    ({"Nats-Marker-Reason": "Purge"}, (True, "PURGE")),
    ({"Nats-Marker-Reason": "Remove"}, (True, "DEL")),
    ({"Nats-Marker-Reason": "Later"}, (False, None)),  # A reason of a newer server: no entry.
])
def test_operations_as_the_watch_of_nats_py_reads_them(
        headers: dict[str, str] | None, expected: tuple[bool, str | None]) -> None:
    assert operation(headers) == expected
    entry, pending = kv_entry(msg("v.job.h", V1, headers), "b", "$KV.b.")
    assert pending == 3
    assert (entry is not None) == expected[0]
    if entry is not None:
        assert entry.operation == expected[1]


@pytest.mark.parametrize("reply", [None, "", "_INBOX.x.1", "$JS.ACK.too.short"])
def test_a_message_without_jetstream_metadata_has_no_pending_count(reply: str | None) -> None:
    entry, pending = kv_entry(msg("v.job.h", reply), "b", "$KV.b.")
    assert pending is None
    assert entry is not None and entry.revision == 0
