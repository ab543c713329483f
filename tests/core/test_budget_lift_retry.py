"""A lift an agent did not take is sent again, not forgotten.

A budget with an end is held by the agents until it ends (up to an hour: `cap_leases`). When it
is lifted early, the owner sends each GPU a lift once; a lift lost (a timeout, the bus busy)
left that GPU capped until the budget's original end, since the owner forgot the GPU at once.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from coordinator.budget.budgets import Cluster, GpuInfo
from coordinator.budget.loop import BudgetLoop
from coordinator.budget.store import BudgetView
from tests.core.budget_kit import EmptyKv
from zeus_agent.wire.budget import Budget

NOW = 1_800_000_000.0
GPUS = [("n", 0), ("n", 1)]




def owner(sent: list[tuple[tuple[str, int], int | None]], lost: set[tuple[str, int]]
          ) -> BudgetLoop:
    cluster = Cluster()
    cluster.announce("n", {}, {0: GpuInfo(100, 300), 1: GpuInfo(100, 300)})
    for key in GPUS:
        cluster.sample(*key, 250.0)
    state = SimpleNamespace(kv=EmptyKv())
    link: Any = SimpleNamespace(state=state, connected=True, require_state=lambda: state,
                                prefix="zeus", nc=SimpleNamespace(publish=_publish))
    book: Any = SimpleNamespace(owns=lambda key, now: True, me="r1")
    loop = BudgetLoop(link=link, book=book, cluster=cluster, jobs=list, cap_lease_s=30.0,
                      view=BudgetView(), wall=lambda: NOW)

    async def send(key: tuple[str, int], cap_w: int | None, by: str,
                   lease_s: float | None = None) -> bool:
        sent.append((key, cap_w))
        if cap_w is None and key in lost:
            lost.discard(key)  # (Lost once.)
            return False
        return True

    loop.send = send  # type: ignore[method-assign]
    return loop


async def _publish(subject: str, data: bytes) -> None:
    return None


def test_a_lift_not_taken_is_sent_again_next_round() -> None:
    sent: list[tuple[tuple[str, int], int | None]] = []
    loop = owner(sent, lost={("n", 0)})
    budget = Budget(budget_id="grid", cap_w=400.0, end_s=NOW + 3000)
    loop.view.budgets = {"grid": (budget, NOW - 10)}
    asyncio.run(loop.tick())
    assert {k for k, w in sent if w is not None} == set(GPUS)
    loop.view.budgets = {}  # Lifted.
    sent.clear()
    asyncio.run(loop.tick())
    assert sorted(sent) == [(("n", 0), None), (("n", 1), None)]  # GPU 0's lift is lost
    sent.clear()
    asyncio.run(loop.tick())
    assert sent == [(("n", 0), None)]  # ...and sent again
    sent.clear()
    asyncio.run(loop.tick())
    assert sent == []  # taken: nothing more
