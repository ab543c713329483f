"""`InstructionProfiler`: online per-instruction time and energy profiling of a pipeline job.

Perseus plans a pipeline's frequencies from each stage's forward and backward time and energy at
each SM clock (the `InstructionProfilingResult` CSV). This scheduler measures them while the job
trains, through the ordinary scheduler interface (`next_schedule()` / `observe()`).

What is measured, and what is not. Instruction TIMES are exact (the trainer's events). ENERGY is
read from NVML's counter, which advances only every ~100 ms: a per-instruction reading (a few ms
to ~0.3 s) is mostly noise, and one iteration's reading is off by up to ~0.1 s of power at each
end. The sum over consecutive iterations telescopes, though: a window of N iterations is accurate
to two counter steps. So the energy is attributed per window, by the exact instruction times:

    E_window = sum over (kind, clock) of P_kind(clock) * T_kind,clock + P_block * T_idle

where T_kind,clock is the total time of that kind's instructions run at that clock in the window,
T_idle = window time - busy time (waiting for other stages, and any instruction that is not a
pipeline action, which always runs at the highest clock), and P_block the power drawn
meanwhile. The powers are the unknowns of a least-squares fit over all windows of a stage;
the per-instruction energy is P_kind(clock) * (mean time of that kind at that clock). Actions
are bare `forward`/`backward` or `kind:stage:microbatch` names (`zeus_agent.pipeline_order`):
the two halves of a split backward (`backward_input`, `backward_weight`) run at the backward
clock and share its fitted power (`GROUP`); each kind's time, hence energy, is its own.

The settings (per rank; under `make_3d_parallel`, per stage):

* Grid: `clocks` clocks from the highest available one down to `min_clock_fraction` of it,
  evenly spaced in clock PERIOD (instruction time is ~ a + b / f, so equal steps in 1/f are
  equal steps in time: finer where the curves bend most), snapped to the rank's available clocks.
* Blocking rounds (when P_block is not given and the job has 2+ stages): all stages at the
  highest clock; then even stages at the highest clock while odd stages run slowly (grid level
  `block_level`, by default the lowest: ~2x slower, so the fast stages wait ~half the time), then
  the reverse. A stage seen at the same clocks with little and with much
  waiting pins P_block.
* Staircase down the grid: (forward, backward) levels (1, 0), (1, 1), (2, 1), (2, 2), ... Each
  setting brings one new unknown, and pairing different forward and backward clocks makes
  P_fwd(f) and P_bwd(f) separable across clocks.
* One direction is not measurable from iteration energies at all: every iteration runs as many
  forwards as backwards, so moving delta joules from every backward to every forward changes no
  window's energy. The fit fixes it with a weak prior that a forward and a backward draw the same
  power at the same clock (the Perseus A40 and A100 stage profiles in `data/perseus/` have them
  within 1-6%); the prior pins only that one direction: with its small weight it does not bias
  what the windows do determine. When the true powers differ by r, both kinds' energies are off
  by ~r/2 (a 10% difference: ~5% errors); `forward_power_ratio` sets the prior's ratio when known.
* Physical bounds: the fit is a bounded least squares (`scipy.optimize.lsq_linear`): a busy
  GPU draws at least `MIN_POWER_FRACTION` of the rank's mean power, and a waiting one no less
  than nothing. Unbounded, a setting seen briefly in a window whose energy read low (a coarse
  counter, a loaded host) got a negative power, hence a negative energy in the profile.
* Warm-up: the first `warmup_iterations` iterations after a rank's schedule changed are
  discarded; a setting is held (more rounds) until `min_profile_iterations` iterations of it are
  measured.
* Early stop, per rank: after each diagonal setting (k, k), when for BOTH kinds the estimated
  energy of the last `stop_after_rising` grid levels is above the lowest so far, the rank stops
  going down. Per rank rather than globally: stages differ (the last one is often heavier or
  lighter), and the iteration runs at the pace of the slowest stage anyway, so a stopped rank
  costs nothing by waiting for the others: meanwhile it replays its own settings (more windows,
  better estimates, no new clocks). Profiling ends when every rank has stopped or reached the
  end of its grid.

At the end the result (one row per rank, instruction and available clock from the highest down
to the rank's lowest profiled grid clock; linear interpolation in between grid clocks) is
`self.result`, handed over as CSV for `result_path` (`take_files()`: the coordinator writes it),
and the scheduler serves the all-max-clock schedule from then on (Zeus 0.16 semantics: a
finished scheduler keeps serving its last one). Pure: nothing here reads or writes a file.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from coordinator.pipeline.paths import job_file
from coordinator.pipeline.schedulers.base import (
    FrequencyScheduler,
    ScheduleGenerator,
    SchedulerError,
)
from coordinator.pipeline.schedulers.parallel3d import make_3d_parallel
from zeus_agent.models import (
    FrequencySchedule,
    InstructionProfilingResult,
    JobInfo,
    OfflineProfilingResult,
    ProfilingResult,
    RankInfo,
)
from zeus_agent.pipeline_order import BACKWARD, FORWARD, KINDS, action_kind

__all__ = ["KINDS", "InstructionProfiler", "InstructionProfiler3D", "coarse_grid"]

MIN_POWER_FRACTION = 0.05
"""The least power a busy GPU is fitted to draw, as a fraction of the rank's mean power over its
windows (a GPU at work never draws less than a few percent of its average)."""

logger = logging.getLogger(__name__)

GROUP = {kind: FORWARD if kind == FORWARD else BACKWARD for kind in KINDS}
"""The clock group of each action kind: a split backward's two halves run at the backward
level and are fitted one power (window energies cannot tell them apart: they always run at
the same clock); their times, hence energies, are each their own."""

Setting = tuple[int, int]
"""(forward grid level, backward grid level); level 0 is the highest clock."""

DEFAULT_PROFILING_ITERATIONS = 5
"""Iterations per `observe()` assumed for `progress()` before the first results arrive."""


def coarse_grid(available: Sequence[int], clocks: int, min_clock_fraction: float) -> list[int]:
    """Grid clocks, highest first: evenly spaced in period, snapped to available clocks.

    Args:
        available: The rank's available SM clocks (MHz), any order.
        clocks: How many grid points to aim for (fewer when snapping merges some).
        min_clock_fraction: The lowest grid clock as a fraction of the highest available one
            (never below the lowest available clock).

    Returns:
        Distinct available clocks, highest first; the first is the highest available clock.
    """
    avail = sorted(set(available), reverse=True)
    f_max = avail[0]
    f_low = max(avail[-1], min_clock_fraction * f_max)
    candidates = [f for f in avail if f >= f_low - 1e-9] or [f_max]
    grid: list[int] = []
    for i in range(clocks):
        period = 1.0 / f_max + (1.0 / f_low - 1.0 / f_max) * i / (clocks - 1)
        nearest = min(candidates, key=lambda f: (abs(f - 1.0 / period), -f))
        if nearest not in grid:
            grid.append(nearest)
    return sorted(grid, reverse=True)


@dataclass
class _Window:
    """One usable profiling window of one rank: exact times, telescoped energy."""

    busy_s: dict[tuple[str, int], float]
    idle_s: float
    energy_j: float


@dataclass
class _RankState:
    """What the profiler knows and plans for one rank."""

    info: RankInfo
    kind_of: dict[str, str]
    """Each pipeline action name of the rank's order -> its kind."""
    grid: list[int]
    queue: list[Setting]
    """Settings to run, in order (blocking rounds, then the staircase)."""
    staircase_start: int
    """Index in `queue` of the first staircase setting (early stop is judged from there)."""
    position: int = 0
    stopped: bool = False
    replay: list[Setting] = field(default_factory=list)
    replay_index: int = 0
    current: Setting = (0, 0)
    previous: Setting | None = None
    usable: int = 0
    """Iterations measured of the current setting (after warm-up)."""
    lowest_level: int = 0
    """Deepest grid level at which both kinds have been measured."""
    windows: list[_Window] = field(default_factory=list)
    durations: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    """(kind, level) -> [sum of durations, count]."""
    powers: dict[tuple[str, int], float] = field(default_factory=dict)
    p_block_w: float | None = None


