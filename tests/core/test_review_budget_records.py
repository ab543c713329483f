"""An adversarial review of the budgets' shared records (`budget_frontier.<h>`,
`budget_point.<h>`, `budget_timing.<h>`: `coordinator.budget.remote`, `recorded`, the loop):
each test reproduces a defect (each failed on the code before its fix).

A record another replica wrote is validated on read (`BudgetFrontier`), but a frontier that
passes that validation may still be one the allocator refuses (two throttled options under one
cap, a point's time under the allocator's least). The allocator refuses the whole group
(`BudgetError`), and the owner's `plan` then gives that budget no caps at all: every GPU it
capped is lifted. One replica's bad write thus lifted a budget's cap on every job of its group.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from coordinator.budget import enforce, remote
from coordinator.budget.budgets import Cluster, GpuInfo
from coordinator.budget.frontier_options import Served
from coordinator.budget.job_views import job_views
from coordinator.budget.loop import BudgetLoop
from coordinator.budget.recorded import frontier_view
from coordinator.budget.store import BudgetView
from coordinator.budget.timing import frontier_digest
from coordinator.state.records import FRONTIER_PREFIX, job_hash
from tests.core.budget_kit import EmptyKv
from zeus_agent.wire.budget import Budget, BudgetFrontier, BudgetTiming, MeasuredOption

NOW = 1_800_000_000.0
PERSEUS = (("n", 0), ("n", 1))
PLAIN = (("n", 2), ("n", 3))
GOOD: dict[str, Any] = {
    "job_id": "perseus", "times": [1.0, 1.3, 1.6], "powers": [250.0, 200.0, 160.0],
    "peaks": [280.0, None, 170.0], "chosen": 0,
    "throttled": [{"cap_w": 150, "time_s": 1.9, "power_w": 140.0, "peak_w": 150.0}]}
"""A 2-GPU Perseus job's frontier as its driver records it (valid and usable)."""




async def _publish(subject: str, data: bytes) -> None:
    return None


def owner(sent: list[tuple[tuple[str, int], int | None]]) -> BudgetLoop:
    """The budgets' owner: the Perseus job is driven by another replica, so is the plain one."""
    cluster = Cluster()
    cluster.announce("n", {}, {i: GpuInfo(100, 300) for i in range(4)})
    for i in range(4):
        cluster.sample("n", i, 250.0)
    state = SimpleNamespace(kv=EmptyKv())
    link: Any = SimpleNamespace(state=state, connected=True, require_state=lambda: state,
                                prefix="zeus", nc=SimpleNamespace(publish=_publish))
    book: Any = SimpleNamespace(owns=lambda key, now: True, me="owner")
    view = BudgetView()

    def jobs() -> list[enforce.JobView]:
        follows = view.remote
        return [enforce.JobView("perseus", PERSEUS, frontier=follows.frontier("perseus"),
                                remote=True),
                enforce.JobView("plain", PLAIN, remote=True)]

    loop = BudgetLoop(link=link, book=book, cluster=cluster, jobs=jobs, cap_lease_s=30.0,
                      view=view, wall=lambda: NOW)

    async def send(key: tuple[str, int], cap_w: int | None, by: str,
                   lease_s: float | None = None) -> bool:
        sent.append((key, cap_w))
        return True

    loop.send = send  # type: ignore[method-assign]
    return loop


def recorded(loop: BudgetLoop, value: dict[str, Any]) -> None:
    """The driver's record, as the owner's watch of `budget_frontier.>` applies it."""
    raw = BudgetFrontier.model_validate(value).model_dump_json().encode()  # (Valid on the wire.)
    entry = SimpleNamespace(key=FRONTIER_PREFIX + job_hash("perseus"), value=raw,
                            operation="PUT")
    asyncio.run(loop.view.remote.on_frontier(entry))


