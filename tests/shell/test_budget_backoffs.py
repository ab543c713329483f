"""The budgets' tightening survives a takeover (issue 37 item 4), over a real nats-server.

The owner keeps each budget's backoff and the caps it sent in the state bucket
(`store.Backoffs`) when they move (`Tightener.worth_keeping`); a replica taking the budgets
over starts its tightener from that backoff (the samples show the caps in force, its
predecessor's: it acts on them at once) and for a few rounds sends no cap above its
predecessor's (`enforce.guarded`),
instead of planning from nothing, which let the group draw over the cap for the rounds the
tightener needs to learn it again. A budget set again starts afresh; one lifted has its
tightening forgotten.
"""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from nats.js.api import KeyValueConfig

from coordinator.budget import allocator as alloc
from coordinator.budget import enforce
from coordinator.budget.loop import BudgetLoop
from coordinator.budget.store import Backoffs, BudgetView
from zeus_agent.wire.budget import Budget

SET_AT = 1_800_000_000.0
CAPS = {("n1", 0): 225, ("n1", 1): 150}


async def bucket(nc: Any) -> Any:
    js = nc.jetstream()
    return await js.create_key_value(KeyValueConfig(bucket=f"t-{uuid.uuid4().hex[:12]}"))


def loop(kv: Any, budgets: dict[str, tuple[Budget, float]]) -> BudgetLoop:
    view = BudgetView()
    view.budgets = budgets
    link: Any = SimpleNamespace(require_state=lambda: SimpleNamespace(kv=kv))
    dummy: Any = None
    return BudgetLoop(link=link, book=dummy, cluster=dummy, jobs=list, cap_lease_s=30.0,
                      view=view, wall=lambda: SET_AT + 10)


def plan(caps: dict[tuple[str, int], int]) -> enforce.CapPlan:
    return enforce.CapPlan("grid", dict(caps), alloc.Allocation((), 0.0, 0.0, 0.0, 1.0), 0.0)


async def test_a_tightening_is_kept_per_setting_of_its_budget(nc) -> None:
    kv = await bucket(nc)
    store = Backoffs(kv)
    assert await store.get("grid", SET_AT) is None
    await store.put("grid", SET_AT, 412.34, CAPS, 55.55)
    assert await store.get("grid", SET_AT) == (pytest.approx(412.3), CAPS, pytest.approx(55.5))
    assert await store.get("grid", SET_AT + 60) is None  # set again: afresh
    await kv.put("budget_backoff.grid", b"not json")
    assert await store.get("grid", SET_AT) is None  # unreadable: afresh, no error
    await store.delete("grid")
    await store.delete("grid")  # (twice: nothing to forget)
    assert await store.get("grid", SET_AT) is None


async def test_a_new_owner_starts_from_its_predecessors_backoff_and_caps(nc) -> None:
    kv = await bucket(nc)
    budgets = {"grid": (Budget(budget_id="grid", cap_w=9000.0), SET_AT)}
    old = loop(kv, budgets)
    await old.bucket.resume_backoffs(old.tighteners)  # nothing kept yet: afresh
    assert old.tighteners["grid"].backoff_w == 0.0 and old.tighteners["grid"].guard == 0
    old.tighteners["grid"].backoff_w = 350.0  # the group measured over: the room shrank
    old.tighteners["grid"].jitter_w = 40.0
    old.plans["grid"] = plan(CAPS)
    await old.bucket.keep_backoffs(old.tighteners, old.plans)
    old.tighteners["grid"].backoff_w = 340.0  # (a small move, the same caps: not written)
    await old.bucket.keep_backoffs(old.tighteners, old.plans)
    assert await Backoffs(kv).get("grid", SET_AT) == (350.0, CAPS, 40.0)

    new = loop(kv, budgets)
    await new.bucket.resume_backoffs(new.tighteners)
    tight = new.tighteners["grid"]
    assert tight.backoff_w == 350.0 and tight.settling == 0
    assert tight.band_w(9000.0) == enforce.BAND_JITTERS * 40.0  # the band holds at once
    # The samples show the caps in force (the old owner's): a lasting excess is acted on at
    # once, from the kept backoff.
    assert tight.update(9100.0, 9000.0) == 350.0
    jitter = 40.0 * (1 - enforce.JITTER_WEIGHT)  # (a steady round: the jitter's mean falls)
    assert tight.update(9100.0, 9000.0) == 350.0 + 100.0 + enforce.BAND_JITTERS * jitter
    # Its plans send no cap above the old owner's while the guard lasts, then their own.
    higher = {("n1", 0): 300, ("n1", 1): 100, ("n2", 0): 250}
    for _ in range(enforce.GUARD_ROUNDS):
        assert enforce.guarded(plan(higher), tight).caps == {
            ("n1", 0): 225, ("n1", 1): 100, ("n2", 0): 250}
    assert enforce.guarded(plan(higher), tight).caps == higher

    del new.tighteners["grid"]  # the budget was lifted (the plan forgets its tightener)
    await new.bucket.keep_backoffs(new.tighteners, new.plans)
    assert await Backoffs(kv).get("grid", SET_AT) is None


def test_a_backoff_is_written_when_it_moves_by_a_tenth() -> None:
    tight = enforce.Tightener(backoff_w=0.0)
    assert not tight.worth_keeping(None)  # nothing to keep
    tight.backoff_w = 200.0
    assert tight.worth_keeping(None)
    assert not tight.worth_keeping(190.0) and tight.worth_keeping(170.0)
    tight.backoff_w = 0.0
    assert tight.worth_keeping(0.5 + 1.0)  # decayed to nothing: written (at least 1 W moved)
