"""A Perseus job's calibration is not learnt from the draw of the point it just left.

The loop tells a job its own point again (a budget's room grew) at the end of a round; the
agents' samples of the next rounds still show the slower point it served (the schedule changes
at an iteration's end, a sample averages the last window), as they still show caps just
changed (`enforce.SETTLE_ROUNDS`). Learnt then, the ratio drops toward the slow point's draw
over the own point's planned power, and the next allocation counts the job under its draw.
"""

from __future__ import annotations

import pytest

from coordinator.budget import enforce
from coordinator.budget import frontier_options as fo
from coordinator.budget.budgets import Cluster, GpuInfo
from coordinator.budget.loop import BudgetLoop
from coordinator.budget.store import BudgetView

GPUS = (("n", 0), ("n", 1))
TIMES, POWERS = (1.0, 1.3), (280.0, 150.0)


def job() -> enforce.JobView:
    view = fo.FrontierView(TIMES, POWERS, (None, None), 0)
    return enforce.JobView("perseus", GPUS, frontier=view)


def sample(loop: BudgetLoop, watts: float) -> None:
    for key in GPUS:
        loop.cluster.sample(*key, watts)


def test_the_ratio_waits_for_the_samples_of_its_own_point_after_a_budgets_point() -> None:
    c = Cluster()
    c.announce("n", {}, {i: GpuInfo(100, 300) for i in range(2)})
    loop = BudgetLoop(link=None, book=None, cluster=c, jobs=list,  # type: ignore[arg-type]
                      cap_lease_s=10.0, view=BudgetView())
    sample(loop, 336.0)
    loop.calibrate([job()])
    assert loop.ratios == {"perseus": pytest.approx(1.2)}
    loop.points = {"perseus": (1, 125.0)}  # A budget's point: it draws 180 W there.
    sample(loop, 180.0)
    loop.calibrate([job()])
    loop.points = {}  # Told its own point again; the samples still show the slow one.
    for _ in range(enforce.SETTLE_ROUNDS):
        loop.calibrate([job()])
        assert loop.ratios == {"perseus": pytest.approx(1.2)}
    sample(loop, 308.0)  # Its own point's draw now.
    loop.calibrate([job()])
    assert loop.ratios["perseus"] == pytest.approx(0.8 * 1.2 + 0.2 * 1.1)
