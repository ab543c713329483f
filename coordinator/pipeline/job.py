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
   restarted coordinator continues its predecessor's dumps); a job taken over numbers above the
   last version installed (`resumed_version`: budget points were versions too).
3. **Observing.** Measurements carry the schedule version they ran under. Once every rank has
   `profiling_iterations` complete iterations under version n, each rank's first ones become one
   `ProfilingResult` (`iter_time`, `iter_energy`, `time_breakdown`, `energy_breakdown` by
   instruction name, in order), dumped as `<n>.prof.json` and observed by the scheduler.
4. A scheduler that has finished keeps serving its last schedules (installed if they differ
   from the current ones): the job is **serving** them and stops collecting. Otherwise the
   scheduler's schedules become version n + 1 (step 2), even when they equal the current ones
   (a scheduler holding a setting).
5. A scheduler that has not finished but says it is `serving` (Perseus: it serves a chosen
   plan and keeps watching the iteration time) keeps getting results; its schedules are
   installed only when they change (a new plan), as "serving", not "profiling".

**Stragglers** (jobs with several data-parallel pipelines, while serving a scheduler that has a
`frontier`): what is measured of each pipeline's pace, and the frontier points the other pipelines
run meanwhile, are `coordinator.pipeline.stragglers`' (`Stragglers`); an explicit notice
(`set_straggler(dp_index, factor)`) overrides what is measured for that pipeline until cleared
(`factor` None). The job's `StragglerHandling` (`coordinator.pipeline.straggling`) installs those
points' schedules as a new version with a `straggler` status, and the chosen plan again (`serving`
status) when no straggler is left. Meanwhile the scheduler gets no results (its drift watch is for
the job's own time, not a straggler's).

**Phases** (`coordinator.pipeline.phase`): discovering, profiling, serving, error, stopped;
every change is checked against `TRANSITIONS` (a change it does not list raises `PhaseError`).

Guards: a rank whose iterations no longer run the instructions it was discovered with
(`MAX_ORDER_MISMATCHES` in a row), a rank that left (its agent reports the trainer gone) or a
schedule that cannot be delivered (`abort`) stops the optimisation: the job's schedules are cleared
(default clocks) and the status says why. A rank silent for `stall_after_s` while profiling gets a
`stalled` status naming it. Memory is bounded: per rank, only iterations of the current version (at
most `profiling_iterations` of them) and those still being completed are kept; of the observed
rounds a takeover replays (`persisted`), every round up to the plan being served, and of the
windows served under it only the first and the latest few. What a job keeps (the rounds too) is
charged to `Kept` (`coordinator.pipeline.memory`): past the cap per job or per node the job stops
with code `too_large`; discovery keeps only the names of each rank's last iteration and the
iterations still being completed; a rank whose trainer left (said goodbye: `trainer_left`) has its
iterations dropped, and once every rank has left a job still discovering or profiling stops. A
stopped job keeps nothing of its measurements.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from coordinator.optimizer import (
    Action,
    ClearSchedules,
    DesiredSchedule,
    InstallSchedules,
    JobSnapshot,
    KeepFile,
    SaveProgress,
    StatusUpdate,
    StragglerError,
    WriteFile,
)
from coordinator.pipeline.memory import MB, Kept, NodeBudget, name_bytes, record_bytes
from coordinator.pipeline.phase import Phase, check_transition
from coordinator.pipeline.schedulers.base import FrequencyScheduler, SchedulerError
from coordinator.pipeline.steps import (
    MAX_INSTRUCTIONS_PER_STEP,
    MAX_OPEN_STEPS,
    Step,
    complete,
    first_difference,
    profiling_result,
)
from coordinator.pipeline.stragglers import MAX_STRAGGLER_FACTOR, Stragglers
from coordinator.pipeline.straggling import StragglerHandling
from coordinator.pipeline.takeover import (
    KeptRounds,
    catch_up,
    progress_record,
    read_progress,
    replay,
    resumed_version,
)
from coordinator.pipeline.views import check_arguments, plan_view
from zeus_agent.models import FrequencySchedule, JobInfo, ProfilingResult, RankInfo
from zeus_agent.wire.event_columns import EventLike
from zeus_agent.wire.node_columns import MarkLike, MeasurementLike

