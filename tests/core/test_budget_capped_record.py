"""A frontier planned under a budget's caps says so in its record: a replica taking over keeps
the job capped proportionally (`BudgetFrontier.planned_capped`, `CappedProfiles`).

Before, the record did not say how the frontier was planned: a replica taking the budgets
over, or the job, trusted a frontier its driver had found planned under the caps (a re-profile
of a job another replica drives, whose frontier that replica had not seen before), and a job's
first profile under the caps was trusted by everyone (on the 16 x 8 bench, 2026-12-07, a point
of such a frontier was counted at 694 W and drew 1,024 W).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from coordinator.budget import enforce, remote
from coordinator.budget import frontier_options as fo
from coordinator.budget.budgets import Cluster, GpuInfo
from coordinator.budget.capped_profiles import CappedProfiles
from coordinator.budget.loop import BudgetLoop
from coordinator.budget.recorded import frontier_record
from coordinator.budget.store import BudgetView
from coordinator.state.records import FRONTIER_PREFIX, job_hash
from zeus_agent.wire.budget import Budget, BudgetFrontier

GPUS = (("n", 0), ("n", 1))
OWN = fo.FrontierView((1.0, 1.3), (280.0, 150.0), (None, None), 0)
CAPPED = fo.FrontierView((1.0, 1.2), (140.0, 100.0), (None, None), 0)
"""Its frontier profiled under a budget's caps: counted at half its draw."""


def job(frontier: fo.FrontierView | None, **kw: Any) -> enforce.JobView:
    return enforce.JobView("perseus", GPUS, frontier=frontier, **kw)


class Kv:
    """A state bucket that keeps what is written."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    async def put(self, key: str, value: bytes) -> None:
        self.values[key] = value

    async def purge(self, key: str) -> None:
        self.values.pop(key, None)


KEY = FRONTIER_PREFIX + job_hash("perseus")


def test_a_first_profile_driven_here_under_a_budgets_caps_is_not_trusted() -> None:
    """Fails on main (c0d9f8e): a job's first frontier was trusted however it was profiled."""
    p = CappedProfiles()
    p.observe([job(None, profiling=True)], set(GPUS))  # Its first profile, under the caps.
    assert p.observe([job(CAPPED)], set(GPUS)) == ["perseus"]
    assert p.trusted(job(CAPPED)).frontier is None and p.planned_capped(job(CAPPED))


def test_a_first_profile_with_no_budget_near_it_is_trusted() -> None:
    p = CappedProfiles()
    p.observe([job(None, profiling=True), replace(job(None, profiling=True), job_id="x",
                                                  gpus=(("m", 0),))], {("m", 0)})
    assert p.observe([job(OWN)], {("m", 0)}) == []
    assert p.trusted(job(OWN)) == job(OWN) and not p.planned_capped(job(OWN))


def test_a_job_first_seen_serving_is_trusted_unless_its_record_says_otherwise() -> None:
    """A replica taking the job (or the budgets) over replays it: nothing seen here says how
    its frontier was planned but the record its driver wrote."""
    for here in (True, False):
        p = CappedProfiles()
        flagged = job(CAPPED, planned_capped=True, remote=not here)
        assert p.observe([flagged], set(GPUS)) == ["perseus"]
        assert p.trusted(flagged).frontier is None
        p = CappedProfiles()
        p.observe([job(OWN, remote=not here)], set(GPUS))
        assert p.trusted(job(OWN, remote=not here)).frontier == OWN


def test_a_record_flagged_later_for_a_frontier_already_seen_is_heeded() -> None:
    """The owner saw the frontier before its driver's record said how it was planned."""
    p = CappedProfiles()
    p.observe([job(CAPPED, remote=True)], set(GPUS))
    assert p.observe([job(CAPPED, remote=True, planned_capped=True)], set(GPUS)) == ["perseus"]
    assert p.observe([job(CAPPED, remote=True, planned_capped=True)], set(GPUS)) == []
    assert p.trusted(job(CAPPED, remote=True)).frontier is None


def test_the_flag_is_sent_only_when_true_and_an_older_record_reads_as_false() -> None:
    plain = frontier_record("perseus", OWN, 250.0)
    assert plain is not None and "planned_capped" not in json.loads(plain.model_dump_json())
    capped = frontier_record("perseus", CAPPED, None, planned_capped=True)
    assert capped is not None
    data = json.loads(capped.model_dump_json())
    assert data["planned_capped"] is True
    assert BudgetFrontier.model_validate_json(capped.model_dump_json()).planned_capped
    older = {k: v for k, v in data.items() if k != "planned_capped"}
    assert not BudgetFrontier.model_validate(older).planned_capped
    with pytest.raises(ValidationError):
        BudgetFrontier.model_validate(data | {"planned_capped": "perhaps"})
    with pytest.raises(ValidationError):
        BudgetFrontier.model_validate(data | {"v": 2})


def test_every_replica_reads_the_flag_for_that_frontier_only() -> None:
    follows = remote.Recorded()
    record = frontier_record("perseus", CAPPED, None, planned_capped=True)
    assert record is not None
    entry = SimpleNamespace(key=KEY, value=record.model_dump_json().encode(), operation="PUT")
    asyncio.run(follows.on_frontier(entry))
    assert follows.planned_capped("perseus", CAPPED)
    assert not follows.planned_capped("perseus", OWN)  # (It planned again since.)
    assert not follows.planned_capped("other", CAPPED)


def test_the_driver_records_the_flag_and_records_again_when_it_is_found() -> None:
    kv, kept, p = Kv(), {}, CappedProfiles()  # type: ignore[var-annotated]
    mine = job(CAPPED)
    asyncio.run(remote.record_frontiers(kv, [mine], kept, p.planned_capped))
    assert "planned_capped" not in json.loads(kv.values[KEY])
    p.observe([job(None, profiling=True)], set(GPUS))
    p.observe([mine], set(GPUS))
    asyncio.run(remote.record_frontiers(kv, [mine], kept, p.planned_capped))
    assert json.loads(kv.values[KEY])["planned_capped"] is True
    taken = job(CAPPED, planned_capped=True)  # Its new driver, which found nothing itself.
    kept2: dict[str, Any] = {}
    asyncio.run(remote.record_frontiers(kv, [taken], kept2, CappedProfiles().planned_capped))
    assert json.loads(kv.values[KEY])["planned_capped"] is True  # (Not written over.)


def test_the_owner_caps_a_job_whose_record_says_so_proportionally() -> None:
    cluster = Cluster()
    cluster.announce("n", {}, {i: GpuInfo(100, 300) for i in range(2)})
    for i in range(2):
        cluster.sample("n", i, 250.0)
    views = [job(CAPPED, remote=True, planned_capped=True)]
    loop = BudgetLoop(link=None, book=SimpleNamespace(me="r"),  # type: ignore[arg-type]
                      cluster=cluster, jobs=lambda: views, cap_lease_s=10.0, view=BudgetView())
    loop.plan([Budget(budget_id="grid", cap_w=520.0)])
    (share,) = loop.plans["grid"].allocation.shares
    assert share.key is None and share.expected_w == 2 * share.limit_w