@pytest.mark.parametrize("bad", [
    # Two throttled options under one cap (a driver of another version, a hostile write).
    {"throttled": [{"cap_w": 150, "time_s": 1.9, "power_w": 140.0, "peak_w": 150.0},
                   {"cap_w": 150, "time_s": 2.0, "power_w": 130.0, "peak_w": 150.0}]},
    # Throttled caps out of order: the caps under the last one's power collide with them.
    {"throttled": [{"cap_w": 125, "time_s": 2.2, "power_w": 120.0, "peak_w": 125.0},
                   {"cap_w": 150, "time_s": 1.9, "power_w": 140.0, "peak_w": 150.0}]},
    # A step time the wire takes (> 0) and the allocator does not (>= 1e-12 s).
    {"times": [1e-300, 1.3, 1.6]},
], ids=["same-cap-twice", "caps-out-of-order", "tiny-time"])
def test_a_bad_frontier_record_does_not_lift_the_budgets_caps(bad: dict[str, Any]) -> None:
    """The budget keeps capping every GPU: the job whose record is unusable is capped
    proportionally (as a job with nothing recorded), the others as before."""
    sent: list[tuple[tuple[str, int], int | None]] = []
    loop = owner(sent)
    loop.view.budgets = {"grid": (Budget(budget_id="grid", cap_w=700.0), NOW - 10)}
    recorded(loop, GOOD)
    asyncio.run(loop.tick())
    assert {k for k, w in sent if w is not None} == set(PERSEUS + PLAIN)
    sent.clear()
    recorded(loop, GOOD | bad)  # The driver's next write.
    asyncio.run(loop.tick())
    lifted = sorted(k for k, w in sent if w is None)
    assert lifted == []
    caps = {k: w for k, w in sent if w is not None}
    assert set(caps) == set(PERSEUS + PLAIN) and sum(caps.values()) <= 700


class Bucket(EmptyKv):
    """A state bucket that keeps what is written."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    async def get(self, key: str) -> Any:
        from nats.js.errors import KeyNotFoundError

        if key not in self.values:
            raise KeyNotFoundError
        return SimpleNamespace(key=key, value=self.values[key])

    async def put(self, key: str, value: bytes) -> None:
        self.values[key] = value

    async def purge(self, key: str) -> None:
        self.values.pop(key, None)


def test_a_job_back_from_another_driver_takes_its_newer_measures_not_its_own_old_ones() -> None:
    """Replica A drove a Perseus job and measured point 1; the job moved to B, which measured
    points 1 and 2 further and recorded them; the job came back to A. A kept its own old
    measures all along (a job another replica drives stays in its `Timing`), so `restore`
    refused B's (`served` not empty), and A's next `keep_timing` wrote its old measures over
    B's newer ones in the bucket (the module says a job read again when it comes back)."""
    bucket = Bucket()
    state = SimpleNamespace(kv=bucket)
    link: Any = SimpleNamespace(state=state, connected=True, require_state=lambda: state)
    view = frontier_view(BudgetFrontier.model_validate(GOOD))
    digest = frontier_digest(view.chosen, view.times)
    mine = enforce.JobView("perseus", PERSEUS, frontier=view)
    theirs = enforce.JobView("perseus", PERSEUS, remote=True)
    a = BudgetLoop(link=link, book=SimpleNamespace(me="a"),  # type: ignore[arg-type]
                   cluster=Cluster(), jobs=list, cap_lease_s=30.0, view=BudgetView())
    a.timing._frontiers["perseus"] = digest  # A measured point 1 while it drove the job.
    a.timing.served["perseus"] = {1: Served(1, 1.2, 200.0)}
    asyncio.run(a.bucket.keep_timing([mine], a.timing))
    asyncio.run(a.bucket.keep_timing([theirs], a.timing))  # B drives it now...
    newer = BudgetTiming(job_id="perseus", frontier=digest, options=[
        MeasuredOption(key=2, relative_time=1.9, power_w=150.0),
        MeasuredOption(key=1, relative_time=1.5, power_w=190.0)])
    key = "budget_timing." + job_hash("perseus")
    bucket.values[key] = newer.model_dump_json().encode()  # ...and records what it measured.
    asyncio.run(a.bucket.resume_timing([mine], a.timing))  # Back to A.
    asyncio.run(a.bucket.keep_timing([mine], a.timing))
    assert BudgetTiming.model_validate_json(bucket.values[key]) == newer
    assert a.timing.measured("perseus") == (Served(2, 1.9, 150.0), Served(1, 1.5, 190.0))


