"""A rank's iterations as their measurements arrive, and a round's result from them. Pure.

`PipelineJob` keeps, per rank, the iterations (steps) being measured: each step's instruction
measurements come first (index, name, time, energy), its step measurement last (the iteration's
time and energy). `profiling_result` turns a rank's complete steps into the `ProfilingResult`
a scheduler observes; `mean_power_w` the draw per GPU of ranks' steps (energy over time).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from zeus_agent.models import ProfilingResult

__all__ = ["MAX_INSTRUCTIONS_PER_STEP", "MAX_OPEN_STEPS", "Step", "complete", "first_difference",
           "mean_power_w", "profiling_result"]

MAX_OPEN_STEPS = 64
"""Most incomplete iterations kept per rank (older ones are dropped)."""
MAX_INSTRUCTIONS_PER_STEP = 100_000


@dataclass
class Step:
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

    def names(self) -> list[str]:
        """The instruction names measured, in execution order."""
        return [self.instructions[i][0] for i in sorted(self.instructions)]

    def own_time(self) -> float | None:
        """The rank's own iteration time (s): start of the step -> end of its last instruction.

        The step time also holds the wait at the data-parallel all-reduce, where every
        pipeline waits for the slowest one; it is used when the stamps are unusable. None
        before the step measurement.
        """
        span = self.time_s
        if span is None:
            return None
        if self.start_ns is not None and self.last_end_ns is not None:
            own = (self.last_end_ns - self.start_ns) / 1e9
            if 0 < own <= span * (1 + 1e-3) + 1e-6:
                span = own  # Without the wait at the data-parallel all-reduce.
        return span


def complete(steps: Mapping[int, Step], version: int | None) -> list[tuple[int, Step]]:
    """Steps with their step measurement, under `version`, in step order."""
    return sorted((n, s) for n, s in steps.items()
                  if s.time_s is not None and s.version == version and s.instructions)


def profiling_result(rank: int, steps: Sequence[Step]) -> ProfilingResult:
    """One rank's `ProfilingResult` of these steps (breakdowns by instruction name, in order)."""
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


def first_difference(before: Sequence[str], now: Sequence[str]) -> str:
    """Where two iterations' instruction names part, in words (for an error status)."""
    i = next((i for i, (a, b) in enumerate(zip(before, now, strict=False)) if a != b),
             min(len(before), len(now)))
    was = before[i] if i < len(before) else "nothing"
    got = now[i] if i < len(now) else "nothing"
    return (f"the last two differ at instruction {i}: {was} before, {got} now; "
            f"{len(before)} and {len(now)} in all")


def mean_power_w(steps: Iterable[tuple[float, float | None]]) -> tuple[float | None, int]:
    """(the draw per GPU, steps counted) of ranks' steps given as (seconds, joules).

    Each rank is one GPU, so their energy over their time is the mean draw per GPU; steps
    without an energy are left out. The draw is None when they last no time.
    """
    seconds = joules = 0.0
    counted = 0
    for t, e in steps:
        if e is not None and e >= 0:
            seconds, joules, counted = seconds + t, joules + e, counted + 1
    return (joules / seconds if seconds > 0 else None), counted