class InstructionProfiler(FrequencyScheduler):
    """Profile each rank's forward/backward time and energy at a coarse grid of SM clocks.

    See the module docstring for the design. Arguments beyond Zeus's three:

    Args:
        job_info: The job.
        rank_infos: One per rank; `instructions` must be set (the coordinator does it).
        pfo_settings: Server settings; its `dump_dir` gives the default `result_path`.
        clocks: Grid points to aim for, from the highest clock down (>= 2).
        min_clock_fraction: The lowest grid clock as a fraction of the highest (0 < x <= 1).
        warmup_iterations: Iterations discarded after a rank's schedule changes (>= 0).
        min_profile_iterations: Iterations measured (after warm-up) before a setting is left
            (>= 1); a setting is held over several `observe()` rounds if needed.
        stop_after_rising: Stop going down once this many consecutive grid levels have an
            energy above the lowest so far, for both kinds (>= 1).
        block_level: Grid level the slow stages run at in the blocking rounds (>= 1; clamped to
            the grid); None: the lowest grid level (the strongest contrast in waiting).
        p_block_w: The power drawn while a rank waits (W), when known: not fitted then.
        prior_weight: Weight of the equal-power prior relative to one window (> 0).
        forward_power_ratio: The prior's P_fwd(f) / P_bwd(f) (> 0; default 1: equal powers).
            Window energies cannot tell it (see above): set it when known, e.g. from an
            offline profile of the same model and GPU.
        result_path: Where the CSV goes (must end with ".csv"); None: `<dump_dir>/<job_id>/
            instruction_profile.csv` when `pfo_settings` has a `dump_dir`, else no file.

    Raises:
        SchedulerError: A bad argument, or a rank without `instructions` (or without both a
            forward and a backward), or without available frequencies.
    """

    @classmethod
    def check_args(cls, **kwargs: Any) -> None:
        """Check the knobs when the coordinator starts, on a one-rank job (raises on bad ones)."""
        kwargs.pop("result_path", None)  # Checked when the job runs: it may not exist yet.
        info = JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1)
        rank = RankInfo(rank=0, dp_rank=0, pp_rank=0, tp_rank=0,
                        available_frequencies=[2000, 1500, 1000],
                        instructions=["forward", "backward"])
        InstructionProfiler(info, [rank], None, **kwargs)

    def __init__(
        self,
        job_info: JobInfo,
        rank_infos: Sequence[RankInfo],
        pfo_settings: Any,
        *,
        clocks: int = 8,
        min_clock_fraction: float = 0.5,
        warmup_iterations: int = 1,
        min_profile_iterations: int = 4,
        stop_after_rising: int = 2,
        block_level: int | None = None,
        p_block_w: float | None = None,
        prior_weight: float = 0.05,
        forward_power_ratio: float = 1.0,
        result_path: str | None = None,
    ) -> None:
        _check_int("clocks", clocks, 2)
        _check_int("warmup_iterations", warmup_iterations, 0)
        _check_int("min_profile_iterations", min_profile_iterations, 1)
        _check_int("stop_after_rising", stop_after_rising, 1)
        if block_level is not None:
            _check_int("block_level", block_level, 1)
        _check_float("min_clock_fraction", min_clock_fraction, 0.0, 1.0, low_open=True)
        _check_float("prior_weight", prior_weight, 0.0, math.inf, low_open=True)
        _check_float("forward_power_ratio", forward_power_ratio, 0.0, math.inf, low_open=True)
        if p_block_w is not None:
            _check_float("p_block_w", p_block_w, 0.0, math.inf)
        if result_path is not None and (
            not isinstance(result_path, str) or not result_path.endswith(".csv")
        ):
            raise SchedulerError(
                f"result_path must be a path ending with '.csv', got {result_path!r}"
            )
        kind_maps = _action_kinds(rank_infos)
        self.clocks = clocks
        self.min_clock_fraction = float(min_clock_fraction)
        self.warmup_iterations = warmup_iterations
        self.min_profile_iterations = min_profile_iterations
        self.stop_after_rising = stop_after_rising
        self.p_block_w = None if p_block_w is None else float(p_block_w)
        self.prior_weight = float(prior_weight)
        self.forward_power_ratio = float(forward_power_ratio)
        self.result: InstructionProfilingResult | None = None
        """The profile, once profiling has finished (Zeus's: forwards and full backwards)."""
        self.tables: dict[int, dict[str, dict[str, dict[int, float]]]] = {}
        """Once finished: rank -> action kind -> "time"/"energy" -> MHz -> value."""
        self.rounds_done = 0
        """`observe()` calls consumed while profiling."""
        self._iterations_per_round = int(
            _setting(pfo_settings, "profiling_iterations", DEFAULT_PROFILING_ITERATIONS)
        )
        super().__init__(job_info, rank_infos, pfo_settings)
        if result_path is None:
            dump_dir = _setting(pfo_settings, "dump_dir", None)
            if dump_dir:
                result_path = job_file(str(dump_dir), job_info.job_id or "job",
                                       "instruction_profile.csv")
        self.result_path = result_path
        stages = sorted({info.pp_rank for info in self.rank_infos})
        blocking = self.p_block_w is None and len(stages) >= 2
        self._states: list[_RankState] = []
        for info in self.rank_infos:
            grid = coarse_grid(info.available_frequencies, clocks, self.min_clock_fraction)
            queue, start = _queue(len(grid), blocking, block_level,
                                  fast_first=stages.index(info.pp_rank) % 2 == 0)
            self._states.append(_RankState(info=info, kind_of=kind_maps[info.rank], grid=grid,
                                           queue=queue, staircase_start=start))
        self._max_schedules = [self._schedule(s, (0, 0)) for s in self._states]

    # ----------------------------------------------------------------------------- interface

    def observe(self, profiling_results: list[ProfilingResult]) -> None:
        """Take one `ProfilingResult` per rank; after profiling, serve the all-max schedule.

        Raises:
            SchedulerError: Not one result per rank (nothing is consumed then).
        """
        if not self.finished:
            ranks = sorted(r.rank for r in profiling_results)
            expected = [s.info.rank for s in self._states]
            if ranks != expected:
                raise SchedulerError(
                    f"expected one ProfilingResult per rank {expected}, got ranks {ranks}"
                )
        super().observe(profiling_results)
        if self.finished:
            self._next_schedule = self._max_schedules

    def progress(self) -> tuple[int, int] | None:
        """(rounds done, rounds planned): planned shrinks as ranks stop early."""
        if self.finished:
            return (self.rounds_done, self.rounds_done)
        per_setting = math.ceil(
            (self.warmup_iterations + self.min_profile_iterations)
            / max(self._iterations_per_round, 1)
        )
        remaining = max(
            (len(s.queue) - s.position for s in self._states if not s.stopped), default=0
        )
        return (self.rounds_done, self.rounds_done + max(remaining, 1) * max(per_setting, 1))

    def estimates(self, rank: int) -> dict[str, Any]:
        """The fitted powers of one rank: {"power": {(kind, clock): W}, "p_block_w": W}."""
        state = next(s for s in self._states if s.info.rank == rank)
        return {
            "power": {(k, state.grid[lvl]): p for (k, lvl), p in state.powers.items()},
            "p_block_w": state.p_block_w,
        }

    # ----------------------------------------------------------------------------- generator

    def _run(self) -> ScheduleGenerator:
        for state in self._states:
            state.current = state.queue[0]
        while True:
            results = yield [self._schedule(s, s.current) for s in self._states]
            self.rounds_done += 1
            by_rank = {r.rank: r for r in results}
            for state in self._states:
                self._ingest(state, by_rank[state.info.rank])
            if all(s.usable >= self.min_profile_iterations for s in self._states):
                for state in self._states:
                    self._advance(state)
                if all(s.stopped for s in self._states):
                    break
        for state in self._states:
            self._fit(state)
        self._build_tables()
        self.result = self._build_result()
        if self.result_path:  # (The result stays in `self.result` if it cannot be written.)
            self._give_file(self.result_path, self._csv_text(), "the instruction profile")

    def _schedule(self, state: _RankState, setting: Setting) -> FrequencySchedule:
        level = {FORWARD: setting[0], BACKWARD: setting[1]}
        assert state.info.instructions is not None
        return FrequencySchedule(
            rank=state.info.rank,
            frequencies=[
                (n, state.grid[level[GROUP[state.kind_of[n]]]] if n in state.kind_of
                 else state.grid[0])
                for n in state.info.instructions],
        )

    def _ingest(self, state: _RankState, result: ProfilingResult) -> None:
        """Turn one round's result into a window (after warm-up) and duration samples."""
        switched = state.previous != state.current and state.usable == 0
        skip = self.warmup_iterations if switched else 0
        n = len(result.iter_time)
        assert state.info.instructions is not None
        counts: dict[str, int] = {}
        for name in state.info.instructions:
            if name in state.kind_of:
                counts[name] = counts.get(name, 0) + 1
        usable = list(range(skip, n))
        ok = len(result.iter_energy) == n and all(
            len(result.time_breakdown.get(name, [])) == n
            and all(len(result.time_breakdown[name][i]) == c for i in usable)
            for name, c in counts.items()
        )
        state.previous = state.current
        if not ok:
            logger.warning(
                "rank %d: results do not match the schedule (iterations or instruction counts);"
                " window skipped", state.info.rank,
            )
            return
        if not usable:
            return
        level = {FORWARD: state.current[0], BACKWARD: state.current[1]}
        busy: dict[tuple[str, int], float] = {}
        for name in counts:
            kind = state.kind_of[name]
            durations = [d for i in usable for d in result.time_breakdown[name][i]]
            group_key = (GROUP[kind], level[GROUP[kind]])
            busy[group_key] = busy.get(group_key, 0.0) + sum(durations)
            acc = state.durations.setdefault((kind, level[GROUP[kind]]), [0.0, 0.0])
            acc[0] += sum(durations)
            acc[1] += len(durations)
        window_s = sum(result.iter_time[i] for i in usable)
        energy = sum(result.iter_energy[i] for i in usable)
        idle = max(window_s - sum(busy.values()), 0.0)
        state.windows.append(_Window(busy, idle, energy))
        state.usable += len(usable)

    def _advance(self, state: _RankState) -> None:
        """Move a rank to its next setting, judging the early stop after diagonal settings."""
        state.usable = 0
        if not state.stopped:
            done = state.current
            if done[0] == done[1] and state.position >= state.staircase_start:
                state.lowest_level = max(state.lowest_level, done[0])
                if self._rising(state):
                    logger.info(
                        "rank %d: energy rising for %d levels below %d MHz; stopping",
                        state.info.rank, self.stop_after_rising,
                        state.grid[state.lowest_level - self.stop_after_rising],
                    )
                    state.stopped = True
            state.position += 1
            if state.position >= len(state.queue):
                state.stopped = True
            if state.stopped:
                state.replay = list(dict.fromkeys(state.queue[: state.position]))
            else:
                state.current = state.queue[state.position]
                return
        if state.replay:
            state.current = state.replay[state.replay_index % len(state.replay)]
            state.replay_index += 1

    def _rising(self, state: _RankState) -> bool:
        if state.lowest_level < self.stop_after_rising:
            return False
        self._fit(state)
        for kind in _kinds(state):
            energies = [self._energy(state, kind, lvl) for lvl in range(state.lowest_level + 1)]
            best = int(np.argmin(energies))
            if state.lowest_level - best < self.stop_after_rising:
                return False
        return True

    # ----------------------------------------------------------------------------- the fit

    def _fit(self, state: _RankState) -> None:
        """Least squares over the rank's windows, with the equal-power prior."""
        keys = sorted({k for w in state.windows for k in w.busy_s})
        fit_block = self.p_block_w is None
        ncol = len(keys) + (1 if fit_block else 0)
        if not state.windows or not keys:
            return
        rows: list[list[float]] = []
        rhs: list[float] = []
        for w in state.windows:
            row = [w.busy_s.get(k, 0.0) for k in keys]
            target = w.energy_j
            if fit_block:
                row.append(w.idle_s)
            else:
                assert self.p_block_w is not None
                target -= self.p_block_w * w.idle_s
            rows.append(row)
            rhs.append(target)
        scale = float(np.median([sum(r) for r in rows])) or 1.0
        weight = self.prior_weight * scale
        index = {k: i for i, k in enumerate(keys)}
        for level in {lvl for _, lvl in keys}:
            if ("forward", level) in index and ("backward", level) in index:
                row = [0.0] * ncol
                row[index[("forward", level)]] = weight
                row[index[("backward", level)]] = -weight * self.forward_power_ratio
                rows.append(row)
                rhs.append(0.0)
        mean_power = sum(rhs[: len(state.windows)]) / max(
            sum(sum(r) for r in rows[: len(state.windows)]), 1e-12)
        if fit_block:
            # Keeps P_block bounded when waiting is too rare to determine it (one stage).
            row = [0.0] * ncol
            row[-1] = weight * 0.1
            rows.append(row)
            rhs.append(weight * 0.1 * 0.5 * mean_power)
        a = np.asarray(rows, dtype=float)
        b = np.asarray(rhs, dtype=float)
        norms = np.linalg.norm(a, axis=0)
        norms[norms == 0] = 1.0
        # Bounds on the unknowns (in the scaled columns: x_scaled = x * norm).
        low = np.full(ncol, MIN_POWER_FRACTION * max(mean_power, 0.0))
        if fit_block:
            low[-1] = 0.0
        from scipy.optimize import lsq_linear  # here: scipy costs every replica's start ~0.4 s

        scaled = lsq_linear(a / norms, b, bounds=(low * norms, np.full(ncol, np.inf)),
                            method="bvls")
        x = scaled.x / norms
        state.powers = {k: float(x[i]) for k, i in index.items()}
        state.p_block_w = float(x[-1]) if fit_block else self.p_block_w

    def _time(self, state: _RankState, kind: str, level: int) -> float:
        total, count = state.durations[(kind, level)]
        return total / count

    def _energy(self, state: _RankState, kind: str, level: int) -> float:
        return state.powers[(GROUP[kind], level)] * self._time(state, kind, level)

    def _build_tables(self) -> None:
        """Each rank's (kind -> "time"/"energy" -> MHz -> value), grid clocks interpolated."""
        for state in self._states:
            lowest = state.lowest_level
            grid = state.grid[: lowest + 1]
            avail = sorted({f for f in state.info.available_frequencies
                            if grid[-1] <= f <= grid[0]}, reverse=True)
            table: dict[str, dict[str, dict[int, float]]] = {}
            for kind in _kinds(state):
                times = [self._time(state, kind, lvl) for lvl in range(lowest + 1)]
                energies = [self._energy(state, kind, lvl) for lvl in range(lowest + 1)]
                table[kind] = {
                    "time": {f: _interpolate(grid, times, f) for f in avail},
                    "energy": {f: _interpolate(grid, energies, f) for f in avail},
                }
            self.tables[state.info.rank] = table

    def _build_result(self) -> InstructionProfilingResult:
        """Zeus 0.16's result: forward and full backward rows (split backwards: `tables`)."""
        entries = []
        for state in self._states:
            table = self.tables[state.info.rank]
            empty: dict[str, dict[int, float]] = {"time": {}, "energy": {}}
            info = state.info
            entries.append(OfflineProfilingResult(
                rank=info.rank, dp_rank=info.dp_rank, pp_rank=info.pp_rank,
                tp_rank=info.tp_rank,
                forward_time=table[FORWARD]["time"],
                forward_energy=table[FORWARD]["energy"],
                backward_time=table.get(BACKWARD, empty)["time"],
                backward_energy=table.get(BACKWARD, empty)["energy"],
            ))
        return InstructionProfilingResult(entries)

    def profile_rows(self, every_clock: bool = False) -> list[tuple[int, str, int, float, float]]:
        """(stage, kind, MHz, time, energy) rows of the finished profile, every kind.

        `every_clock`: also the interpolated clocks between the grid's (default: grid only).
        """
        rows: list[tuple[int, str, int, float, float]] = []
        for state in self._states:
            grid = set(state.grid)
            for kind, values in self.tables.get(state.info.rank, {}).items():
                times, energies = values["time"], values["energy"]
                rows += [(state.info.pp_rank, kind, int(f), float(times[f]), float(energies[f]))
                         for f in sorted(times) if every_clock or f in grid]
        return rows

    def _csv_text(self) -> str:
        """The profile as Zeus 0.16's CSV, with rows for split backwards when there are any."""
        assert self.result is not None
        text = self.result.to_csv_text()
        by_rank = {s.info.rank: s.info for s in self._states}
        for rank, table in self.tables.items():
            info = by_rank[rank]
            for kind in (k for k in KINDS if k in table and k not in (FORWARD, BACKWARD)):
                for f, t in table[kind]["time"].items():
                    text += (f"{rank},{info.dp_rank},{info.pp_rank},{info.tp_rank},"
                             f"{info.pp_rank},{kind},{f},{t!r},{table[kind]['energy'][f]!r}\n")
        return text


