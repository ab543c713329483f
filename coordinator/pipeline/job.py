"""`PipelineJob`: one DP x PP x TP job's frequency optimisation across ranks (sans-I/O).

It wraps a `FrequencyScheduler` and turns the agents' measurements into its inputs:

1. **Discovering.** Until every rank has completed two consecutive iterations with the same
   instructions (a step measurement and the instruction measurements of that step; one
   iteration may have been seen only in part, when the trainer started before the job), the
   job runs at the GPUs' current clocks. Each rank's instruction names in execution order become
   its `RankInfo.instructions`; then the scheduler is built (a scheduler that cannot run for
   this job is an `error` status, not a crash).
2. **Schedule n.** The scheduler's schedules (one per rank, checked against the observed
   instruction order and each GPU's clocks) are installed as version n, switching on every
   rank at the same iteration boundary: `from_step` = the median over ranks of the latest step
   each has completed + `switch_lead_steps` (one rank with a wild counter cannot push it away).
   Dumps: `ranks.json` (once) and `<n>.sched.json`. Versions start at `first_version` (a
   restarted coordinator continues the numbering of its predecessor's dumps).
3. **Observing.** Measurements carry the schedule version they ran under. Once every rank has
   `profiling_iterations` complete iterations under version n, each rank's first ones become one
   `ProfilingResult` (`iter_time`, `iter_energy`, `time_breakdown`, `energy_breakdown` by
   instruction name, in order), dumped as `<n>.prof.json` and observed by the scheduler.
4. A scheduler that has finished keeps serving its last schedules (installed if they differ
   from the current ones): the job is **serving** them and stops collecting. Otherwise the
   scheduler's schedules become version n + 1 (step 2), even when they equal the current ones
   (a scheduler holding a setting).

Guards: a rank whose iterations no longer run the instructions it was discovered with
(`MAX_ORDER_MISMATCHES` in a row), a rank that left (its agent reports the trainer gone) or a
schedule that cannot be delivered (`abort`) stops the optimisation: the job's schedules are
cleared (default clocks) and the status says why. A rank silent for `stall_after_s` while
profiling gets a `stalled` status naming it. Memory is bounded: per rank, only iterations of
the current version (at most `profiling_iterations` of them) and those still being completed
are kept.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from coordinator.optimizer import Action, ClearSchedules, InstallSchedules, KeepFile, StatusUpdate
from coordinator.pipeline.scheduler import FrequencyScheduler, SchedulerError
from zeus_agent.models import FrequencySchedule, JobInfo, ProfilingResult, RankInfo
from zeus_agent.wire.messages import Mark, Measurement, TrainerEvent

__all__ = ["PipelineJob", "SchedulerFactory"]

SchedulerFactory = Callable[[JobInfo, list[RankInfo]], FrequencyScheduler]
"""Builds the job's scheduler from its info and its ranks (with their instruction orders)."""

MAX_OPEN_STEPS = 64
"""Most incomplete iterations kept per rank (older ones are dropped)."""
MAX_INSTRUCTIONS_PER_STEP = 100_000
MAX_ORDER_MISMATCHES = 3
"""Consecutive iterations of a rank with other instructions than discovered before it stops."""
DEFAULT_STALL_AFTER_S = 30.0


@dataclass
class _Step:
    """One iteration of one rank, as its measurements arrive."""

    instructions: dict[int, tuple[str, float, float, int | None]] = field(default_factory=dict)
    """Instruction index -> (name, time, energy, schedule version)."""
    time_s: float | None = None
    energy_j: float | None = None
    version: int | None = None


