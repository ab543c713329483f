"""`group_commit`'s pure parts: which units go into the next batch, what an acknowledgement says."""

from __future__ import annotations

from collections import deque
from typing import Any

from coordinator.state.group_commit import committed, disabled, take_batch
from tests.core.nats_bytes_kit import nats_py_bytes


def _unit(*keys: str) -> tuple[list[tuple[str, bytes]], Any]:
    return [(k, b"v") for k in keys], keys


def test_a_batch_takes_units_whole_in_order_up_to_its_size() -> None:
    pending = deque([_unit("g.1", "r.1"), _unit("g.2", "r.2"), _unit("g.3", "r.3")])
    batch = take_batch(pending, 4)
    assert [tag for _, tag in batch] == [("g.1", "r.1"), ("g.2", "r.2")]
    assert [tag for _, tag in pending] == [("g.3", "r.3")]  # whole, for the next batch


def test_a_unit_bigger_than_a_batch_goes_alone() -> None:
    pending = deque([_unit("a", "b", "c"), _unit("d")])
    assert [tag for _, tag in take_batch(pending, 2)] == [("a", "b", "c")]
    assert [tag for _, tag in take_batch(pending, 2)] == [("d",)]
    assert not pending


def test_a_key_written_twice_waits_for_the_next_batch() -> None:
    """The server refuses a batch writing a key twice: the second unit (a retry) waits."""
    pending = deque([_unit("g.1", "r.1"), _unit("g.1", "r.1"), _unit("g.2", "r.2"),
                     _unit("g.3", "r.3")])
    assert [tag for _, tag in take_batch(pending, 4)] == [("g.1", "r.1"), ("g.2", "r.2")]
    assert [tag for _, tag in pending] == [("g.1", "r.1"), ("g.3", "r.3")]  # first in line


def test_what_an_acknowledgement_says() -> None:
    assert committed(b'{"stream":"KV_b","seq":100,"batch":"x.0","count":100}')
    refused = b'{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 1"},' \
              b'"stream":"KV_b","seq":0}'
    assert not committed(refused) and not disabled(refused)
    assert not committed(b'{"stream":"KV_b","seq":1}')  # a plain write's: not a batch
    assert not committed(b"")  # no responders
    off = b'{"error":{"code":400,"err_code":10174,"description":"atomic publish is disabled"}}'
    assert disabled(off) and not committed(off)


def test_a_batchs_commands_are_what_nats_py_writes_for_each_message() -> None:
    """`batch_commands` writes each message as nats-py's `publish` would, in one buffer."""
    from coordinator.state.group_commit import batch_commands

    items = [("gpu.ab.cd.0", b'{"v":2}'), ("rank.ab.0", b""), ("v.ranks.ab.0", b"x" * 300)]
    messages = []
    for seq, (key, value) in enumerate(items, 1):
        headers = {"Nats-Batch-Id": "t.7", "Nats-Batch-Sequence": str(seq),
                   "Nats-Expected-Last-Subject-Sequence": "0"}
        if seq == len(items):
            headers["Nats-Batch-Commit"] = "1"
        messages.append(("$KV.b." + key, "_INBOX.x.7" if seq == len(items) else "", value,
                         headers))
    assert batch_commands("$KV.b.", "t.7", items, "_INBOX.x.7") == nats_py_bytes(messages)
