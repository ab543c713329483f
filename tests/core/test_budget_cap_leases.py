"""How long the agents hold a budget's cap without a coordinator renewing it."""

from __future__ import annotations

from typing import Any

from coordinator.budget.loop import BudgetLoop, holder
from zeus_agent.wire.budget import Budget
from zeus_agent.wire.node_cap import MAX_CAP_LEASE_S

NOW = 1_800_000_000.0


def loop() -> BudgetLoop:
    dummy: Any = None
    return BudgetLoop(link=dummy, book=dummy, cluster=dummy, jobs=list, cap_lease_s=30.0,
                      view=dummy, wall=lambda: NOW)


def test_a_budget_with_an_end_is_held_until_it_ends_one_without_on_the_rolling_lease() -> None:
    budgets = [Budget(budget_id="grid", cap_w=9000.0, end_s=NOW + 3 * 3600),
               Budget(budget_id="soon", cap_w=9000.0, end_s=NOW + 120.0),
               Budget(budget_id="open", cap_w=9000.0)]
    leases = loop().cap_leases(budgets)
    assert leases == {holder("grid"): MAX_CAP_LEASE_S, holder("soon"): 120.0}
    # `send` uses the loop's `cap_lease_s` (30 s, renewed every round) for "open".