class PipelineJob:
    """Discover, schedule, observe, re-schedule (see the module docstring)."""

    def __init__(
        self,
        job_id: str,
        job_info: JobInfo,
        rank_infos: Sequence[RankInfo],
        make_scheduler: SchedulerFactory,
        *,
        scheduler_name: str = "",
        profiling_iterations: int = 5,
        switch_lead_steps: int = 2,
        first_version: int = 0,
        stall_after_s: float = DEFAULT_STALL_AFTER_S,
    ) -> None:
        if profiling_iterations < 1:
            raise ValueError(f"profiling_iterations must be >= 1, got {profiling_iterations}")
        if switch_lead_steps < 1:
            raise ValueError(f"switch_lead_steps must be >= 1, got {switch_lead_steps}")
        self.job_id = job_id
        self.job_info = job_info
        self.rank_infos = {info.rank: info for info in rank_infos}
        self.make_scheduler = make_scheduler
        self.scheduler_name = scheduler_name
        self.profiling_iterations = profiling_iterations
        self.switch_lead_steps = switch_lead_steps
        self.phase = "discovering"
        self.scheduler: FrequencyScheduler | None = None
        self.version: int | None = None
        """Number of the schedules installed last (None before the first)."""
        self.schedules: dict[int, FrequencySchedule] = {}
        self.orders: dict[int, list[str]] = {}
        self.error: str | None = None
        if first_version < 0 or not stall_after_s > 0:
            raise ValueError("first_version must be >= 0 and stall_after_s > 0")
        self.first_version = first_version
        self.stall_after_s = stall_after_s
        self._steps: dict[int, dict[int, _Step]] = {rank: {} for rank in self.rank_infos}
        self._latest: dict[int, int] = {}
        """Rank -> the latest step it completed."""
        self._candidates: dict[int, list[str]] = {}
        """Rank -> instruction names of its last complete iteration while discovering."""
        self._mismatches: dict[int, int] = {}
        self._last_seen: dict[int, float] = {}
        self._stalled: set[int] = set()
        self._observed = 0

    # ------------------------------------------------------------------ JobOptimizer
    @property
    def done(self) -> bool:
        """Serving a final plan, or stopped: nothing left to decide."""
        return self.phase in ("serving", "error", "stopped")

    @property
    def desired_power_limit(self) -> None:
        """Pipeline jobs set clocks, not power limits."""
        return None

    def desired_schedule(self, rank: int) -> tuple[FrequencySchedule, int] | None:
        """The schedule rank `rank` should run now and its version."""
        schedule = self.schedules.get(rank)
        if schedule is None or self.version is None:
            return None
        return schedule, self.version

    def start(self) -> list[Action]:
        """Every rank is registered: learn the instruction orders from one iteration."""
        return [StatusUpdate("discovering", f"all {len(self.rank_infos)} rank(s) registered; "
                             "observing one iteration to learn each rank's instructions")]

    def on_event(self, rank: int, event: TrainerEvent, now_s: float) -> list[Action]:
        """Trainer events pace nothing here: the measurements carry what is needed."""
        return []

    def on_mark(self, rank: int, mark: Mark) -> list[Action]:
        """Marks are for power-limit windows."""
        return []

    def tick(self, now_s: float) -> list[Action]:
        """Name ranks that have sent nothing for `stall_after_s` (once per silence)."""
        if self.done:
            return []
        for rank in self.rank_infos:
            self._last_seen.setdefault(rank, now_s)  # The clock starts at the first tick.
        silent = sorted(r for r, t in self._last_seen.items()
                        if now_s - t >= self.stall_after_s and r not in self._stalled)
        if not silent:
            return []
        self._stalled.update(silent)
        shown = ", ".join(str(r) for r in silent[:16]) + (" ..." if len(silent) > 16 else "")
        return [StatusUpdate("stalled", f"no iteration from rank(s) {shown} for "
                             f"{self.stall_after_s:g} s while {self.phase}: is the trainer "
                             "stuck, or its agent down?", self.progress())]

    def on_agent_error(self, rank: int, code: str, message: str, now_s: float) -> list[Action]:
        """An agent's error event about `rank`: stop when the trainer left or is unmeasurable.

        An unmeasurable trainer sends counters out of range (e.g. a step count near 2**63).
        """
        if self.done or rank not in self.rank_infos:
            return []
        if code == "trainer_gone":
            return self.abort(f"rank {rank} left ({message[:200]})", state="stopped")
        if code == "measurement_refused":
            return self.abort(f"rank {rank}'s iterations cannot be measured ({message[:200]})")
        return []

    def abort(self, why: str, state: str = "error") -> list[Action]:
        """Stop optimising: clear the job's schedules (default clocks) and say why."""
        return self._fail(why, state)

    def persisted(self) -> None:
        """Nothing: a restarted coordinator discovers and profiles again."""
        return None

    def on_measurement(self, rank: int, measurement: Measurement, now_s: float) -> list[Action]:
        """Take one step or instruction measurement of `rank`."""
        if self.done or rank not in self._steps:
            return []
        self._last_seen[rank] = now_s
        self._stalled.discard(rank)
        steps = self._steps[rank]
        m = measurement
        if self.version is not None and m.schedule != self.version:
            return []  # Before the switch (or a stale version): not what is being profiled.
        step = steps.get(m.step)
        if step is None:
            if len(steps) >= MAX_OPEN_STEPS:
                del steps[min(steps)]
            step = steps[m.step] = _Step()
        if m.kind == "instruction":
            if len(step.instructions) < MAX_INSTRUCTIONS_PER_STEP:
                step.instructions[m.index] = (m.name, m.time_s, m.energy_j, m.schedule)
            return []
        step.time_s, step.energy_j, step.version = m.time_s, m.energy_j, m.schedule
        self._latest[rank] = max(self._latest.get(rank, m.step), m.step)
        if self.phase == "discovering":
            return self._discover(rank, m.step)
        names = [step.instructions[i][0] for i in sorted(step.instructions)]
        if names != self.orders.get(rank):
            del steps[m.step]
            self._mismatches[rank] = self._mismatches.get(rank, 0) + 1
            if self._mismatches[rank] >= MAX_ORDER_MISMATCHES:
                got = ", ".join(names[:6]) + (" ..." if len(names) > 6 else "")
                return self._fail(
                    f"rank {rank} no longer runs the {len(self.orders.get(rank) or [])} "
                    f"instruction(s) it was discovered with ({len(names)} now: {got}); a "
                    "changed pipeline schedule (e.g. another number of microbatches) needs a "
                    "new job")
            return []
        self._mismatches.pop(rank, None)
        return self._maybe_observe()

    def progress(self) -> dict[str, Any]:
        """Phase, schedule number and the scheduler's own progress."""
        rounds = self.scheduler.progress() if self.scheduler is not None else None
        return {
            "phase": self.phase,
            "schedule": self.version,
            "observed": self._observed,
            "scheduler": self.scheduler_name,
            "rounds": list(rounds) if rounds else None,
            "error": self.error,
        }

    def waiting_for(self) -> dict[str, Any]:
        """Ranks that still owe iterations (discovery or the current profiling window)."""
        if self.phase == "discovering":
            return {"ranks_to_discover": sorted(set(self.rank_infos) - set(self.orders))}
        if self.phase != "profiling":
            return {}
        need = self.profiling_iterations
        return {"ranks_short_of_iterations": sorted(
            r for r, steps in self._steps.items() if len(self._complete(steps)) < need)}

    # ------------------------------------------------------------------ internals
    def _complete(self, steps: dict[int, _Step]) -> list[tuple[int, _Step]]:
        """Steps with their step measurement, under the current version, in step order."""
        return sorted((n, s) for n, s in steps.items()
                      if s.time_s is not None and s.version == self.version and s.instructions)

    def _discover(self, rank: int, step_number: int) -> list[Action]:
        step = self._steps[rank].get(step_number)
        if step is None or not step.instructions or rank in self.orders:
            return []
        names = [step.instructions[i][0] for i in sorted(step.instructions)]
        if self._candidates.get(rank) != names:  # Two iterations alike: not a partial one.
            self._candidates[rank] = names
            return []
        self.orders[rank] = names
        if len(self.orders) < len(self.rank_infos):
            return []
        infos = [info.model_copy(update={"instructions": self.orders[r]})
                 for r, info in sorted(self.rank_infos.items())]
        self.rank_infos = {info.rank: info for info in infos}
        try:
            self.scheduler = self.make_scheduler(self.job_info, infos)
            schedules = self.scheduler.next_schedule()
        except (SchedulerError, ValueError, TypeError, KeyError, OSError) as e:
            return self._fail(f"the scheduler {self.scheduler_name or ''} cannot run: {e}")
        ranks = json.dumps([info.model_dump(mode="json") for info in infos])
        return [KeepFile("ranks.json", ranks), *self._install(schedules)]

    def _install(self, schedules: list[FrequencySchedule]) -> list[Action]:
        by_rank = {s.rank: s for s in schedules}
        problem = self._check(by_rank)
        if problem is not None:
            return self._fail(problem)
        self.version = self.first_version if self.version is None else self.version + 1
        self.schedules = by_rank
        for steps in self._steps.values():
            steps.clear()
        latest = sorted(self._latest.values()) or [0]
        from_step = latest[len(latest) // 2] + self.switch_lead_steps
        rounds = self.scheduler.progress() if self.scheduler is not None else None
        self.phase = "profiling"
        what = (f"profiling {rounds[0] + 1}/{rounds[1]}" if rounds
                else f"schedule {self.version}")
        ordered = tuple(by_rank[r] for r in sorted(by_rank))
        dump = json.dumps([s.model_dump(mode="json") for s in ordered])
        return [
            InstallSchedules(ordered, self.version, from_step),
            KeepFile(f"{self.version}.sched.json", dump),
            StatusUpdate("profiling", f"{what}: schedule {self.version} from step {from_step}",
                         self.progress()),
        ]

    def _check(self, by_rank: dict[int, FrequencySchedule]) -> str | None:
        """Why these schedules cannot be installed, or None."""
        missing = sorted(set(self.rank_infos) - set(by_rank))
        if missing or len(by_rank) != len(self.rank_infos):
            return (f"the scheduler gave schedules for ranks {sorted(by_rank)[:16]}, not for "
                    f"every rank (missing {missing[:16]})")
        for rank, schedule in by_rank.items():
            names = [name for name, _ in schedule.frequencies]
            order = self.orders.get(rank)
            if order is not None and names != order:
                return (f"the schedule of rank {rank} lists {len(names)} instruction(s) that do "
                        f"not match the {len(order)} the rank runs per iteration "
                        f"({order[:4]}...)")
            clocks = set(self.rank_infos[rank].available_frequencies)
            bad = sorted({f for _, f in schedule.frequencies if clocks and f not in clocks})
            if bad:
                return f"the schedule of rank {rank} asks for clocks its GPU lacks: {bad[:8]} MHz"
        return None

    def _maybe_observe(self) -> list[Action]:
        if self.phase != "profiling" or self.scheduler is None or self.version is None:
            return []
        need = self.profiling_iterations
        complete = {r: self._complete(steps) for r, steps in self._steps.items()}
        if any(len(c) < need for c in complete.values()):
            return []
        results = [self._result(rank, [s for _, s in complete[rank][:need]])
                   for rank in sorted(complete)]
        version = self.version
        try:
            self.scheduler.observe(results)
            schedules = self.scheduler.next_schedule()
        except (SchedulerError, ValueError, TypeError, KeyError, OSError) as e:
            return self._fail(f"the scheduler failed on the results of schedule {version}: {e}")
        self._observed += 1
        dump = json.dumps([r.model_dump(mode="json") for r in results])
        actions: list[Action] = [KeepFile(f"{version}.prof.json", dump)]
        if self.scheduler.finished:  # It serves these from now on: install them if new.
            current = {r: s.frequencies for r, s in self.schedules.items()}
            if {s.rank: s.frequencies for s in schedules} != current:
                actions += [a for a in self._install(schedules)
                            if not isinstance(a, StatusUpdate)]
            self.phase = "serving"
            for steps in self._steps.values():
                steps.clear()
            actions.append(StatusUpdate("serving", f"serving plan {self.version} (the scheduler "
                                        "has finished)", self.progress()))
            return actions
        return actions + self._install(schedules)

    def _result(self, rank: int, steps: list[_Step]) -> ProfilingResult:
        times: dict[str, list[list[float]]] = {}
        energies: dict[str, list[list[float]]] = {}
        for i, step in enumerate(steps):
            for name in set(times) | {n for n, *_ in step.instructions.values()}:
                times.setdefault(name, [[] for _ in range(i)]).append([])
                energies.setdefault(name, [[] for _ in range(i)]).append([])
            for index in sorted(step.instructions):
                name, t, e, _ = step.instructions[index]
                times[name][i].append(t)
                energies[name][i].append(e)
        return ProfilingResult(
            rank=rank,
            iter_time=[s.time_s or 0.0 for s in steps],
            iter_energy=[s.energy_j or 0.0 for s in steps],
            time_breakdown=times,
            energy_breakdown=energies,
        )

    def _fail(self, why: str, state: str = "error") -> list[Action]:
        """Stop: clear the job's schedules everywhere (a predecessor's too) and say why."""
        self.phase = state
        self.error = why
        self.schedules = {}
        status = StatusUpdate(state, f"pipeline frequency optimiser stopped: {why}; the GPUs "
                              "run at their default clocks")
        return [ClearSchedules(), status]
