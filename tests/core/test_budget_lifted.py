"""The record of a lifted budget's GPUs (`LiftedCaps`) as the budgets' view reads it: kept
while readable, dropped when purged, and a garbage value refused without stopping the view."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from coordinator.budget.store import LIFTED_PREFIX, BudgetView, decode_lifted


def entry(value: bytes, op: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(key=f"{LIFTED_PREFIX}grid", value=value, operation=op)


def test_a_record_is_kept_then_dropped_when_purged() -> None:
    view = BudgetView()
    raw = json.dumps({"v": 1, "gpus": [["n1", 1], ["n0", 0]], "until": 1e9}).encode()
    asyncio.run(view.on_lifted(entry(raw)))
    assert view.lifted == {"grid": ([("n1", 1), ("n0", 0)], 1e9)}
    asyncio.run(view.on_lifted(entry(b"", "PURGE")))
    assert view.lifted == {}


@pytest.mark.parametrize("raw", [
    b"{", b"[]", b'{"v": 2, "gpus": [], "until": 1}', b'{"v": 1, "gpus": [["n", -1]], "until": 1}',
    b'{"v": 1, "gpus": [], "until": Infinity}', b'{"v": 1, "gpus": [["n"]], "until": 1}',
    b'{"v": 1, "until": 1}', b'{"v": 1, "gpus": [["n", 0]], "until": "soon"}',
])
def test_garbage_is_refused_and_the_view_goes_on(raw: bytes) -> None:
    with pytest.raises(ValueError):
        decode_lifted(raw)
    view = BudgetView()
    view.lifted["grid"] = ([("n", 0)], 1.0)
    asyncio.run(view.on_lifted(entry(raw)))  # Logged, not raised.
    assert view.lifted == {}
