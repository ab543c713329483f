"""A Perseus job's option is not measured while a takeover's guard holds its GPUs under it.

A replica taking the budgets over sends, for its first rounds, the least of its own plan's
caps and its predecessor's (`enforce.guarded`). A Perseus job it tells a point then runs
under a lower cap than that point's: its steps were measured as the point's, slower than it
is (16 x 8, 2026-12-07: a 175 W option measured at 1.39 of the job's own time while its GPUs
were held at 150 W, against 1.2 planned), and the allocator moved the job on that measure
for the rest of the event.
"""

from __future__ import annotations

from coordinator.budget import allocator as alloc
from coordinator.budget import enforce
from coordinator.budget import frontier_options as fo
from coordinator.budget.budgets import Cluster, GpuInfo
from coordinator.budget.loop import BudgetLoop
from coordinator.budget.store import BudgetView

GPUS = (("n", 0), ("n", 1))


def job(steps: int) -> enforce.JobView:
    """The job after `steps` iterations at its budget's point (1.3 s, 150 W per GPU)."""
    view = fo.FrontierView((1.0, 1.3), (280.0, 150.0), (None, None), 0)
    step_times = tuple((n, 1.3, 195.0) for n in range(1, 2 * steps + 1))
    return enforce.JobView("perseus", GPUS, frontier=view, step_times=step_times,
                           own_step_s=1.0, own_draw_w=280.0)


def plan(cap_w: int) -> enforce.CapPlan:
    """A plan that told the job its point 1 (limit 200 W), its GPUs capped at `cap_w`."""
    share = alloc.Share("perseus", 1, 200, 300.0, 0.3)
    allocation = alloc.Allocation((share,), 300.0, 0.3, 200.0, 1.0)
    return enforce.CapPlan("b", dict.fromkeys(GPUS, cap_w), allocation, 300.0,
                           {"perseus": GPUS})


def measured_after_rounds(cap_w: int) -> tuple[fo.Served, ...]:
    c = Cluster()
    c.announce("n", {}, {i: GpuInfo(100, 300) for i in range(2)})
    loop = BudgetLoop(link=None, book=None, cluster=c, jobs=list,  # type: ignore[arg-type]
                      cap_lease_s=10.0, view=BudgetView())
    loop.points = {"perseus": (1, 150.0)}
    loop.plans = {"b": plan(cap_w)}
    for rounds in range(1, enforce.SETTLE_ROUNDS + 6):
        loop.calibrate([job(5 * rounds)])
    return loop.timing.measured("perseus")


def test_the_point_is_measured_under_its_own_caps() -> None:
    (served,) = measured_after_rounds(200)
    assert served.key == 1 and abs(served.relative_time - 1.3) < 1e-9


def test_the_point_is_not_measured_while_the_guard_holds_its_gpus_under_it() -> None:
    assert measured_after_rounds(150) == ()
    assert enforce.held_under([plan(150)]) == {"perseus"}
    assert enforce.held_under([plan(200)]) == set()
