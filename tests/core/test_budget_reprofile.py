"""A Perseus job whose frontier was planned under a budget's caps profiles again once no
budget governs its GPUs (`CappedProfiles.to_reprofile`, `budget_point.reprofile`).

Before, nothing asked it: a job held under a budget has no drift watch, and if its last
allowed re-profile (`max_reprofiles`) ran under the caps it stayed capped proportionally in
every later budget (the cap held; the job lost its frontier's savings).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Generator
from types import SimpleNamespace

from coordinator.budget import enforce
from coordinator.budget import frontier_options as fo
from coordinator.budget.budgets import Cluster, GpuInfo
from coordinator.budget.capped_profiles import CappedProfiles
from coordinator.budget.loop import BudgetLoop
from coordinator.budget.store import BudgetView
from coordinator.optimizer import InstallSchedules, SaveProgress
from coordinator.pipeline import budget_point
from coordinator.pipeline.schedulers import FrequencyScheduler
from tests.core.straggler_kit import FRONTIER, Trainer, make_job
from zeus_agent.models import FrequencySchedule, ProfilingResult

GPUS = (("n", 0), ("n", 1))
OWN = fo.FrontierView((1.0, 1.3), (280.0, 150.0), (None, None), 0)
CAPPED = fo.FrontierView((1.0, 1.2), (140.0, 100.0), (None, None), 0)


def job(frontier: fo.FrontierView | None, **kw: object) -> enforce.JobView:
    return enforce.JobView("perseus", GPUS, frontier=frontier, **kw)  # type: ignore[arg-type]


def untrusted() -> CappedProfiles:
    p = CappedProfiles()
    p.observe([job(None, profiling=True)], set(GPUS))  # Its profile, under the caps.
    p.observe([job(CAPPED)], set(GPUS))
    return p


def test_a_job_planned_under_caps_is_asked_to_profile_again_once_no_budget_governs_it() -> None:
    p = untrusted()
    assert p.to_reprofile([job(CAPPED)], set(GPUS)) == []  # Still governed: held, capped.
    assert p.pending()
    p.observe([job(CAPPED)], set())  # The lift's round (the loop observes, then asks).
    assert p.to_reprofile([job(CAPPED)], set()) == ["perseus"]
    p.reprofiled(job(CAPPED))
    assert p.to_reprofile([job(CAPPED)], set()) == [] and not p.pending()  # Once.
    p.observe([job(None, profiling=True)], set())  # Profiling again, no caps,
    p.observe([job(OWN)], set())  # its new frontier is trusted.
    assert p.trusted(job(OWN)) == job(OWN) and p.to_reprofile([job(OWN)], set()) == []


def test_only_the_replica_driving_the_job_asks() -> None:
    p = CappedProfiles()
    theirs = job(CAPPED, remote=True, planned_capped=True)
    p.observe([theirs], set(GPUS))
    assert p.trusted(theirs).frontier is None
    assert p.to_reprofile([theirs], set()) == [] and not p.pending()


class Replanning(FrequencyScheduler):
    """One profiling round at 900 MHz, then serves FRONTIER[0]; profiles again when asked."""

    frontier = None
    chosen = None
    serving = False
    plans = 0
    asked = False

    def reprofile(self) -> bool:
        if not self.serving:
            return False
        self.asked = True
        return True

    def _run(self) -> Generator[list[FrequencySchedule], list[ProfilingResult], None]:
        while True:
            yield [FrequencySchedule(rank=i.rank,
                                     frequencies=[(n, 900) for n in i.instructions or []])
                   for i in self.rank_infos]
            self.plans += 1
            self.frontier, self.chosen, self.serving = FRONTIER, FRONTIER[0], True
            while True:
                yield [FrequencySchedule(rank=i.rank,
                                         frequencies=list(FRONTIER[0].plan[i.pp_rank]))
                       for i in self.rank_infos]
                if self.asked:
                    self.asked, self.serving = False, False
                    break


def test_the_job_profiles_again_and_a_takeover_replays_the_same() -> None:
    pipeline = make_job(2, scheduler=Replanning)
    trainer = Trainer(pipeline)
    trainer.iterate(n=3)
    assert pipeline.phase == "serving"
    actions = budget_point.reprofile(pipeline)
    assert actions is not None
    (saved,) = [a for a in actions if isinstance(a, SaveProgress)]
    pending = json.loads(json.dumps(saved.state))
    assert pending["asked"] == [len(pipeline.kept_rounds)]
    resumed = make_job(2, scheduler=Replanning, resume=pending)  # Taken over before the window:
    assert isinstance(resumed.scheduler, Replanning) and resumed.scheduler.asked  # asked again.
    installed = [a for a in trainer.iterate() if isinstance(a, InstallSchedules)]
    assert installed and pipeline.phase == "profiling"  # At the next window.
    assert budget_point.reprofile(pipeline) is None  # (Profiling: nothing to ask.)
    state = json.loads(json.dumps(pipeline.persisted()))
    replayed = make_job(2, scheduler=Replanning, resume=state)
    assert replayed.phase == "profiling" and replayed.kept_rounds.asked == state["asked"]
    plain = make_job(2, scheduler=Replanning, resume={k: v for k, v in state.items()
                                                      if k != "asked"})
    assert plain.phase == "serving"  # (What a replay without it reached: another state.)
    trainer.iterate(n=2)
    assert pipeline.phase == "serving"
    assert isinstance(pipeline.scheduler, Replanning) and pipeline.scheduler.plans == 2


def test_the_loop_asks_once_the_budgets_are_gone() -> None:
    cluster = Cluster()
    cluster.announce("n", {}, {i: GpuInfo(100, 300) for i in range(2)})
    views = [job(None, profiling=True)]
    asked: list[set[str]] = []

    async def reprofile(ids: set[str]) -> set[str]:
        asked.append(ids)
        return ids

    link = SimpleNamespace(state=object(), connected=True)
    loop = BudgetLoop(link=link, book=SimpleNamespace(me="r"),  # type: ignore[arg-type]
                      cluster=cluster, jobs=lambda: views, cap_lease_s=10.0,
                      view=BudgetView(), reprofile=reprofile)
    loop.observe_profiles(views, set(GPUS))  # Profiling under a budget's caps.
    views[0] = job(CAPPED)
    loop.observe_profiles(views, set(GPUS))
    asyncio.run(loop.reprofile_capped(views, set(GPUS)))
    assert asked == []  # Governed: held and capped proportionally.
    asyncio.run(loop.tick())  # No budget left.
    assert asked == [{"perseus"}]
    asyncio.run(loop.tick())
    assert asked == [{"perseus"}]  # Asked once for that frontier.


def test_a_job_whose_scheduler_cannot_profile_again_is_not_asked_every_round() -> None:
    cluster = Cluster()
    views = [job(None, profiling=True)]
    calls: list[set[str]] = []

    async def refuse(ids: set[str]) -> set[str]:
        calls.append(ids)
        return set()

    loop = BudgetLoop(link=None, book=SimpleNamespace(me="r"),  # type: ignore[arg-type]
                      cluster=cluster, jobs=lambda: views, cap_lease_s=10.0,
                      view=BudgetView(), reprofile=refuse)
    loop.observe_profiles(views, set(GPUS))
    views[0] = job(CAPPED)
    loop.observe_profiles(views, set())
    for _ in range(3):
        asyncio.run(loop.reprofile_capped(views, set()))
    assert calls == [{"perseus"}] and not loop.profiles.pending()
