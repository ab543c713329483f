"""A Perseus job's frontier view is never a stale one after its scheduler plans again.

`budget_point.frontier_of` caches each scheduler's view, keyed by the frontier's and chosen
point's `id`s. An id is an address: once the cached frontier is freed (the scheduler planned
again, or twice while no budget round read it), a new frontier allocated at the same address
matched the old key, and the budget planned on the old frontier's times, powers and chosen
index.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from coordinator.pipeline import budget_point
from coordinator.pipeline.phase import Phase


@dataclass(frozen=True)
class Point:
    time: float
    energy: float
    plan: tuple[Any, ...] = ()


class Scheduler:
    """What `frontier_of` reads of a scheduler."""

    frontier: list[Point] | None = None
    chosen: Point | None = None


def test_a_new_frontier_is_read_whatever_its_address() -> None:
    scheduler = Scheduler()
    job: Any = SimpleNamespace(phase=Phase.SERVING, scheduler=scheduler,
                               straggling=SimpleNamespace(plan={0: None}), rank_infos={0: 0})
    for n in range(50):  # (Freed and allocated again: addresses are reused.)
        scheduler.frontier = [Point(1.0 + n, 100.0), Point(2.0 + n, 80.0)]
        scheduler.chosen = scheduler.frontier[n % 2]
        view = budget_point.frontier_of(job)
        assert view is not None and view.times[0] == 1.0 + n and view.chosen == n % 2
        scheduler.frontier = scheduler.chosen = None  # Profiling again: no frontier.
        assert budget_point.frontier_of(job) is None
