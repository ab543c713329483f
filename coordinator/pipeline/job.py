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

5. A scheduler that has not finished but says it is `serving` (Perseus: it serves a chosen
   plan and keeps watching the iteration time) keeps getting results; its schedules are
   installed only when they change (a new plan), as "serving", not "profiling".

**Stragglers** (extrinsic bloat; jobs with several data-parallel pipelines, while serving a
scheduler that has a `frontier`, see `coordinator.pipeline.perseus`). A pipeline's iteration
time, per step, is the longest over its ranks of start of the step -> end of its last
instruction: the step time itself also holds the wait at the data-parallel all-reduce, where
every pipeline waits for the slowest one, so it cannot tell them apart (the step time is used
when the stamps are unusable). Each pipeline's time is divided by the planned time of the
frontier point it runs (so a pipeline slowed down on purpose is not taken for a straggler), and
compared with the median of the other pipelines'. A pipeline slower by more than
`straggler_threshold` for `straggler_window` consecutive iterations is a straggler, with the
median ratio over that window as its factor (re-measured every window: a change beyond the
threshold is applied); it has recovered after `straggler_window` consecutive iterations within
the threshold. An explicit notice (`set_straggler(dp_index, factor)`, e.g. from an operator
who knows a node throttles) overrides what is measured for that pipeline until cleared
(`factor` None). While a straggler is known, with F its factor, every other pipeline (own
factor f, 1 unless also a straggler) runs the frontier point of least energy whose planned time
is <= chosen time * F / f * (1 - `STRAGGLER_MARGIN`): never slower than the straggler; the
straggler's ranks keep the chosen plan. That is a new schedule version, with a `straggler`
status; back to the chosen plan (`serving` status) when no straggler is left. Meanwhile the
scheduler gets no results (its drift watch is for the job's own time, not a straggler's).

Guards: a rank whose iterations no longer run the instructions it was discovered with
(`MAX_ORDER_MISMATCHES` in a row), a rank that left (its agent reports the trainer gone) or a
schedule that cannot be delivered (`abort`) stops the optimisation: the job's schedules are
cleared (default clocks) and the status says why. A rank silent for `stall_after_s` while
profiling gets a `stalled` status naming it. Memory is bounded: per rank, only iterations of
the current version (at most `profiling_iterations` of them) and those still being completed
are kept; of the observed rounds a takeover replays (`persisted`), every round up to the plan
being served, and of the windows served under it only the first and the latest few. What a job
keeps (the rounds too) is charged to `Kept` (`coordinator.pipeline.memory`): past the
cap per job or per node the job stops with code `too_large`; discovery keeps only the names of
each rank's last iteration and the iterations still being completed; a rank whose trainer
left (said goodbye: `trainer_left`) has its iterations dropped, and once every rank has left a
job still discovering or profiling stops. A stopped job keeps nothing of its measurements.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from coordinator.optimizer import Action, ClearSchedules, InstallSchedules, KeepFile, StatusUpdate
from coordinator.pipeline.memory import (
    MB,
    Kept,
    NodeBudget,
    name_bytes,
    record_bytes,
    result_bytes,
)
from coordinator.pipeline.perseus import plan_schedule
from coordinator.pipeline.scheduler import FrequencyScheduler, SchedulerError
from zeus_agent.models import FrequencySchedule, JobInfo, ProfilingResult, RankInfo
from zeus_agent.wire.messages import MAX_STRAGGLER_FACTOR, Mark, Measurement, TrainerEvent

__all__ = ["MAX_STRAGGLER_FACTOR", "PipelineJob", "SchedulerFactory", "StragglerError"]

SchedulerFactory = Callable[[JobInfo, list[RankInfo]], FrequencyScheduler]
"""Builds the job's scheduler from its info and its ranks (with their instruction orders)."""

MAX_OPEN_STEPS = 64
"""Most incomplete iterations kept per rank (older ones are dropped)."""
MAX_INSTRUCTIONS_PER_STEP = 100_000
STRAGGLER_MARGIN = 0.02
"""Other pipelines aim this fraction under the straggler's pace (measured: exactly its pace
made the iteration 3.5% slower on the simulated nodes)."""
MAX_ORDER_MISMATCHES = 3
"""Consecutive iterations of a rank with other instructions than discovered before it stops."""
DEFAULT_STALL_AFTER_S = 30.0
SERVED_ROUNDS_KEPT = 8
"""Latest served windows of a plan kept for a takeover to replay (besides its first one); at
least the scheduler's `replan_window` (Perseus), at most `MAX_SERVED_ROUNDS_KEPT`."""
MAX_SERVED_ROUNDS_KEPT = 64
DEFAULT_MAX_KEPT_BYTES = 1024 * MB
"""What one job may keep of its measurements (`Kept`; settings: max_pipeline_mb_per_job)."""


