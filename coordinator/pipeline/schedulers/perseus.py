"""`Perseus`: profile online, plan the time-energy frontier, serve a chosen point, adapt.

The Perseus (SOSP '24) scheduler, through the ordinary scheduler interface:

1. **Profile.** An `InstructionProfiler` runs inside it (its knobs: `profiler_args`): its
   schedules are yielded and the results passed to it until it finishes. Its result is the
   per-stage (instruction, clock) -> (time, energy) table; its fit gives the power drawn while
   a stage waits (P_block: the mean over ranks, or the `p_block_w` argument, which also spares
   the profiler its blocking rounds).
2. **Plan.** The ranks' observed orders (`RankInfo.instructions`) are the schedule
   (`planner.learned.LearnedSchedule`: 1F1B, GPipe, interleaved, zero bubble, with bare
   `forward`/`backward` names or `kind:stage:microbatch` ones); `planner.plan_frontier` on the
   profiled rows and that schedule's DAG gives the iteration time-energy frontier (fastest
   first, energies decreasing); each point's plan lists, per stage, (instruction, MHz) in
   execution order. It is handed over as
   `<dump_dir>/<job dir>/frontier.csv` (index,time,energy) when the settings have a dump
   directory (and `dump_data` is not off): `take_files()`, which the coordinator writes, with
   the profiler's CSV. The rows planned on are, by default
   (`plan_clocks="grid"`), those of the clocks the profiler measured at (its grid, ~`clocks`
   of them); "all" adds every available clock in between, whose rows the profiler interpolates:
   finer options, but no new measurement, and far slower planning (planner 2026-11 on this
   machine, 8 stages x 32 microbatches: 13 s with 8 clocks, 8 minutes with an A40's 58 clocks
   from 1740 to 870 MHz).
3. **Choose.** `planner.choose`: by default the point of least energy whose time is not above
   the all-max-clock plan's less `time_margin` (1%: each clock change costs the time the agent
   takes to lock the clock, which the profile does not show; measured on the simulated nodes,
   a plan using all the slack ran 1.2-1.6% slower than all-max); `target_time` (s),
   `max_slowdown` (a fraction over the all-max time: 0.1 = 10% slower) or `eta_knob` (Zeus's
   cost knob) pick another.
4. **Serve.** Each rank's schedule follows its `RankInfo.instructions` exactly: its pipeline
   actions take the plan's clocks in order, any other instruction the highest clock. Orders the
   planner cannot model (an unknown action kind, a stage two ranks claim, a microbatch count
   that differs between stages, a dependency nobody runs, a cycle) are refused when the
   scheduler is built, and a plan whose order differs from the observed one when it is made
   (`SchedulerError`: the job stops with it and its GPUs go back to their default clocks).
5. **Keep observing.** The generator never returns (`finished` stays False, `serving` is True):
   the job keeps sending results. The iteration time of a result window is the median over its
   iterations of the slowest rank's step time. A step also holds what the planner does not see
   (the all-reduce, the optimizer step, data loading), so the first served window calibrates
   the plan: r0 = measured / planned. When a later window's measured / planned is off r0 by
   more than `replan_threshold` for `replan_window` consecutive windows, the profile no longer
   describes the job (other kernels, a throttled GPU, a changed input): Perseus re-profiles it
   from scratch (a fresh `InstructionProfiler` with the same knobs), plans and chooses again.
   Choosing again from the stale frontier would not help (its times are what drifted), hence the
   re-profile; at most `max_reprofiles` of them (0: never), after which it keeps serving.
   A re-profile asked from outside (`reprofile`: the profile ran under a power budget's caps)
   is not counted.

`frontier`, `chosen` and `progress()` are public; the job (`coordinator.pipeline.job`) uses
`frontier`, `chosen`, `serving` and `replan_window` (`FrequencyScheduler` declares them) to
slow down the pipelines that wait for a straggler and to keep what a takeover replays. Pure:
nothing here reads or writes a file.

Planning runs inside `observe()`, on the caller's thread (the coordinator's event loop): a large
frontier takes as long as the planner takes.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Sequence
from typing import Any

from coordinator.pipeline import planner
from coordinator.pipeline.paths import job_file
from coordinator.pipeline.planner import FrontierPoint
from coordinator.pipeline.planner.dag import build_dag
from coordinator.pipeline.planner.learned import LearnedSchedule
from coordinator.pipeline.schedulers.base import (
    FrequencyScheduler,
    ScheduleGenerator,
    SchedulerError,
)
from coordinator.pipeline.schedulers.instruction_profiler import InstructionProfiler
from coordinator.pipeline.schedulers.parallel3d import make_3d_parallel
from zeus_agent.models import FrequencySchedule, JobInfo, ProfilingResult, RankInfo
from zeus_agent.pipeline_order import action_kind
from zeus_agent.pipeline_order import one_f_one_b as one_f_one_b_order

__all__ = ["Perseus", "Perseus3D", "one_f_one_b", "plan_schedule"]

logger = logging.getLogger(__name__)

Plan = Sequence[Sequence[tuple[str, int]]]
"""Per stage, (instruction, MHz) of its forwards and backwards in execution order."""


def one_f_one_b(stage: int, num_stages: int, microbatches: int) -> list[str]:
    """One stage's forward/backward names in a synchronous 1F1B iteration (in order).

    Raises:
        ValueError: An argument out of range (`zeus_agent.pipeline_order.one_f_one_b`).
    """
    return [name for name, _ in one_f_one_b_order(stage, num_stages, microbatches)]


def plan_schedule(
    rank: int, instructions: Sequence[str], stage_plan: Sequence[tuple[str, int]], top_clock: int
) -> FrequencySchedule:
    """A rank's schedule from its stage's plan, in the rank's own instruction order.

    Its pipeline actions (`zeus_agent.pipeline_order.action_kind`) take the plan's clocks in
    order; any other instruction runs at `top_clock`.

    Raises:
        SchedulerError: The plan's actions are not the rank's, in its order.
    """
    try:
        actions = [name for name in instructions if action_kind(name) is not None]
    except ValueError as e:
        raise SchedulerError(f"rank {rank}: {e}") from None
    planned = [name for name, _ in stage_plan]
    if actions != planned:
        raise SchedulerError(
            f"the plan orders rank {rank}'s pipeline actions as {_short(planned)}, but the "
            f"rank runs {_short(actions)}: the plan is not the pipeline's schedule")
    clocks = iter(int(f) for _, f in stage_plan)
    return FrequencySchedule(
        rank=rank,
        frequencies=[(name, next(clocks) if action_kind(name) is not None else top_clock)
                     for name in instructions],
    )


class Perseus(FrequencyScheduler):
    """Profile, plan the frontier, choose, serve, re-plan on drift (see the module docstring).

    Args:
        job_info: The job (under `make_3d_parallel`: its pipeline, one rank per stage).
        rank_infos: One per stage (`instructions` set by the coordinator).
        pfo_settings: Server settings (`dump_dir`, `dump_data`, `profiling_iterations`).
        profiler_args: Keyword arguments of the `InstructionProfiler` (its knobs).
        p_block_w: Power drawn while a stage waits (W); None: fitted by the profiler.
        target_time: Choose the least-energy point with an iteration time <= this (s).
        max_slowdown: Choose the least-energy point at most this fraction slower than the
            all-max plan (0.1: 10% slower).
        eta_knob: Choose by Zeus's cost, eta * energy + (1 - eta) * max power * time (0-1).
        replan_threshold: Relative drift of measured / planned time that counts (> 0).
        replan_window: Consecutive drifting result windows that trigger a re-profile (>= 1).
        max_reprofiles: Most re-profiles (>= 0; 0: never re-plan).
        frontier_path: Where the frontier CSV goes (".csv"); None: `<dump_dir>/<job dir>/
            frontier.csv` when there is a dump directory.
        plan_clocks: "grid": plan on the clocks the profiler measured at; "all": also on the
            interpolated ones in between (slower planning, see the module docstring).
        time_margin: The default choice's slack, a fraction of the all-max time (0-0.5).

    Raises:
        SchedulerError: A bad argument; ranks sharing a stage (use `Perseus3D`); a stage
            whose order is not a schedule the planner can model (`LearnedSchedule`).
    """

    @classmethod
    def check_args(cls, **kwargs: Any) -> None:
        """Check the knobs when the coordinator starts, on a two-stage job (raises on bad ones)."""
        kwargs.pop("frontier_path", None)
        args = kwargs.get("profiler_args")
        if isinstance(args, dict):
            kwargs["profiler_args"] = {k: v for k, v in args.items() if k != "result_path"}
        info = JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2)
        ranks = [RankInfo(rank=s, dp_rank=0, pp_rank=s, tp_rank=0,
                          available_frequencies=[2000, 1500, 1000],
                          instructions=one_f_one_b(s, 2, 2)) for s in range(2)]
        cls(info, ranks, None, **kwargs)

    def __init__(
        self,
        job_info: JobInfo,
        rank_infos: Sequence[RankInfo],
        pfo_settings: Any,
        *,
        profiler_args: dict[str, Any] | None = None,
        p_block_w: float | None = None,
        target_time: float | None = None,
        max_slowdown: float | None = None,
        eta_knob: float | None = None,
        replan_threshold: float = 0.05,
        replan_window: int = 3,
        max_reprofiles: int = 2,
        frontier_path: str | None = None,
        plan_clocks: str = "grid",
        time_margin: float = 0.01,
    ) -> None:
        if profiler_args is None:
            profiler_args = {}
        _check_knobs(profiler_args, p_block_w, target_time, max_slowdown, eta_knob,
                     time_margin, replan_threshold, replan_window, max_reprofiles,
                     frontier_path, plan_clocks)
        self.time_margin = float(time_margin)
        self.plan_clocks = plan_clocks
        self.p_block_w = None if p_block_w is None else float(p_block_w)
        self.target_time = target_time
        self.max_slowdown = max_slowdown
        self.eta_knob = eta_knob
        self.replan_threshold = float(replan_threshold)
        self.replan_window = replan_window
        self.max_reprofiles = max_reprofiles
        self.profiler_args = dict(profiler_args)
        if self.p_block_w is not None:
            self.profiler_args.setdefault("p_block_w", self.p_block_w)
        self.frontier: list[FrontierPoint] | None = None
        """The frontier of the last plan (`planner.FrontierPoint`s, fastest first)."""
        self.chosen: FrontierPoint | None = None
        """The frontier point being served."""
        self.all_max_time: float | None = None
        """Planned iteration time with every instruction at its highest clock (s)."""
        self.serving = False
        """True while a chosen plan is served (the job keeps sending results)."""
        self.reprofiles = 0
        self.asked = False
        """A re-profile was asked (`reprofile`): at the next window served."""
        self.drift: float | None = None
        """Latest window's measured / planned time relative to the first served window's, - 1."""
        self.profile_rows: list[tuple[int, str, int, float, float]] = []
        """The profiled (stage, instruction, MHz, time, energy) rows of the last plan."""
        self.p_block_used: float | None = None
        """The blocking power the last plan was made with (W)."""
        self.num_microbatches = 0
        self.num_stages = 0
        self.schedule: LearnedSchedule | None = None
        """The schedule the ranks run, learned from their observed orders."""
        self._check_ranks(rank_infos)
        super().__init__(job_info, rank_infos, pfo_settings)
        if frontier_path is None:
            dump_dir = _setting(pfo_settings, "dump_dir", None)
            if dump_dir and _setting(pfo_settings, "dump_data", True):
                frontier_path = job_file(str(dump_dir), job_info.job_id or "job",
                                         "frontier.csv")
        self.frontier_path = frontier_path
        self._top = {info.rank: max(info.available_frequencies) for info in self.rank_infos}
        self._profiler = self._new_profiler()  # Checks the profiler's knobs now.

    def _check_ranks(self, rank_infos: Sequence[RankInfo]) -> None:
        """One rank per stage, each with its observed order; learn the schedule from them."""
        if not rank_infos:
            raise SchedulerError("Perseus needs at least one RankInfo")
        stages: dict[int, RankInfo] = {}
        for info in rank_infos:
            if info.pp_rank in stages:
                raise SchedulerError(
                    f"ranks {stages[info.pp_rank].rank} and {info.rank} are both stage "
                    f"{info.pp_rank}: Perseus plans one pipeline, one rank per stage; use "
                    "Perseus3D for jobs with data or tensor parallelism")
            stages[info.pp_rank] = info
            if info.instructions is None:
                raise SchedulerError(
                    f"rank {info.rank} has no instructions: the coordinator must set "
                    "RankInfo.instructions before building Perseus")
        if sorted(stages) != list(range(len(stages))):
            raise SchedulerError(f"stages must be 0..{len(stages) - 1}, got {sorted(stages)}")
        orders = [stages[s].instructions or [] for s in range(len(stages))]
        try:
            schedule = LearnedSchedule.from_orders(orders)
            build_dag(schedule)  # Refuses a cycle now rather than when planning.
        except ValueError as e:
            raise SchedulerError(f"Perseus cannot plan this pipeline schedule: {e}") from None
        self.schedule = schedule
        self.num_microbatches = schedule.num_microbatches
        self.num_stages = len(stages)

    def _new_profiler(self) -> InstructionProfiler:
        try:
            return InstructionProfiler(self.job_info, self.rank_infos, self.pfo_settings,
                                       **self.profiler_args)
        except TypeError as e:
            raise SchedulerError(f"profiler_args: {e}") from None

    # ----------------------------------------------------------------------------- interface

    def progress(self) -> tuple[int, int] | None:
        """The profiler's (rounds done, rounds planned) while profiling; None while serving."""
        return None if self.serving else self._profiler.progress()

    def reprofile(self) -> bool:
        """Profile again from the next window served on, not counted in `max_reprofiles`.

        The coordinator asks it once no power budget governs the job's GPUs, when the profile
        its frontier was planned from ran under a budget's caps (its fast clocks throttled:
        the frontier has them slower and cooler than they are, and the budgets cap the job
        proportionally rather than plan on it, `coordinator.budget.capped_profiles`). Not
        counted: the job did not drift, a cap spoilt the profile; counted, a job whose last
        allowed re-profile ran under a cap could never be planned on again. The window in
        which it is asked is served (its results are not used). False (nothing asked): not
        serving a plan (profiling already).
        """
        if not self.serving:
            return False
        self.asked = True
        return True

    def schedules_for(self, point: Any) -> list[FrequencySchedule]:
        """Every rank's schedule for a frontier point (by rank).

        Raises:
            SchedulerError: The point's plan does not fit the ranks (stages, order).
        """
        plan = point.plan
        if len(plan) != self.num_stages:
            raise SchedulerError(
                f"the plan has {len(plan)} stage(s), the pipeline {self.num_stages}")
        return [plan_schedule(info.rank, info.instructions or [], plan[info.pp_rank],
                              self._top[info.rank]) for info in self.rank_infos]

    # ----------------------------------------------------------------------------- generator

    def _run(self) -> ScheduleGenerator:
        while True:
            profiler = self._profiler
            schedules = profiler.next_schedule()
            while not profiler.finished:
                results = yield schedules
                profiler.observe(results)
                self._files += profiler.take_files()  # Its profile, once it has finished.
                schedules = profiler.next_schedule()
            served = self._plan(profiler)
            self.serving = True
            baseline: float | None = None
            drifting = 0
            planned = max(self.chosen.time if self.chosen is not None else 0.0, 1e-12)
            while True:
                results = yield served
                if self.asked:  # (Asked from outside: not counted in `max_reprofiles`.)
                    logger.info("profiling again, as asked (the profile was planned under a "
                                "power budget's caps)")
                    self.asked, self.serving = False, False
                    self._profiler = self._new_profiler()
                    break
                ratio = _window_time(results) / planned
                if baseline is None:
                    baseline = ratio
                    continue
                self.drift = ratio / baseline - 1.0
                drifting = drifting + 1 if abs(self.drift) > self.replan_threshold else 0
                if drifting < self.replan_window:
                    continue
                if self.reprofiles >= self.max_reprofiles:
                    if drifting == self.replan_window:
                        logger.warning(
                            "iteration time %+.1f%% off the plan for %d windows; already "
                            "re-profiled %d time(s) (max_reprofiles): keeping the plan",
                            100 * self.drift, drifting, self.reprofiles)
                    continue
                logger.info("iteration time %+.1f%% off the plan for %d windows: profiling "
                            "again", 100 * self.drift, drifting)
                self.reprofiles += 1
                self.serving = False
                self._profiler = self._new_profiler()
                break

    def _plan(self, profiler: InstructionProfiler) -> list[FrequencySchedule]:
        """Frontier, choice and schedules from a finished profiler."""
        rows = profiler.profile_rows(every_clock=self.plan_clocks == "all")
        self.profile_rows = rows
        p_block = self.p_block_w
        if p_block is None:
            fitted = [p for info in self.rank_infos
                      if (p := profiler.estimates(info.rank).get("p_block_w")) is not None]
            if not fitted:
                raise SchedulerError("the profiler fitted no blocking power; give p_block_w")
            p_block = max(0.0, statistics.fmean(fitted))
        self.p_block_used = p_block
        profile = planner.InstructionProfile.from_rows(rows)
        m, s = self.num_microbatches, self.num_stages
        frontier = list(planner.plan_frontier(profile, m, num_stages=s, p_block_w=p_block,
                                              schedule=self.schedule))
        if not frontier:
            raise SchedulerError("the planner found no frontier point")
        top_plan = planner.max_frequency_plan(profile, m, schedule=self.schedule)
        all_max_time, _ = planner.evaluate(profile, top_plan, m, p_block,
                                           schedule=self.schedule)
        self.all_max_time = float(all_max_time)
        target = self.target_time
        if (target is None and self.max_slowdown is None and self.eta_knob is None
                and self.time_margin > 0):
            # No slowdown, with a margin: every clock change costs time the profile does not
            # show (the agent locks the new clock as the instruction begins), and the plan
            # that uses all the slack would pay it on the critical path.
            target = self.all_max_time * (1.0 - self.time_margin)
        chosen = planner.choose(frontier, target_time=target,
                                max_slowdown=self.max_slowdown, eta_knob=self.eta_knob,
                                all_max_time=self.all_max_time)
        served = self.schedules_for(chosen)  # Refuses a plan of another order.
        self.frontier, self.chosen = frontier, chosen
        logger.info("frontier of %d point(s) (%.4g-%.4g s); chose %.4g s, %.4g J (all max: "
                    "%.4g s)", len(frontier), frontier[0].time, frontier[-1].time, chosen.time,
                    chosen.energy, self.all_max_time)
        self._write_frontier(frontier)
        return served

    def _write_frontier(self, frontier: list[FrontierPoint]) -> None:
        """Hand the frontier over as CSV (index,time,energy) for `frontier_path`, if any."""
        if not self.frontier_path:
            return  # (It stays in `self.frontier` if it cannot be written.)
        lines = ["index,time,energy\n"]
        lines += [f"{i},{float(p.time)!r},{float(p.energy)!r}\n" for i, p in enumerate(frontier)]
        self._give_file(self.frontier_path, "".join(lines), "the frontier")


