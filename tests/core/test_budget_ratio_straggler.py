"""A Perseus job slowed for a straggler does not calibrate its frontier by that draw.

The budget loop learns a pipeline job's measured draw over its own point's planned power while
it serves its own point. A job with a straggler serves slower points on its other pipelines
(or its straggler runs slow): it draws less than its own point's plan, and a ratio learnt then
counts every point under its draw once a budget moves the job.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from coordinator.budget import enforce
from coordinator.budget import frontier_options as fo
from coordinator.budget.budgets import Cluster, GpuInfo
from coordinator.budget.job_views import job_views
from coordinator.budget.loop import BudgetLoop
from coordinator.budget.store import BudgetView
from tests.core.straggler_kit import Trainer, make_job

GPUS = (("n", 0), ("n", 1))


def loop() -> BudgetLoop:
    c = Cluster()
    c.announce("n", {}, {i: GpuInfo(100, 300) for i in range(2)})
    return BudgetLoop(link=None, book=None, cluster=c, jobs=list,  # type: ignore[arg-type]
                      cap_lease_s=10.0, view=BudgetView())


def view(own_point: bool) -> enforce.JobView:
    frontier = fo.FrontierView((1.0, 1.3), (280.0, 150.0), (None, None), 0)
    return enforce.JobView("perseus", GPUS, frontier=frontier, own_point=own_point)


def test_the_ratio_is_not_learnt_while_a_straggler_slows_the_job() -> None:
    b = loop()
    for key in GPUS:
        b.cluster.sample(*key, 336.0)
    b.calibrate([view(True)])
    assert b.ratios == {"perseus": pytest.approx(1.2)}
    for key in GPUS:
        b.cluster.sample(*key, 200.0)  # Slowed for a straggler.
    b.calibrate([view(False)])
    assert b.ratios == {"perseus": pytest.approx(1.2)}
    for _ in range(enforce.SETTLE_ROUNDS):  # Cleared: the samples still show the slow points.
        b.calibrate([view(True)])
    assert b.ratios == {"perseus": pytest.approx(1.2)}


def test_a_straggling_job_is_seen_off_its_own_point() -> None:
    job = make_job(2)
    Trainer(job).iterate(n=3)
    ranks = {r: SimpleNamespace(gpu=SimpleNamespace(node="n", gpu_index=r))
             for r in job.rank_infos}
    driver: Any = SimpleNamespace(record=SimpleNamespace(ranks=ranks, power_limit=None),
                                  optimiser=job, job_id="perseus", failed=None)
    (seen,) = job_views([driver])
    assert seen.frontier is not None and seen.own_point
    job.set_straggler(1, 1.5)
    (seen,) = job_views([driver])
    assert seen.frontier is not None and not seen.own_point