class StragglerError(ValueError):
    """A straggler notice this job cannot take; `code` is the `Reply` code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class _Step:
    """One iteration of one rank, as its measurements arrive."""

    instructions: dict[int, tuple[str, float, float, int | None]] = field(default_factory=dict)
    """Instruction index -> (name, time, energy, schedule version)."""
    time_s: float | None = None
    energy_j: float | None = None
    version: int | None = None
    start_ns: int | None = None
    """The step's start (its agent's clock)."""
    last_end_ns: int | None = None
    """The end of its latest instruction (the same clock)."""
    kept: int = 0
    """Estimated bytes of its instructions (charged to the job's `Kept`)."""


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
        if not (math.isfinite(straggler_threshold) and straggler_threshold > 0):
            raise ValueError(f"straggler_threshold must be > 0, got {straggler_threshold}")
        if straggler_window < 1:
            raise ValueError(f"straggler_window must be >= 1, got {straggler_window}")
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
        self._left: set[int] = set()
        """Ranks whose trainer said goodbye (`trainer_left`) and sent nothing since."""
        self.kept = Kept(self, max_kept_bytes, budget, nodes)
        self.straggler_threshold = straggler_threshold
        self.straggler_window = straggler_window
        self.pipelines = sorted({info.dp_rank for info in self.rank_infos.values()})
        """The data-parallel pipelines (dp ranks)."""
        self.notices: dict[int, float] = {}
        """Pipeline -> straggler factor given by a notice (`set_straggler`)."""
        self.detected: dict[int, float] = {}
        """Pipeline -> straggler factor measured."""
        self._base: dict[int, FrequencySchedule] = {}
        """The scheduler's schedules while serving (the chosen plan), before straggler changes."""
        self._points: dict[int, Any] = {}
        """Pipeline -> the frontier point it runs instead of the chosen one."""
        self._spans: dict[int, dict[int, float]] = {}
        """Step -> rank -> the rank's own iteration time (s), under the current version."""
        self._slow: dict[int, list[float]] = {}
        self._normal: dict[int, int] = {}
        self._rounds: list[list[ProfilingResult]] = []
        """The rounds of results the scheduler observed that a takeover replays (`_keep`)."""
        self._served_from: int | None = None
        """Index in `_rounds` of the first window served under the current plan (None when
        no plan is being served with unchanged schedules)."""
        self.resumed = False
        if resume is not None:
            self._replay(resume)

    # ------------------------------------------------------------------ JobOptimizer
    @property
    def done(self) -> bool:
        """Stopped, or serving a final plan with nothing left to watch (no frontier)."""
        if self.phase == "serving":
            return not self._watching()
        return self.phase in ("error", "stopped")

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
        """Every rank is registered: learn the instruction orders from one iteration.

        A job resumed from recorded progress installs the schedules it had reached instead
        (at once: its agents most likely run them already).
        """
        if self.error is not None:  # The recorded progress led to a stop (replayed).
            return self._fail(self.error)
        if self.resumed and self.version is not None:
            ordered = tuple(self.schedules[r] for r in sorted(self.schedules))
            return [InstallSchedules(ordered, self.version),
                    StatusUpdate(self.phase, f"resumed from the recorded progress "
                                 f"({len(self._rounds)} round(s) observed): schedule "
                                 f"{self.version}", self.progress())]
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
        if self.done or self.phase == "serving":
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
        rounds are those `_keep` kept: all that led to a plan, and of the windows served under
        the current plan (or any earlier one) the first and the latest few, so a plan served
        for ever is replayed as a bounded number of windows.
        """
        if self.scheduler is None or self.phase in ("error", "stopped"):
            return None
        return {
            "first_version": self.first_version,
            "orders": {str(r): names for r, names in sorted(self.orders.items())},
            "rounds": [[r.model_dump(mode="json") for r in results] for results in self._rounds],
            "notices": {str(d): f for d, f in sorted(self.notices.items())},
        }

    def _replay(self, state: dict[str, Any]) -> None:
        """Rebuild the state `persisted()` described (the actions it implied are not redone).

        Raises:
            ValueError: The state does not fit this job (other ranks), or is malformed.
        """
        try:
            orders = {int(r): [str(n) for n in names] for r, names in state["orders"].items()}
            rounds = [[ProfilingResult(**r) for r in results] for results in state["rounds"]]
            notices = {int(d): float(f) for d, f in state.get("notices", {}).items()}
            self.first_version = int(state.get("first_version", self.first_version))
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"recorded progress unreadable: {e}") from None
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
        for results in rounds:
            if self.phase in ("error", "stopped"):
                break
            self._observe(results)
        self.notices = {d: f for d, f in notices.items() if d in self.pipelines}
        if self.notices and self.phase == "serving":
            self._apply_stragglers()
        self.resumed = self.phase not in ("error", "stopped")

    def on_measurement(self, rank: int, measurement: Measurement, now_s: float) -> list[Action]:
        """Take one step or instruction measurement of `rank`."""
        if self.done or rank not in self._steps:
            return []
        self._last_seen[rank] = now_s
        self._stalled.discard(rank)
        self._left.discard(rank)
        steps = self._steps[rank]
        m = measurement
        if self.version is not None and m.schedule != self.version:
            return []  # Before the switch (or a stale version): not what is being profiled.
        step = steps.get(m.step)
        if step is None:
            if len(steps) >= MAX_OPEN_STEPS:
                self._drop(rank, min(steps))
            step = steps[m.step] = _Step()
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
        if self.phase == "discovering":
            actions = self._discover(rank, m.step)
            if self.phase == "discovering":
                self._drop(rank, m.step)  # Its names are the rank's candidate now.
            return actions
        names = [step.instructions[i][0] for i in sorted(step.instructions)]
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
        actions = self._track(rank, m.step)
        if self.phase == "serving" and self.scheduler is not None and (
                self.scheduler.finished or self._stragglers()):
            # Nothing to observe (a final plan, or a straggler's time): forget the step.
            self._drop(rank, m.step)
            return actions
        for n, _ in self._complete(steps)[self.profiling_iterations:]:
            self._drop(rank, n)  # Only the first ones are observed.
        return actions + self._maybe_observe()

    def set_straggler(self, dp_index: int, factor: float | None) -> list[Action]:
        """Take an explicit straggler notice: pipeline `dp_index` runs `factor` times slower.

        `factor` None clears the notice (what is measured counts again for that pipeline).

        Raises:
            StragglerError: No such pipeline (code "out_of_range"), a factor not in
                [1, `MAX_STRAGGLER_FACTOR`] ("bad_request"), or the job has stopped
                ("conflict").
        """
        if isinstance(dp_index, bool) or not isinstance(dp_index, int) or (
                dp_index not in self.pipelines):
            raise StragglerError(
                "out_of_range", f"the job has no pipeline {dp_index!r}: its pipelines (data-"
                f"parallel ranks) are {_ranges(self.pipelines)}")
        if factor is not None and (
            isinstance(factor, bool) or not isinstance(factor, int | float)
            or not math.isfinite(factor) or not 1.0 <= factor <= MAX_STRAGGLER_FACTOR
        ):
            raise StragglerError(
                "bad_request", f"a straggler factor is the pipeline's slowdown, from 1 to "
                f"{MAX_STRAGGLER_FACTOR:g} (1.3: 30% slower), got {factor!r}")
        if self.phase in ("error", "stopped"):
            raise StragglerError(
                "conflict", f"the job's pipeline optimiser has stopped ({self.error})")
        if factor is None:
            self.notices.pop(dp_index, None)
        else:
            self.notices[dp_index] = float(factor)
        actions = self._apply_stragglers()
        if actions:
            return actions
        what = (f"pipeline {dp_index} noted as a straggler ({factor:g}x)" if factor is not None
                else f"straggler notice of pipeline {dp_index} cleared")
        return [StatusUpdate("straggler", f"{what}; {self._why_unchanged()}", self.progress())]

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
            "stragglers": {str(d): round(f, 4) for d, f in sorted(self._stragglers().items())},
            "slowed": {str(d): round(float(p.time), 6) for d, p in sorted(self._points.items())},
            "kept_bytes": self.kept.total,
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
        old = self._candidates.get(rank)
        if old != names:  # Two iterations alike: not a partial one.
            why = self.kept.take(rank, name_bytes(names) - name_bytes(old or []))
            if why is not None:
                return self._fail(f"rank {rank}: {why}", code="too_large")
            self._candidates[rank] = names
            return []
        self.orders[rank] = names  # (Charged as the candidate; it stays kept as the order.)
        del self._candidates[rank]
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
            return self._fail(f"the scheduler {self.scheduler_name or ''} cannot run: {e}")
        ranks = json.dumps([info.model_dump(mode="json") for info in infos])
        return [KeepFile("ranks.json", ranks), *self._install(schedules)]

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
        self._spans.clear()
        self._slow.clear()
        self._normal.clear()
        latest = sorted(self._latest.values()) or [0]
        from_step = latest[len(latest) // 2] + self.switch_lead_steps
        if state == "profiling":
            rounds = self.scheduler.progress() if self.scheduler is not None else None
            self.phase = "profiling"
            message = (f"profiling {rounds[0] + 1}/{rounds[1]}" if rounds
                       else f"schedule {self.version}")
        else:
            self.phase = "serving"
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
        if self.phase not in ("profiling", "serving"):
            return []
        need = self.profiling_iterations
        complete = {r: self._complete(steps) for r, steps in self._steps.items()}
        if any(len(c) < need for c in complete.values()):
            return []
        results = [self._result(rank, [s for _, s in complete[rank][:need]])
                   for rank in sorted(complete)]
        return self._observe(results)

    def _observe(self, results: list[ProfilingResult]) -> list[Action]:
        """Give one round of results (one per rank) to the scheduler; act on its answer."""
        assert self.scheduler is not None
        version = self.version
        serving = self.phase == "serving" and bool(getattr(self.scheduler, "serving", False))
        base = {r: s.frequencies for r, s in self._base.items()}
        try:
            self.scheduler.observe(results)
            schedules = self.scheduler.next_schedule()
        except (SchedulerError, ValueError, TypeError, KeyError, OSError) as e:
            return self._fail(f"the scheduler failed on the results of schedule {version}: {e}")
        self._observed += 1
        served = (serving and not self.scheduler.finished
                  and getattr(self.scheduler, "serving", False)
                  and {s.rank: s.frequencies for s in schedules} == base)
        why = self._keep(results, served)
        if why is not None:
            return self._fail(f"the results of schedule {version}: {why}", code="too_large")
        dump = json.dumps([r.model_dump(mode="json") for r in results])
        actions: list[Action] = [KeepFile(f"{version}.prof.json", dump)]
        if self.scheduler.finished:  # It serves these from now on: install them if new.
            current = {r: s.frequencies for r, s in self.schedules.items()}
            if {s.rank: s.frequencies for s in schedules} != current:
                installed = self._install(schedules)
                if self.phase == "error":  # They cannot be installed: stopped (say why).
                    return actions + installed
                actions += [a for a in installed if not isinstance(a, StatusUpdate)]
            self.phase = "serving"
            self._base = {s.rank: s for s in schedules}
            self._clear_steps()
            actions.append(StatusUpdate("serving", f"serving plan {self.version} (the scheduler "
                                        "has finished)", self.progress()))
            return actions
        if getattr(self.scheduler, "serving", False):  # A plan, watched by the scheduler.
            return actions + self._serve(schedules)
        self._base, self._points = {}, {}
        self.detected.clear()
        return actions + self._install(schedules)

    def _keep(self, results: list[ProfilingResult], served: bool) -> str | None:
        """Keep one observed round for a takeover to replay, charged to `Kept`; why not, or None.

        Every round that leads to a plan is kept (a replay re-plans from them), and of the
        windows `served` under an unchanged plan (a scheduler that keeps watching it, e.g.
        Perseus' drift watch) the first one (Perseus' baseline) and the latest
        `SERVED_ROUNDS_KEPT` (or the scheduler's `replan_window`, at most
        `MAX_SERVED_ROUNDS_KEPT`): the ones between are given back, so a plan served for ever
        keeps a bounded number of rounds.
        """
        for result in results:
            why = self.kept.take(result.rank, result_bytes(result))
            if why is not None:
                return why
        if not served:
            self._served_from = None  # A new plan (or profiling): its rounds all count.
            self._rounds.append(results)
            return None
        if self._served_from is None:
            self._served_from = len(self._rounds)
        self._rounds.append(results)
        window = getattr(self.scheduler, "replan_window", 0)
        tail = SERVED_ROUNDS_KEPT
        if isinstance(window, int) and not isinstance(window, bool):
            tail = min(max(tail, window), MAX_SERVED_ROUNDS_KEPT)
        while len(self._rounds) - self._served_from - 1 > tail:
            for result in self._rounds.pop(self._served_from + 1):
                self.kept.give(result.rank, result_bytes(result))
        return None

    # ------------------------------------------------------------------ serving, stragglers
    def _watching(self) -> bool:
        """Whether a serving job still has something to watch (results, stragglers)."""
        scheduler = self.scheduler
        return scheduler is not None and (
            not scheduler.finished or getattr(scheduler, "frontier", None) is not None)

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
        if self.phase in ("discovering", "profiling"):
            return self._fail(f"every rank's trainer said goodbye while {self.phase}",
                              state="stopped")
        self._clear_steps()
        self._spans.clear()
        return []

    def _serve(self, schedules: list[FrequencySchedule]) -> list[Action]:
        """The scheduler serves `schedules` (its chosen plan): install them when they are new."""
        by_rank = {s.rank: s for s in schedules}
        same = ({r: s.frequencies for r, s in by_rank.items()}
                == {r: s.frequencies for r, s in self._base.items()})
        if same and self.phase == "serving":
            self._drop_complete()  # The next window starts.
            return []
        self._base = by_rank
        self.phase = "serving"  # (Installed right below.)
        return self._apply_stragglers(force=True)

    def _stragglers(self) -> dict[int, float]:
        """Pipeline -> straggler factor (> 1): notices, else what was measured."""
        factors = {**self.detected, **self.notices}
        return {d: f for d, f in factors.items() if f > 1.0}

    def _frontier(self) -> tuple[list[Any], Any] | None:
        """(frontier, chosen point) while serving a plan of a scheduler that has them."""
        frontier = getattr(self.scheduler, "frontier", None)
        chosen = getattr(self.scheduler, "chosen", None)
        if self.phase != "serving" or not self._base or not frontier or chosen is None:
            return None
        return frontier, chosen

    def _track(self, rank: int, step_number: int) -> list[Action]:
        """Record rank's own iteration time for one step; judge the step once all ranks did."""
        if len(self.pipelines) < 2 or self._frontier() is None:
            return []
        step = self._steps[rank].get(step_number)
        if step is None or step.time_s is None:
            return []
        span = step.time_s
        if step.start_ns is not None and step.last_end_ns is not None:
            own = (step.last_end_ns - step.start_ns) / 1e9
            if 0 < own <= span * (1 + 1e-3) + 1e-6:
                span = own  # Without the wait at the data-parallel all-reduce.
        spans = self._spans.setdefault(step_number, {})
        spans[rank] = span
        if len(self._spans) > MAX_OPEN_STEPS:
            del self._spans[min(self._spans)]
        if len(spans) < len(self.rank_infos):
            return []
        del self._spans[step_number]
        return self._judge(spans)

    def _planned_time(self, pipeline: int) -> float:
        found = self._frontier()
        point = self._points.get(pipeline) or (found[1] if found else None)
        time = float(point.time) if point is not None else 1.0
        return time if time > 0 else 1.0

    def _judge(self, spans: dict[int, float]) -> list[Action]:
        """One iteration of every pipeline: update what is measured of stragglers."""
        times: dict[int, float] = {}
        for rank, span in spans.items():
            d = self.rank_infos[rank].dp_rank
            times[d] = max(times.get(d, 0.0), span)
        norm = {d: t / self._planned_time(d) for d, t in times.items()}
        changed = False
        for d in self.pipelines:
            ref = statistics.median([norm[o] for o in self.pipelines if o != d])
            ratio = norm[d] / ref if ref > 0 else 1.0
            if ratio > 1 + self.straggler_threshold:
                self._slow.setdefault(d, []).append(ratio)
                self._normal[d] = 0
            else:
                self._slow[d] = []
                self._normal[d] = self._normal.get(d, 0) + 1
            slow = self._slow.get(d, [])
            if len(slow) >= self.straggler_window:
                factor = statistics.median(slow)
                self._slow[d] = []
                previous = self.detected.get(d)
                if previous is None or abs(factor / previous - 1) > self.straggler_threshold:
                    self.detected[d] = factor
                    changed = True
            elif d in self.detected and self._normal[d] >= self.straggler_window:
                del self.detected[d]
                changed = True
        return self._apply_stragglers() if changed else []

    def _plan_points(self) -> dict[int, Any]:
        """Pipeline -> the frontier point it runs instead of the chosen one (stragglers)."""
        found = self._frontier()
        stragglers = self._stragglers()
        if found is None or not stragglers:
            return {}
        frontier, chosen = found
        worst = max(stragglers.values())
        points: dict[int, Any] = {}
        for d in self.pipelines:
            own = stragglers.get(d, 1.0)
            if own >= worst:
                continue  # The straggler keeps the chosen plan.
            # A margin under the straggler's pace: clock changes cost time the plan does not
            # show, and a pipeline slowed to exactly that pace would become the critical one.
            target = float(chosen.time) * worst / own * (1 - STRAGGLER_MARGIN)
            fits = [p for p in frontier if float(p.time) <= target * (1 + 1e-9)]
            best = min(fits, key=lambda p: (float(p.energy), -float(p.time)), default=chosen)
            if float(best.energy) < float(chosen.energy):
                points[d] = best
        return points

    def _apply_stragglers(self, force: bool = False) -> list[Action]:
        """Install the schedules the stragglers call for, if they differ from the current ones.

        `force`: install anyway (a new plan is being served).
        """
        found = self._frontier()
        if found is None:
            if force and self._base:  # A plan without a frontier: serve it as it is.
                return self._install(list(self._base.values()), "serving",
                                     f"serving the plan of {self.scheduler_name}")
            return []
        points = self._plan_points()
        schedules: dict[int, FrequencySchedule] = {}
        for rank, info in self.rank_infos.items():
            point = points.get(info.dp_rank)
            if point is None:
                schedules[rank] = self._base[rank]
                continue
            try:
                stage_plan = point.plan[info.pp_rank]
                schedules[rank] = plan_schedule(rank, self.orders.get(rank, []), stage_plan,
                                                max(info.available_frequencies))
            except (SchedulerError, IndexError) as e:
                problem: list[Action] = [StatusUpdate(
                    "straggler", f"cannot slow the other pipelines down: {e}", self.progress())]
                if not force:
                    return problem
                self._points = {}
                return problem + self._install(list(self._base.values()), "serving",
                                               f"serving the plan of {self.scheduler_name}")
        current = {r: s.frequencies for r, s in self.schedules.items()}
        if not force and {r: s.frequencies for r, s in schedules.items()} == current:
            self._points = points
            return []
        self._points = points
        chosen = found[1]
        plan = (f"the plan of {float(chosen.time):.4g} s, {float(chosen.energy):.4g} J per "
                "iteration")
        if not points:
            return self._install(list(schedules.values()), "serving",
                                 f"serving {plan}" if force or not self._stragglers() else
                                 f"serving {plan} (no other pipeline to slow down)")
        stragglers = self._stragglers()
        worst = max(stragglers, key=lambda d: stragglers[d])
        source = "notice" if worst in self.notices else "measured"
        slowed = ", ".join(
            f"{d} -> {float(p.time):.4g} s ({float(p.time) / float(chosen.time):.3f}x, energy "
            f"{100 * (float(p.energy) / float(chosen.energy) - 1):+.1f}%)"
            for d, p in sorted(points.items()))
        return self._install(
            list(schedules.values()), "straggler",
            f"pipeline {worst} is a straggler ({stragglers[worst]:.3f}x, {source}); chosen "
            f"plan {float(chosen.time):.4g} s; pipeline(s) {slowed}")

    def _why_unchanged(self) -> str:
        if self.phase != "serving":
            return f"applied once a plan is served (the job is {self.phase})"
        if getattr(self.scheduler, "frontier", None) is None:
            return (f"the scheduler {self.scheduler_name} has no time-energy frontier to slow "
                    "the other pipelines down with")
        if len(self.pipelines) < 2:
            return "the job has no other pipeline to slow down"
        return "the schedules stay as they are"

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
        self._spans.clear()
        self._slow.clear()
        self._rounds.clear()  # (Only a running job is persisted for a takeover.)
        self._served_from = None
        self.kept.release()
        status = StatusUpdate(state, f"pipeline frequency optimiser stopped: {why}; the GPUs "
                              "run at their default clocks", {"code": code} if code else {})
        return [ClearSchedules(), status]


def _ranges(values: Sequence[int]) -> str:
    """0..3, or a list when not contiguous."""
    if values and list(values) == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}..{values[-1]}" if len(values) > 1 else str(values[0])
    return str(list(values)[:16])