def _kinds(state: _RankState) -> list[str]:
    """The action kinds a rank runs, in `KINDS` order."""
    present = set(state.kind_of.values())
    return [k for k in KINDS if k in present]


def _action_kinds(rank_infos: Sequence[RankInfo]) -> dict[int, dict[str, str]]:
    """Rank -> {pipeline action name: kind}; refuses ranks the profiler cannot profile."""
    if not rank_infos:
        raise SchedulerError("InstructionProfiler needs at least one RankInfo")
    maps: dict[int, dict[str, str]] = {}
    for info in rank_infos:
        if info.instructions is None:
            raise SchedulerError(
                f"rank {info.rank} has no instructions: the coordinator must set "
                "RankInfo.instructions (the iteration's instruction names in order) before "
                "building InstructionProfiler"
            )
        kinds: dict[str, str] = {}
        for name in info.instructions:
            try:
                kind = action_kind(name)
            except ValueError as e:
                raise SchedulerError(f"rank {info.rank}: {e}") from None
            if kind is not None:
                kinds[name] = kind
        groups = {GROUP[k] for k in kinds.values()}
        missing = [k for k in (FORWARD, BACKWARD) if k not in groups]
        if missing:
            raise SchedulerError(
                f"rank {info.rank}: instructions have no {' and no '.join(missing)}; "
                "InstructionProfiler profiles pipeline forwards and backwards"
            )
        if not info.available_frequencies or min(info.available_frequencies) <= 0:
            raise SchedulerError(
                f"rank {info.rank}: available_frequencies must be a non-empty list of "
                f"positive clocks (MHz), got {info.available_frequencies!r}"
            )
        maps[info.rank] = kinds
    return maps