def test_a_frontier_of_a_huge_slowdown_does_not_stop_the_owners_rounds() -> None:
    """Times the wire takes (1 ms at the chosen point, 20,000 s at the slowest), under a cap
    that leaves the job only its deepest option: its slowdown (2.6e7) is over what a
    `BudgetShare` may say (1e6), so `enforce.status` raised, every round of the owner
    stopped before it sent a cap (the loop logs and goes on: no cap renewed, every GPU's cap
    lapses with its lease)."""
    sent: list[tuple[tuple[str, int], int | None]] = []
    loop = owner(sent)
    loop.view.budgets = {"grid": (Budget(budget_id="grid", cap_w=500.0), NOW - 10)}
    recorded(loop, GOOD | {"times": [1e-3, 1e4, 2e4], "throttled": []})
    asyncio.run(loop.tick())
    caps = {k: w for k, w in sent if w is not None}
    assert set(caps) == set(PERSEUS + PLAIN) and sum(caps.values()) <= 500
    (share,) = [s for s in loop.statuses["grid"].shares if s.job_id == "perseus"]
    assert share.slowdown is not None and share.slowdown > 1e5  # (Said, at the wire's most.)


def test_the_driver_measures_the_point_it_serves_not_the_one_it_was_told() -> None:
    """The owner's recorded point names index 1 at 150 W, a point of the job's previous
    frontier (it planned again; the owner has not planned on the new one yet, or is being
    taken over). On this frontier point 1 draws 200 W, so the job serves `pick`'s point, its
    slowest (2, 160 W: none is at or under 150 W); the driver measured those steps as point
    1's and recorded them so: the owner then counts point 1 at point 2's time."""
    cluster = Cluster()
    cluster.announce("n", {}, {i: GpuInfo(100, 300) for i in range(2)})
    view = frontier_view(BudgetFrontier.model_validate(GOOD))
    driver = BudgetLoop(link=None, book=SimpleNamespace(me="b"),  # type: ignore[arg-type]
                        cluster=cluster, jobs=list, cap_lease_s=30.0, view=BudgetView())
    driver.view.remote.points[job_hash("perseus")] = ("perseus", (1, 150.0))
    grid = [Budget(budget_id="grid", cap_w=400.0)]
    steps: list[tuple[int, float, float | None]] = []
    for n in range(1, 9):  # Rounds: the job runs point 2 (1.6 s a step), both ranks report.
        steps += [(n, 1.6, 1.6 * 160.0), (n, 1.6, 1.6 * 160.0)]
        job = enforce.JobView("perseus", PERSEUS, frontier=view, own_step_s=1.0,
                              step_times=tuple(steps))
        held = driver.held_here(grid, [job])
        assert held == {"perseus": (1, 150.0)}
        driver.measure_here([job], held)
    measured = {m.key: m.relative_time for m in driver.timing.measured("perseus")}
    assert measured == {2: pytest.approx(1.6)}


def test_a_perseus_job_that_failed_here_is_not_taken_for_one_another_replica_drives() -> None:
    """Its driver failed it (`JobDriver.end`: no optimiser, never started again): `job_views`
    took the job for one another replica drives (`optimiser is None`) and brought the frontier
    this replica itself had recorded; `record_frontiers` then left that record (its "new
    driver" records it), so every owner kept moving the job along a frontier nobody serves
    (points recorded for nobody) instead of capping it proportionally, until it is removed."""
    view = frontier_view(BudgetFrontier.model_validate(GOOD))
    ranks = {r: SimpleNamespace(gpu=SimpleNamespace(node="n", gpu_index=r)) for r in (0, 1)}
    failed: Any = SimpleNamespace(record=SimpleNamespace(ranks=ranks, power_limit=None),
                                  optimiser=None, job_id="perseus", recorded=None,
                                  failed="the optimiser raised")
    bucket = Bucket()
    key = FRONTIER_PREFIX + job_hash("perseus")
    record = BudgetFrontier.model_validate(GOOD)
    bucket.values[key] = record.model_dump_json().encode()  # Recorded while it drove it.
    follows = remote.Recorded()
    follows.frontiers[job_hash("perseus")] = ("perseus", view, None, False)
    kept: dict[str, Any] = {"perseus": (view, None, False)}
    (seen,) = job_views([failed], follows)
    asyncio.run(remote.record_frontiers(bucket, [seen], kept))
    assert seen.frontier is None and key not in bucket.values