__all__ = ["MAX_STRAGGLER_FACTOR", "Phase", "PipelineJob", "SchedulerFactory", "StragglerError"]

SchedulerFactory = Callable[[JobInfo, list[RankInfo]], FrequencyScheduler]
"""Builds the job's scheduler from its info and its ranks (with their instruction orders)."""

MAX_ORDER_MISMATCHES = 3
"""Consecutive iterations of a rank with other instructions than discovered before it stops."""
MAX_DISCOVERY_CHANGES = 5
"""Consecutive iterations of a rank each unlike the one before, while discovering, before the
job stops (its order never repeats: nothing to plan)."""
NEVER_REPEATS = ("its order cannot be learnt, and Perseus plans one order that every iteration "
                 "repeats: run the same schedule and number of microbatches every iteration")
DEFAULT_STALL_AFTER_S = 30.0
DEFAULT_MAX_KEPT_BYTES = 1024 * MB
"""What one job may keep of its measurements (`Kept`; settings: max_pipeline_mb_per_job)."""


class PipelineJob:
    """Discover, schedule, observe, re-schedule (see the module docstring)."""

    kind = "pipeline"
    """Its progress goes under `pipeline` in a query's reply."""

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
        straggler_threshold: float = 0.05,
        straggler_window: int = 5,
        resume: dict[str, Any] | None = None,
        max_kept_bytes: int = DEFAULT_MAX_KEPT_BYTES,
        budget: NodeBudget | None = None,
        nodes: Mapping[int, str] | None = None,
    ) -> None:
        """See the module docstring.

        `max_kept_bytes` caps what this job keeps of its measurements, `budget` (shared by a
        coordinator's jobs) what the jobs keep per node, `nodes` naming each rank's node.
        """
        check_arguments(
            straggler_threshold, straggler_window, profiling_iterations, switch_lead_steps)
        self.job_id = job_id
        self.job_info = job_info
        self.rank_infos = {info.rank: info for info in rank_infos}
        self.make_scheduler = make_scheduler
        self.scheduler_name = scheduler_name
        self.profiling_iterations = profiling_iterations
        self.switch_lead_steps = switch_lead_steps
        self._phase = Phase.DISCOVERING
        self.scheduler: FrequencyScheduler | None = None
        self.version: int | None = None
        """Number of the schedules installed last (None before the first)."""
        self.from_step: int | None = None
        """The step the schedules of `version` switch at (None: at once)."""
        self.schedules: dict[int, FrequencySchedule] = {}
        self.orders: dict[int, list[str]] = {}
        self.error: str | None = None
        if first_version < 0 or not stall_after_s > 0:
            raise ValueError("first_version must be >= 0 and stall_after_s > 0")
        self.first_version = first_version
        self.stall_after_s = stall_after_s
        self._steps: dict[int, dict[int, Step]] = {rank: {} for rank in self.rank_infos}
        self._latest: dict[int, int] = {}
        """Rank -> the latest step it completed."""
        self._candidates: dict[int, list[str]] = {}
        """Rank -> instruction names of its last complete iteration while discovering."""
        self._changes: dict[int, int] = {}
        """Rank -> consecutive iterations unlike the one before, while discovering."""
        self._mismatches: dict[int, int] = {}
        self._last_seen: dict[int, float] = {}
        self._stalled: set[int] = set()
        self._observed = 0
        self._left: set[int] = set()
        """Ranks whose trainer said goodbye (`trainer_left`) and sent nothing since."""
        self.kept = Kept(self, max_kept_bytes, budget, nodes)
        self.straggler_threshold = straggler_threshold
        self.straggler_window = straggler_window
        self.stragglers = Stragglers({r: i.dp_rank for r, i in self.rank_infos.items()},
                                     straggler_threshold, straggler_window)
        """What is known of the job's stragglers (`coordinator.pipeline.stragglers`)."""
        job = weakref.proxy(self)  # (Not a cycle: a dropped job is freed at once.)
        self.straggling = StragglerHandling(
            self.stragglers, scheduler_name=scheduler_name, phase=lambda: job.phase,
            error=lambda: job.error, scheduler=lambda: job.scheduler,
            rank_infos=lambda: job.rank_infos, orders=lambda: job.orders,
            installed=lambda: job.schedules, progress=lambda: job.progress(),
            install=lambda schedules, state, message: job._install(schedules, state, message))
        """Notices, detection and the plan served (`coordinator.pipeline.straggling`)."""
        self._resume_files: list[Action] = []
        """Files the scheduler produced while the recorded rounds were replayed (`start`)."""
        self.kept_rounds = KeptRounds(self.kept)
        """The observed rounds a takeover replays (`coordinator.pipeline.takeover`)."""
        self.resumed = False
        if resume is not None:
            self._replay(resume)

    # ------------------------------------------------------------------ stragglers
    @property
    def notices(self) -> dict[int, float]:
        """Pipeline -> straggler factor given by a notice (`set_straggler`)."""
        return self.stragglers.notices

    @property
    def detected(self) -> dict[int, float]:
        """Pipeline -> straggler factor measured."""
        return self.stragglers.detected

    def set_straggler(self, dp_index: int, factor: float | None) -> list[Action]:
        """Take an explicit straggler notice (`StragglerHandling.set_straggler`); saved."""
        return self.saving(self.straggling.set_straggler(dp_index, factor), always=True)

    # ------------------------------------------------------------------ phase
    @property
    def phase(self) -> Phase:
        """Where the optimisation stands (`coordinator.pipeline.phase`)."""
        return self._phase

    @phase.setter
    def phase(self, new: Phase | str) -> None:
        """Change phase, as `TRANSITIONS` allows (`PhaseError` otherwise)."""
        self._phase = check_transition(self._phase, new)

    # ------------------------------------------------------------------ JobOptimizer
    @property
    def done(self) -> bool:
        """Stopped, or serving a final plan with nothing left to watch (no frontier)."""
        if self.phase is Phase.SERVING:
            return not self._watching()
        return self.phase.final

    @property
    def desired_power_limit(self) -> None:
        """Pipeline jobs set clocks, not power limits."""
        return None

    def desired_schedule(self, rank: int) -> DesiredSchedule | None:
        """The schedule rank `rank` should run now, its version and its switch step."""
        schedule = self.schedules.get(rank)
        if schedule is None or self.version is None:
            return None
        return DesiredSchedule(schedule, self.version, self.from_step)

    def plans_on(self, measurement: MeasurementLike) -> bool:
        """A step may close a profiling round, and the scheduler may then plan for seconds."""
        return measurement.kind == "step"

    def saving(self, actions: list[Action], always: bool = False) -> list[Action]:
        """Record the progress (`SaveProgress`) after a round observed or a schedule made."""
        if always or any(isinstance(a, KeepFile | InstallSchedules) for a in actions):
            state = self.persisted()
            if state is not None:
                actions.append(SaveProgress("pipeline", state))
        return actions

    def start(self) -> list[Action]:
        """Every rank is registered: learn the instruction orders from one iteration.

        A job resumed from recorded progress installs the schedules it reached instead, at once.
        """
        if self.error is not None:  # The recorded progress led to a stop (replayed).
            return self._fail(self.error)
        if self.resumed and self.version is not None:
            ordered = tuple(self.schedules[r] for r in sorted(self.schedules))
            files, self._resume_files = self._resume_files, []
            return [*files, InstallSchedules(ordered, self.version),
                    StatusUpdate(self.phase.value, f"resumed from the recorded progress "
                                 f"({len(self.kept_rounds)} round(s) observed): schedule "
                                 f"{self.version}", self.progress())]
        return [StatusUpdate(Phase.DISCOVERING.value,
                             f"all {len(self.rank_infos)} rank(s) registered; observing one "
                             "iteration to learn each rank's instructions")]

    def on_event(self, rank: int, event: EventLike, now_s: float) -> list[Action]:
        """Trainer events pace nothing here: the measurements carry what is needed."""
        return []

    def on_events(self, rank: int, events: list[EventLike], now_s: float) -> list[Action]:
        """Trainer events pace nothing here (`on_event`)."""
        return []

    def selector_unreachable(self, request: int, why: str) -> list[Action]:
        """A pipeline job asks no selector."""
        return []

    def on_mark(self, rank: int, mark: MarkLike) -> list[Action]:
        """Marks are for power-limit windows."""
        return []

    def tick(self, now_s: float) -> list[Action]:
        """Name ranks that have sent nothing for `stall_after_s` (once per silence)."""
        return self.saving(self._tick(now_s))

    def _tick(self, now_s: float) -> list[Action]:
        if self.done or self.phase is Phase.SERVING:
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
        return self.saving(self._on_agent_error(rank, code, message))

    def _on_agent_error(self, rank: int, code: str, message: str) -> list[Action]:
        if self.done or rank not in self.rank_infos:
            return []
        if code == "trainer_gone":
            return self.abort(f"rank {rank} left ({message[:200]})", state="stopped")
        if code == "trainer_left":
            return self._rank_left(rank)
        if code == "measurement_refused":
            return self.abort(f"rank {rank}'s iterations cannot be measured ({message[:200]})")
        return []

    def abort(self, why: str, state: str = "error") -> list[Action]:
        """Stop optimising: clear the job's schedules (default clocks) and say why."""
        return self._fail(why, state)

    def persisted(self) -> dict[str, Any] | None:
        """What a replica taking the job over replays: orders, observed rounds, notices.

        None before the orders are known (a new owner discovers them again) and once stopped.
        The scheduler is deterministic: fed the same rounds, it reaches the same state. The
        rounds are those `KeptRounds` kept: all that led to a plan, and of the windows served under
        the current plan (or any earlier one) the first and the latest few, so a plan served
        for ever is replayed as a bounded number of windows.
        """
        if self.scheduler is None or self.phase.final:
            return None
        return progress_record(self.first_version, self.orders, self.kept_rounds.rounds,
                               self.notices, self.version, self.kept_rounds.asked)

    def _replay(self, state: dict[str, Any]) -> None:
        """Rebuild the state `persisted()` described (the actions it implied are not redone).

        Raises:
            ValueError: The state does not fit this job (other ranks), or is malformed.
        """
        recorded = read_progress(state)
        orders = recorded.orders
        if recorded.first_version is not None:
            self.first_version = recorded.first_version
        if set(orders) != set(self.rank_infos):
            raise ValueError(f"recorded progress is for ranks {sorted(orders)[:16]}, not "
                             f"{sorted(self.rank_infos)[:16]}")
        self.orders = orders
        for rank, names in sorted(orders.items()):  # (Kept as a discovered order is.)
            why = self.kept.take(rank, name_bytes(names))
            if why is not None:
                self._fail(f"rank {rank}: {why}", code="too_large")
                return
        self._schedule_first()
        self._resume_files += replay(self, recorded)  # (Written when the job starts.)
        self.stragglers.restore_notices(recorded.notices)
        if self.notices and self.phase is Phase.SERVING:
            self.straggling.apply()
        self.version = resumed_version(self.version, recorded.version)
        self.resumed = not self.phase.final
        self.from_step = None  # The replay's steps are not the trainers': installed at once.

    def on_measurement(self, rank: int, measurement: MeasurementLike, now_s: float) -> list[Action]:
        """Take one step or instruction measurement of `rank`."""
        return self.saving(self._on_measurement(rank, measurement, now_s))

    def _on_measurement(self, rank: int, m: MeasurementLike, now_s: float) -> list[Action]:
        if self.done or rank not in self._steps:
            return []
        self._last_seen[rank] = now_s
        self._stalled.discard(rank)
        self._left.discard(rank)
        steps = self._steps[rank]
        if self.version is not None and m.schedule != self.version:
            return catch_up(self, m.schedule)  # (Not what is profiled: stale, or ahead.)
        step = steps.get(m.step)
        if step is None:
            if len(steps) >= MAX_OPEN_STEPS:
                self._drop(rank, min(steps))
            step = steps[m.step] = Step()
        if m.kind == "instruction":
            if len(step.instructions) < MAX_INSTRUCTIONS_PER_STEP:
                old = step.instructions.get(m.index)
                grow = record_bytes(m.name) - (record_bytes(old[0]) if old else 0)
                why = self.kept.take(rank, grow)
                if why is not None:
                    return self._fail(f"rank {rank}: {why}", code="too_large")
                step.kept += grow
                step.instructions[m.index] = (m.name, m.time_s, m.energy_j, m.schedule)
                if step.last_end_ns is None or m.t1_ns > step.last_end_ns:
                    step.last_end_ns = m.t1_ns
            return []
        step.time_s, step.energy_j, step.version = m.time_s, m.energy_j, m.schedule
        step.start_ns = m.t0_ns
        self._latest[rank] = max(self._latest.get(rank, m.step), m.step)
        if self.phase is Phase.DISCOVERING:
            actions = self._discover(rank, m.step)
            if self.phase is Phase.DISCOVERING:
                self._drop(rank, m.step)  # Its names are the rank's candidate now.
            return actions
        names = step.names()
        if names != self.orders.get(rank):
            self._drop(rank, m.step)
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
        actions = self.straggling.track(rank, m.step, step)
        if self.phase is Phase.SERVING and self.scheduler is not None and (
                self.scheduler.finished or self.straggling.holding()):
            # Nothing to observe (a final plan, a straggler or a budget): forget the step.
            self._drop(rank, m.step)
            return actions
        for n, _ in complete(steps, self.version)[self.profiling_iterations:]:
            self._drop(rank, n)  # Only the first ones are observed.
        return actions + self._maybe_observe()

    def progress(self) -> dict[str, Any]:
        """Phase, schedule number and the scheduler's own progress."""
        rounds = self.scheduler.progress() if self.scheduler is not None else None
        return {
            "phase": self.phase.value,
            "schedule": self.version,
            "observed": self._observed,
            "scheduler": self.scheduler_name,
            "rounds": list(rounds) if rounds else None,
            "error": self.error,
            "stragglers": {str(d): round(f, 4)
                           for d, f in sorted(self.stragglers.factors().items())},
            "slowed": {str(d): round(float(p.time), 6)
                       for d, p in sorted(self.stragglers.points.items())},
            "kept_bytes": self.kept.total,
        }

    def snapshot(self) -> JobSnapshot:
        """Its phase, schedule version and the plan it serves, if any (for dashboards)."""
        return JobSnapshot(job_id=self.job_id, kind=self.kind, phase=self.phase.value,
                           schedule_version=self.version, **plan_view(self.scheduler))

    def waiting_for(self) -> dict[str, Any]:
        """Ranks that still owe iterations (discovery or the current profiling window)."""
        if self.phase is Phase.DISCOVERING:
            return {"ranks_to_discover": sorted(set(self.rank_infos) - set(self.orders))}
        if self.phase is not Phase.PROFILING:
            return {}
        need = self.profiling_iterations
        return {"ranks_short_of_iterations": sorted(
            r for r, steps in self._steps.items() if len(complete(steps, self.version)) < need)}

    # ------------------------------------------------------------------ internals

    def _discover(self, rank: int, step_number: int) -> list[Action]:
        step = self._steps[rank].get(step_number)
        if step is None or not step.instructions or rank in self.orders:
            return []
        names = step.names()
        old = self._candidates.get(rank)
        if old != names:  # Two iterations alike: not a partial one.
            why = self.kept.take(rank, name_bytes(names) - name_bytes(old or []))
            if why is not None:
                return self._fail(f"rank {rank}: {why}", code="too_large")
            self._candidates[rank] = names
            if old is not None:
                self._changes[rank] = self._changes.get(rank, 0) + 1
                if self._changes[rank] >= MAX_DISCOVERY_CHANGES:
                    return self._fail(f"rank {rank} ran other instructions in each of its last "
                                      f"{MAX_DISCOVERY_CHANGES + 1} iterations "
                                      f"({first_difference(old, names)}): {NEVER_REPEATS}")
            return []
        self.orders[rank] = names  # (Charged as the candidate; it stays kept as the order.)
        del self._candidates[rank]
        self._changes.pop(rank, None)
        if len(self.orders) < len(self.rank_infos):
            return []
        return self._schedule_first()

    def _schedule_first(self) -> list[Action]:
        """Every rank's order is known: build the scheduler, install its first schedules."""
        infos = [info.model_copy(update={"instructions": self.orders[r]})
                 for r, info in sorted(self.rank_infos.items())]
        self.rank_infos = {info.rank: info for info in infos}
        try:
            self.scheduler = self.make_scheduler(self.job_info, infos)
            schedules = self.scheduler.next_schedule()
        except (SchedulerError, ValueError, TypeError, KeyError, OSError) as e:
            return self._files() + self._fail(
                f"the scheduler {self.scheduler_name or ''} cannot run: {e}")
        ranks = json.dumps([info.model_dump(mode="json") for info in infos])
        return [KeepFile("ranks.json", ranks), *self._files(), *self._install(schedules)]

    def _files(self) -> list[Action]:
        """The files the scheduler produced since last asked, to be written."""
        if self.scheduler is None:
            return []
        return [WriteFile(f.path, f.content, f.what) for f in self.scheduler.take_files()]

    def _install(self, schedules: list[FrequencySchedule], state: str = "profiling",
                 message: str = "") -> list[Action]:
        """Install `schedules` as the next version.

        `state`: "profiling", or "serving" or "straggler" (phase "serving", with `message`
        saying what is served).
        """
        by_rank = {s.rank: s for s in schedules}
        problem = self._check(by_rank)
        if problem is not None:
            return self._fail(problem)
        self.version = self.first_version if self.version is None else self.version + 1
        self.schedules = by_rank
        self._clear_steps()
        self.stragglers.new_version()
        latest = sorted(self._latest.values()) or [0]
        from_step = self.from_step = latest[len(latest) // 2] + self.switch_lead_steps
        if state == "profiling":
            rounds = self.scheduler.progress() if self.scheduler is not None else None
            self.phase = Phase.PROFILING
            message = (f"profiling {rounds[0] + 1}/{rounds[1]}" if rounds
                       else f"schedule {self.version}")
        else:
            self.phase = Phase.SERVING
        ordered = tuple(by_rank[r] for r in sorted(by_rank))
        dump = json.dumps([s.model_dump(mode="json") for s in ordered])
        return [
            InstallSchedules(ordered, self.version, from_step),
            KeepFile(f"{self.version}.sched.json", dump),
            StatusUpdate(state, f"{message}: schedule {self.version} from step {from_step}",
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
        if self.scheduler is None or self.version is None:
            return []
        if self.phase not in (Phase.PROFILING, Phase.SERVING):
            return []
        need = self.profiling_iterations
        done = {r: complete(steps, self.version) for r, steps in self._steps.items()}
        if any(len(c) < need for c in done.values()):
            return []
        results = [profiling_result(rank, [s for _, s in done[rank][:need]])
                   for rank in sorted(done)]
        return self._observe(results)

    def _observe(self, results: list[ProfilingResult]) -> list[Action]:
        """Give one round of results (one per rank) to the scheduler; act on its answer."""
        assert self.scheduler is not None
        version = self.version
        serving = self.phase is Phase.SERVING and self.scheduler.serving
        base = {r: s.frequencies for r, s in self.straggling.plan.items()}
        try:
            self.scheduler.observe(results)
            schedules = self.scheduler.next_schedule()
        except (SchedulerError, ValueError, TypeError, KeyError, OSError) as e:
            return self._files() + self._fail(
                f"the scheduler failed on the results of schedule {version}: {e}")
        self._observed += 1
        served = (serving and not self.scheduler.finished and self.scheduler.serving
                  and {s.rank: s.frequencies for s in schedules} == base)
        files = self._files()
        window = self.scheduler.replan_window
        why = self.kept_rounds.keep(results, served, window)
        if why is not None:
            return files + self._fail(f"the results of schedule {version}: {why}",
                                      code="too_large")
        dump = json.dumps([r.model_dump(mode="json") for r in results])
        name = f"{version}.serve-{self._observed}" if serving else str(version)  # (Drift watch.)
        actions: list[Action] = [KeepFile(f"{name}.prof.json", dump), *files]
        if self.scheduler.finished:  # It serves these from now on: install them if new.
            current = {r: s.frequencies for r, s in self.schedules.items()}
            if {s.rank: s.frequencies for s in schedules} != current:
                installed = self._install(schedules)
                if self.phase is Phase.ERROR:  # They cannot be installed: stopped (say why).
                    return actions + installed
                actions += [a for a in installed if not isinstance(a, StatusUpdate)]
            self.phase = Phase.SERVING
            self.straggling.serve({s.rank: s for s in schedules})
            self._clear_steps()
            actions.append(StatusUpdate(Phase.SERVING.value, f"serving plan {self.version} (the "
                                        "scheduler has finished)", self.progress()))
            return actions
        if self.scheduler.serving:  # A plan, watched by the scheduler.
            return actions + self._serve(schedules)
        self.straggling.forget_plan()
        return actions + self._install(schedules)

    # ------------------------------------------------------------------ serving, stragglers
    def _watching(self) -> bool:
        """Whether a serving job still has something to watch (results, stragglers)."""
        scheduler = self.scheduler
        return scheduler is not None and (not scheduler.finished or scheduler.frontier is not None)

    def _drop_complete(self) -> None:
        """Forget the complete steps (in-progress ones stay: their instructions are coming)."""
        for rank, steps in self._steps.items():
            for n in [n for n, s in steps.items() if s.time_s is not None]:
                self._drop(rank, n)

    def _drop(self, rank: int, step_number: int) -> None:
        """Forget one step of `rank` (if kept) and what it was charged."""
        step = self._steps[rank].pop(step_number, None)
        if step is not None:
            self.kept.give(rank, step.kept)

    def _clear_steps(self, rank: int | None = None) -> None:
        """Forget every step (of `rank`, or of every rank)."""
        for r in (rank,) if rank is not None else list(self._steps):
            for n in list(self._steps[r]):
                self._drop(r, n)

    def _rank_left(self, rank: int) -> list[Action]:
        """Rank's trainer said goodbye: drop its steps; all gone, a job still learning stops."""
        self._left.add(rank)
        self._clear_steps(rank)
        if self._left < set(self.rank_infos):
            return []
        if self.phase in (Phase.DISCOVERING, Phase.PROFILING):
            return self._fail(f"every rank's trainer said goodbye while {self.phase}",
                              state="stopped")
        self._clear_steps()
        self.stragglers.forget_spans()
        return []

    def _serve(self, schedules: list[FrequencySchedule]) -> list[Action]:
        """The scheduler serves `schedules` (its chosen plan): install them when they are new."""
        by_rank = {s.rank: s for s in schedules}
        same = ({r: s.frequencies for r, s in by_rank.items()}
                == {r: s.frequencies for r, s in self.straggling.plan.items()})
        if same and self.phase is Phase.SERVING:
            self._drop_complete()  # The next window starts.
            return []
        self.straggling.serve(by_rank)
        self.phase = Phase.SERVING  # (Installed right below.)
        return self.straggling.apply(force=True)

    def _fail(self, why: str, state: str = "error", code: str | None = None) -> list[Action]:
        """Stop: clear the job's schedules everywhere (a predecessor's too) and say why.

        What it kept of its measurements is let go (nothing more is observed); `code` (e.g.
        `too_large`) goes in the status's progress.
        """
        self.phase = state
        self.error = why
        self.schedules = {}
        for steps in self._steps.values():
            steps.clear()
        self._candidates.clear()
        self._changes.clear()
        self.stragglers.forget_slow()
        self.kept_rounds.clear()  # (Only a running job is persisted for a takeover.)
        self.kept.release()
        status = StatusUpdate(state, f"pipeline frequency optimiser stopped: {why}; the GPUs "
                              "run at their default clocks", {"code": code} if code else {})
        return [ClearSchedules(), status]