def _queue(levels: int, blocking: bool, block_level: int | None,
           fast_first: bool) -> tuple[list[Setting], int]:
    """A rank's settings (blocking rounds, then the staircase) and where the staircase starts."""
    if blocking and levels >= 2:
        slow = min(block_level or levels - 1, levels - 1)
        queue = [(0, 0), (0, 0), (slow, slow)] if fast_first else [
            (0, 0), (slow, slow), (0, 0)]
    else:
        queue = [(0, 0)]
    start = len(queue)
    for level in range(1, levels):
        queue += [(level, level - 1), (level, level)]
    return queue, start


def _interpolate(grid: list[int], values: list[float], clock: int) -> float:
    """Linear interpolation in clock between grid points (grid highest first)."""
    if len(grid) == 1:
        return values[0]
    for i in range(len(grid) - 1):
        hi, lo = grid[i], grid[i + 1]
        if lo <= clock <= hi:
            frac = (clock - lo) / (hi - lo)
            return values[i + 1] + frac * (values[i] - values[i + 1])
    return values[0] if clock > grid[0] else values[-1]


def _setting(settings: Any, name: str, default: Any) -> Any:
    if isinstance(settings, dict):
        return settings.get(name, default)
    return getattr(settings, name, default)


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise SchedulerError(f"{name} must be an integer >= {low}, got {value!r}")


def _check_float(
    name: str, value: Any, low: float, high: float, *, low_open: bool = False
) -> None:
    ok = (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and (value > low if low_open else value >= low)
        and value <= high
    )
    if not ok:
        bound = f"{'>' if low_open else '>='} {low}"
        if high != math.inf:
            bound += f" and <= {high}"
        raise SchedulerError(f"{name} must be a finite number {bound}, got {value!r}")


InstructionProfiler3D = make_3d_parallel(InstructionProfiler, "InstructionProfiler3D")
