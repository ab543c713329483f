"""A safety margin under a budget's cap (`--budget-margin-pct`, `enforce.with_margin`): the
allocation plans under the smaller room and the tightener holds the measured draw under it, so
the group's draw, noisier over half a second than from one round to the next, keeps under the
cap (the 16 x 8 bench: half-second bins up to 1.8% over the cap after it first got under)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from coordinator.budget import enforce
from coordinator.budget.budgets import Cluster, Governed, GpuInfo
from coordinator.budget.loop import BudgetLoop
from coordinator.budget.store import BudgetView
from coordinator.config import CoordinatorSettings
from zeus_agent.models import PowerLimitMeasurement
from zeus_agent.wire.budget import Budget


def test_a_margin_takes_its_share_of_the_room_and_nothing_else() -> None:
    g = Governed("grid", 1000.0, 900.0, (("n", 0),))
    assert enforce.with_margin(g, 0.0) is g
    assert enforce.with_margin(g, 2.0) == Governed("grid", 1000.0, 882.0, (("n", 0),))


def loop_with(margin_pct: float) -> BudgetLoop:
    cluster = Cluster()
    cluster.announce("n", {}, {i: GpuInfo(100, 300) for i in range(4)})
    for i in range(4):
        cluster.sample("n", i, 150.0)
    # A profiled job on the 4 GPUs: each limit drawn in full, 2% slower a 25 W step down.
    rows = tuple(PowerLimitMeasurement(power_limit=w, time=t, energy=t * 4 * w)
                 for w, t in ((300, 1.0), (275, 1.02), (250, 1.04), (225, 1.06), (200, 1.08)))
    job = enforce.JobView("dp", (("n", 0), ("n", 1), ("n", 2), ("n", 3)), rows, 300)
    return BudgetLoop(link=None, book=SimpleNamespace(me="r"),  # type: ignore[arg-type]
                      cluster=cluster, jobs=lambda: [job], cap_lease_s=10.0, view=BudgetView(),
                      margin_pct=margin_pct)


def test_the_loop_plans_and_holds_the_draw_under_the_room_less_the_margin() -> None:
    budget = Budget(budget_id="grid", cap_w=1060.0)
    plain, kept = loop_with(0.0), loop_with(5.0)
    plain.plan([budget])
    kept.plan([budget])
    # (A new budget's first rounds also keep back a share of the room: the backoff.)
    for loop, room in ((plain, 1060.0), (kept, 1007.0)):
        assert loop.plans["grid"].room_w == pytest.approx(room - loop.tighteners["grid"].backoff_w)
    assert kept.statuses["grid"].cap_w == 1060.0  # (The cap itself is the operator's.)
    assert set(plain.plans["grid"].caps.values()) == {250}  # 1,000 W of 1,035 W of room
    assert set(kept.plans["grid"].caps.values()) == {225}  # 900 W of 983 W
    # The tightener's target is under the smaller room: a steady draw of 1,040 W (under the
    # cap, over the room less 5%) is over it two rounds in a row, and the room shrinks.
    grew = {}
    for loop in (plain, kept):
        tight = loop.tighteners["grid"]
        tight.settling, tight.jitter_w, tight.last_w = 0, 0.0, None
        before = tight.backoff_w
        for _ in range(enforce.OVER_ROUNDS):
            for i in range(4):
                loop.cluster.sample("n", i, 1040.0 / 4)
            loop.plan([budget])
        grew[loop is kept] = tight.backoff_w > before
    assert grew == {False: False, True: True}


def test_the_margin_is_a_setting_off_by_default() -> None:
    assert CoordinatorSettings().budget_margin_pct == 0.0
    assert CoordinatorSettings(budget_margin_pct=1.5).budget_margin_pct == 1.5
    with pytest.raises(ValueError):
        CoordinatorSettings(budget_margin_pct=50.0)