def _check_knobs(profiler_args: Any, p_block_w: Any, target_time: Any, max_slowdown: Any,
                 eta_knob: Any, time_margin: Any, replan_threshold: Any, replan_window: Any,
                 max_reprofiles: Any, frontier_path: Any, plan_clocks: Any) -> None:
    """Refuse a bad knob (`SchedulerError` naming it)."""
    if not isinstance(profiler_args, dict):
        raise SchedulerError(f"profiler_args must be a JSON object, got {profiler_args!r}")
    _positive("p_block_w", p_block_w, allow_zero=True)
    _positive("target_time", target_time)
    _positive("max_slowdown", max_slowdown, allow_zero=True)
    _positive("eta_knob", eta_knob, allow_zero=True)
    _positive("time_margin", time_margin, allow_zero=True)
    if time_margin >= 0.5:
        raise SchedulerError(f"time_margin must be < 0.5, got {time_margin!r}")
    if eta_knob is not None and eta_knob > 1.0:
        raise SchedulerError(f"eta_knob must be in [0, 1], got {eta_knob!r}")
    given = [n for n, v in (("target_time", target_time), ("max_slowdown", max_slowdown),
                            ("eta_knob", eta_knob)) if v is not None]
    if len(given) > 1:
        raise SchedulerError(f"give at most one of target_time, max_slowdown and eta_knob, "
                             f"not {' and '.join(given)}")
    _positive("replan_threshold", replan_threshold)
    for name, value, low in (("replan_window", replan_window, 1),
                             ("max_reprofiles", max_reprofiles, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise SchedulerError(f"{name} must be an integer >= {low}, got {value!r}")
    if frontier_path is not None and (
        not isinstance(frontier_path, str) or not frontier_path.endswith(".csv")
    ):
        raise SchedulerError(
            f"frontier_path must be a path ending with '.csv', got {frontier_path!r}")
    if plan_clocks not in ("grid", "all"):
        raise SchedulerError(f'plan_clocks must be "grid" or "all", got {plan_clocks!r}')


def _window_time(results: list[ProfilingResult]) -> float:
    """Median over the window's iterations of the slowest rank's iteration time."""
    n = min((len(r.iter_time) for r in results), default=0)
    if n == 0:
        raise SchedulerError("results without iterations")
    return statistics.median(max(r.iter_time[i] for r in results) for i in range(n))


def _short(names: Sequence[str]) -> str:
    """A short view of an order: FBFB for bare names, F0.1 I0.1 ... for named actions."""
    letter = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W"}
    parts = []
    for name in names:
        kind, _, rest = name.partition(":")
        parts.append(letter.get(kind, "?") + rest.replace(":", "."))
    text = ("" if all(":" not in n for n in names) else " ").join(parts)
    return text if len(text) <= 40 else text[:40] + "..."


def _positive(name: str, value: Any, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    ok = (not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
          and (value >= 0 if allow_zero else value > 0))
    if not ok:
        raise SchedulerError(
            f"{name} must be a finite number {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def _setting(settings: Any, name: str, default: Any) -> Any:
    if isinstance(settings, dict):
        return settings.get(name, default)
    return getattr(settings, name, default)


Perseus3D = make_3d_parallel(Perseus, "Perseus3D")
