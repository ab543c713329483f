"""The budgets' tightening survives a takeover (issue 37 item 4), over a real nats-server.

The owner keeps each budget's backoff in the state bucket (`store.Backoffs`) when it moves
enough (`Tightener.worth_keeping`); a replica taking the budgets over starts its tightener from
it (held while the samples still show the old owner's caps) instead of from nothing, which let
the group draw over the cap for the rounds the tightener needs to learn it again. A budget set
again starts afresh; one lifted has its backoff forgotten.
"""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from nats.js.api import KeyValueConfig

from coordinator.budget import enforce
from coordinator.budget.loop import BudgetLoop
from coordinator.budget.store import Backoffs, BudgetView
from zeus_agent.wire.budget import Budget

SET_AT = 1_800_000_000.0


async def bucket(nc: Any) -> Any:
    js = nc.jetstream()
    return await js.create_key_value(KeyValueConfig(bucket=f"t-{uuid.uuid4().hex[:12]}"))


def loop(kv: Any, budgets: dict[str, tuple[Budget, float]]) -> BudgetLoop:
    view = BudgetView()
    view.budgets = budgets
    link: Any = SimpleNamespace(require_state=lambda: SimpleNamespace(kv=kv))
    dummy: Any = None
    return BudgetLoop(link=link, book=dummy, cluster=dummy, jobs=list, cap_lease_s=30.0,
                      view=view)


async def test_a_backoff_is_kept_per_setting_of_its_budget(nc) -> None:
    kv = await bucket(nc)
    store = Backoffs(kv)
    assert await store.get("grid", SET_AT) is None
    await store.put("grid", SET_AT, 412.34)
    assert await store.get("grid", SET_AT) == pytest.approx(412.3)
    assert await store.get("grid", SET_AT + 60) is None  # set again: afresh
    await kv.put("budget_backoff.grid", b"not json")
    assert await store.get("grid", SET_AT) is None  # unreadable: afresh, no error
    await store.delete("grid")
    await store.delete("grid")  # (twice: nothing to forget)
    assert await store.get("grid", SET_AT) is None


async def test_a_new_owner_starts_from_the_backoff_its_predecessor_kept(nc) -> None:
    kv = await bucket(nc)
    budgets = {"grid": (Budget(budget_id="grid", cap_w=9000.0), SET_AT)}
    old = loop(kv, budgets)
    await old.resume_backoffs()  # nothing kept yet: afresh
    assert old.tighteners["grid"].backoff_w == 0.0
    old.tighteners["grid"].backoff_w = 350.0  # the group measured over: the room shrank
    await old.keep_backoffs()
    old.tighteners["grid"].backoff_w = 340.0  # (a small move: not written again)
    await old.keep_backoffs()
    assert await Backoffs(kv).get("grid", SET_AT) == 350.0

    new = loop(kv, budgets)
    await new.resume_backoffs()
    tight = new.tighteners["grid"]
    assert tight.backoff_w == 350.0 and tight.settling == enforce.SETTLE_ROUNDS
    # Samples still showing the old caps change nothing while it settles.
    for _ in range(enforce.SETTLE_ROUNDS):
        assert tight.update(9600.0, 9000.0) == 350.0

    del new.tighteners["grid"]  # the budget was lifted (the plan forgets its tightener)
    await new.keep_backoffs()
    assert await Backoffs(kv).get("grid", SET_AT) is None


def test_a_backoff_is_written_when_it_moves_by_a_tenth() -> None:
    tight = enforce.Tightener(backoff_w=0.0)
    assert not tight.worth_keeping(None)  # nothing to keep
    tight.backoff_w = 200.0
    assert tight.worth_keeping(None)
    assert not tight.worth_keeping(190.0) and tight.worth_keeping(170.0)
    tight.backoff_w = 0.0
    assert tight.worth_keeping(0.5 + 1.0)  # decayed to nothing: written (at least 1 W moved)
