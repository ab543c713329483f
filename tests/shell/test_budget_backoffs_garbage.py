"""Garbage in a budget's kept tightening (`budget_backoff.<id>`) is refused, not obeyed.

A non-finite backoff or jitter (JSON's `Infinity`, or `1e400`), or a cap no GPU can hold,
must not reach the new owner's tightener: an infinite backoff pins the group at its floor for
good (it never decays and is written back), an infinite jitter turns the band into NaN (the
group is never tightened again), a cap of 0 W or under is sent as no GPU can take.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from nats.js.api import KeyValueConfig

from coordinator.budget.store import Backoffs

SET_AT = 1_800_000_000.0


async def bucket(nc: Any) -> Any:
    js = nc.jetstream()
    return await js.create_key_value(KeyValueConfig(bucket=f"t-{uuid.uuid4().hex[:12]}"))


@pytest.mark.parametrize("value", [
    b'{"v": 1, "set_at": 1800000000.0, "backoff_w": Infinity, "jitter_w": 1, "caps": []}',
    b'{"v": 1, "set_at": 1800000000.0, "backoff_w": 1e400, "jitter_w": 1, "caps": []}',
    b'{"v": 1, "set_at": 1800000000.0, "backoff_w": 10, "jitter_w": Infinity, "caps": []}',
    b'{"v": 1, "set_at": 1800000000.0, "backoff_w": 10, "jitter_w": 1,'
    b' "caps": [["n1", 0, 1e400]]}',
    b'{"v": 1, "set_at": 1800000000.0, "backoff_w": 10, "jitter_w": 1, "caps": [["n1", 0, 0]]}',
    b'{"v": 1, "set_at": 1800000000.0, "backoff_w": 10, "jitter_w": 1,'
    b' "caps": [["n1", -1, 200]]}',
])
async def test_a_garbage_kept_tightening_is_read_as_none(nc, value: bytes) -> None:
    kv = await bucket(nc)
    await kv.put("budget_backoff.grid", value)
    assert await Backoffs(kv).get("grid", SET_AT) is None
