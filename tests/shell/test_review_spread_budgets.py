"""Review of the job spread (rendezvous hashing): the budgets' lease, on a real nats-server.

Defect this proves (it fails on the code it was written against): the budgets' lease (key
`budgets` in the ownership bucket, `coordinator.budget.loop`) is no job, but the job ownership
loop treats every lease this replica holds as a job's: `OwnershipBook.handovers` lists it
whenever rendezvous hashing of the key "budgets" prefers another settled replica, and
`Replicas.hand_over` gives it up with no fence. The budget loop of every replica then takes it
back at once (`claimable` without a preference), the giver included, which hands it over
again on its next ownership round: the budgets flip between replicas, each new owner starting
from nothing (`capped`, tighteners and plans cleared) while the old one's tick may still be
sending caps. The ownership loop also subscribes to the events of the pseudo-job the lease
names (`<p>.job.<token of "\\x1fbudgets">.ev.*.*`).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from coordinator.budget.loop import LEASE_ID, LEASE_KEY
from coordinator.state.assignment import preferred
from tests.shell.agent_kit import running_agent
from tests.shell.coordinator_kit import bucket_of, start, stop, wait_for
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.budget import Budget, BudgetRequest
from zeus_agent.wire.messages import Reply

LEASE_S = 3.0


@pytest.mark.timeout(90)
async def test_budgets_lease_is_handed_over_like_a_job_and_flips_between_replicas(
        nats_server: Any, nc: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The first replica takes the budgets; hashing "budgets" prefers the second one.
    first, second = next((a, b) for a, b in ((f"b{i}", f"b{i + 1}") for i in range(0, 40, 2))
                         if preferred(LEASE_KEY, [a, b]) == b)
    kw = {"state_bucket": bucket_of(tmp_path), "ownership_lease_s": LEASE_S,
          "handover_after_s": LEASE_S}
    async with running_agent(nats_server.url, sim_count=2, sim_preset="A40"):
        one, one_task = await start(nats_server, tmp_path / first, replica_name=first, **kw)
        two = two_task = None
        try:
            cluster = one.budgets.cluster
            await wait_for(lambda: len(cluster.gpus) == 2 and len(cluster.power_w) == 2, 10)
            msg = await nc.request(subjects.coord_budget(), codec.encode(BudgetRequest(
                action="set", budget=Budget(budget_id="grid", cap_w=500.0))), timeout=5)
            assert codec.decode(msg.data, Reply).ok
            await wait_for(lambda: one.book.owns(LEASE_KEY, time.time()), 10)

            released: list[str] = []
            real_take = one.link.require_state().take

            async def take(key: str, value: bytes, revision: int) -> int | None:
                if key == LEASE_KEY and json.loads(value)["until"] == 0:
                    released.append(key)
                return await real_take(key, value, revision)

            monkeypatch.setattr(one.link.require_state(), "take", take)
            two, two_task = await start(nats_server, tmp_path / second, replica_name=second,
                                        **kw)
            await wait_for(lambda: one.leases.settled(second), 15)
            owners = []
            end = time.monotonic() + 2 * LEASE_S
            while time.monotonic() < end:
                now = time.time()
                owners.append(first if one.book.owns(LEASE_KEY, now) else
                              second if two.book.owns(LEASE_KEY, now) else None)
                await asyncio.sleep(0.02)
            changes = sum(1 for a, b in zip(owners, owners[1:], strict=False) if a != b)
            pseudo_followed = [c.settings.replica_name for c in (one, two) if LEASE_ID in c.owned]
            problems = []
            if released:
                problems.append(f"{first} gave the budgets' lease up {len(released)} time(s) "
                                f"while running (the owner changed {changes} times in "
                                f"{2 * LEASE_S:g} s)")
            if pseudo_followed:
                problems.append(f"{pseudo_followed} follow the events of the budgets' pseudo-job")
            assert not problems, problems
        finally:
            if two is not None and two_task is not None:
                await stop(two, two_task)
            await stop(one, one_task)
