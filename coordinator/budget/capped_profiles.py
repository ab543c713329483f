"""Pipeline jobs whose frontier was planned from a profile a budget's caps throttled (pure).

A Perseus job (re)profiles its instructions at each clock, then plans its frontier from those
times and energies. Profiling while a budget governs its GPUs (a drift re-profile that began
before a grid event, or during one: the job is then capped proportionally, as it has no
frontier), the fast clocks ran throttled under the caps: the profile has them slower and
cooler than they are, and the frontier planned from it is wrong in both. The budgets, planning
on it, counted the job's points far under their draw. Measured on the 16 x 8 bench
(2026-12-07, main at 50d9958): a point counted at 694 W drew 1,024 W (-19 % slowdown measured
where +19 % was planned), another frontier's own point at 300 W counted at its capped
profile's 934 W; in the two takeover events that went over the cap after the owner's kill
(162 and 152 J), the job had profiled under the caps, and in every event where the job's share
was counted over 100 W under its draw it had.

`CappedProfiles` follows each job's frontier round by round (every replica, owner or not)
and says which frontier is not to be trusted: a job's new frontier, after rounds in which the
replica driving it saw it without one (planning again, or profiling for the first time:
`JobView.profiling`) while a budget governed its GPUs, or one that changed between two rounds
in which a budget did (a job whose profile ended before the first round of a budget planned
with no caps), or one whose record says so (`JobView.planned_capped`, from
`BudgetFrontier.planned_capped`, which the driver writes from `planned_capped`: a replica
taking the budgets or the job over, which saw none of it). The budget loop caps such a job
proportionally, counted at its cap (`allocator`: a job without a profile), as it did while
the job profiled, until the job plans a frontier from a profile no budget capped; once no
budget governs its GPUs, the replica driving it asks it to profile again (`to_reprofile`).
A frontier seen again after a round without one (a replica replaying a job it took over) is
the same plan (`timing.frontier_digest`): trusted as it was, unless its record says
otherwise. Rounds not observed (no budget anywhere: the loop does not look at the jobs, but
while one driven here waits to be asked to profile again) end what is known of the jobs'
rounds, not the frontiers already found untrusted.
"""

from __future__ import annotations

from collections.abc import Iterable, Set
from dataclasses import dataclass, field, replace

from coordinator.budget.budgets import GpuKey
from coordinator.budget.enforce import JobView
from coordinator.budget.timing import frontier_digest

__all__ = ["CappedProfiles"]


@dataclass
class CappedProfiles:
    """Which pipeline jobs' frontiers were planned under a budget's caps (see the module)."""

    frontiers: dict[str, str] = field(default_factory=dict)
    """Job -> the digest of the frontier last seen."""
    capped: dict[str, bool] = field(default_factory=dict)
    """Job -> a budget governed its GPUs in the last round with that frontier, or in a round
    since in which it had none (driven here: it was planning again)."""
    untrusted: dict[str, str] = field(default_factory=dict)
    """Job -> the digest of its frontier planned under caps."""
    asked: dict[str, str] = field(default_factory=dict)
    """Job -> the digest of the untrusted frontier it was asked to profile again from."""
    here: set[str] = field(default_factory=set)
    """The jobs driven here, as last observed."""

    def observe(self, jobs: Iterable[JobView], governed: Set[GpuKey]) -> list[str]:
        """One round: the jobs as seen, and the GPUs an active budget governs now.

        Returns the jobs whose frontier was found untrusted this round. A job without a
        frontier counts only if it had one here before and is driven here: another replica's
        job has none here until its driver records it (it records it only while budgets
        exist), and a job first seen without one may be a replica replaying it.
        """
        live, found = set(), []
        self.here = set()
        for job in jobs:
            live.add(job.job_id)
            if not job.remote:
                self.here.add(job.job_id)
            under = not governed.isdisjoint(job.gpus)
            f = job.frontier
            known = self.frontiers.get(job.job_id)
            if f is None:  # (Profiling again, or not known here yet.)
                if (known is not None or job.profiling) and not job.remote:
                    self.capped[job.job_id] = self.capped.get(job.job_id, False) or under
                continue
            digest = frontier_digest(f.chosen, f.times)
            if known != digest:
                if job.planned_capped or self.capped.get(job.job_id, False):
                    found += [job.job_id] if self.untrusted.get(job.job_id) != digest else []
                    self.untrusted[job.job_id] = digest
                elif known is not None:  # (Planned with no budget on its GPUs.)
                    self.untrusted.pop(job.job_id, None)
            elif job.planned_capped and self.untrusted.get(job.job_id) != digest:
                self.untrusted[job.job_id] = digest  # (Its record says so: it took it over.)
                found.append(job.job_id)
            self.frontiers[job.job_id] = digest
            self.capped[job.job_id] = under
        for table in (self.frontiers, self.capped, self.untrusted, self.asked):
            for gone in [j for j in table if j not in live]:
                del table[gone]
        return found

    def to_reprofile(self, jobs: Iterable[JobView], governed: Set[GpuKey]) -> list[str]:
        """The jobs driven here to ask to profile again (once per frontier: `reprofiled`).

        Their frontier is not trusted, and no budget governs their GPUs now (`governed`).
        Else nothing would ask it: such a job is held while a budget governs it (no drift
        watch), and if its last allowed drift re-profile ran under the caps it stayed capped
        proportionally in every later budget. Asked once the caps are gone, it plans a
        frontier the budgets trust.
        """
        out = []
        for job in jobs:
            f = job.frontier
            if f is None or job.remote or not governed.isdisjoint(job.gpus):
                continue
            digest = frontier_digest(f.chosen, f.times)
            if self.untrusted.get(job.job_id) == digest != self.asked.get(job.job_id):
                out.append(job.job_id)
        return out

    def pending(self) -> bool:
        """Whether a job driven here may still have to be asked to profile again."""
        return any(j in self.untrusted and self.untrusted[j] != self.asked.get(j)
                   for j in self.here)

    def reprofiled(self, job: JobView) -> None:
        """`job` will profile again (`to_reprofile`): not asked again for this frontier."""
        if job.frontier is not None:
            self.asked[job.job_id] = frontier_digest(job.frontier.chosen, job.frontier.times)

    def unobserved(self) -> None:
        """A round in which the jobs were not looked at: what they did meanwhile is not known."""
        self.capped.clear()

    def planned_capped(self, job: JobView) -> bool:
        """Whether `job`'s frontier was found planned under caps (its record says so)."""
        f = job.frontier
        return f is not None and (job.planned_capped or self.untrusted.get(job.job_id)
                                  == frontier_digest(f.chosen, f.times))

    def trusted(self, job: JobView) -> JobView:
        """`job`, without its frontier if that was planned under caps (capped proportionally)."""
        f = job.frontier
        if f is None or self.untrusted.get(job.job_id) != frontier_digest(f.chosen, f.times):
            return job
        return replace(job, frontier=None, step_times=(), own_step_s=None, own_draw_w=None)
