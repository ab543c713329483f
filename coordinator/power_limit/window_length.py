"""How long a power-limit profiling window must last for its energy to mean something (pure).

A GPU's energy counter changes only every ~100 ms (NVML's; the agent learns the period from its
reads and announces it, `GpuDescription.energy_period_ms`). A mark's energy is interpolated
between the two counter updates around it, as if the power had been constant between them; but
the steps before and after a window run at other limits (the previous limit's window, the next
one's warm-up), so each edge of a window is off by up to a quarter period of the power
difference across it. A window of 3 steps of 13 ms lasts 40 ms, under one period: its energy is
mostly its neighbours' (a run that found it measured 250 W drawing more than 300 W, and pinned
300 W or 150 W where the workload's optimum is 100 W). Over `MIN_WINDOW_PERIODS` periods the
error of each edge is at most a twentieth of the power difference across it.

`WindowLength.judge`: a measured window that lasted less than `MIN_WINDOW_PERIODS` periods makes
`profile_steps` a minimum: every window from then on covers enough steps (from the window's own
time per step, with a `MARGIN`, at most `MAX_WINDOW_STEPS`), the open one is lengthened in place
and windows shorter than that are profiled again (`Verdict`). Only a window that covered the
minimum and still lasted too little raises it again (steps got faster), so the minimum moves a
few times at most, and each limit is profiled again only as often. Profiles stay comparable: the
machine scales every window to `profile_steps` (`aggregate`). Zeus 0.16 has no such check.

Pure: the job passes the measured windows; no clock, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zeus_agent.wire.messages import PowerLimitOptions

__all__ = ["MARGIN", "MAX_WINDOW_STEPS", "MIN_WINDOW_PERIODS", "Verdict", "WindowLength"]

MIN_WINDOW_PERIODS = 5
"""Energy-counter periods a profiling window must span."""
MARGIN = 1.25
"""Lengthened windows aim this much over the minimum (steps vary; a rank may run faster)."""
MAX_WINDOW_STEPS = 10_000
"""Most steps a window is lengthened to (a window as long still short is kept as it is)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """What to do about a window that lasted less than the minimum.

    Attributes:
        min_steps: The fewest steps a window covers from now on (the machine's
            `min_window_steps`; unchanged when the window cannot be made longer).
        redo: Whether the window is profiled again (it covered fewer than `min_steps` steps);
            otherwise it is kept as measured.
        message: For the job's status.
    """

    min_steps: int
    redo: bool
    message: str


class WindowLength:
    """A job's minimum window duration, from its GPUs' energy-counter period.

    Args:
        period_s: The longest energy-counter period of the job's GPUs (s); None (not known)
            or 0 (continuous): no minimum.
        periods: Periods a window must span.
    """

    def __init__(self, period_s: float | None, periods: int = MIN_WINDOW_PERIODS) -> None:
        self.period_s = period_s or 0.0
        self.periods = periods
        self.min_window_s = periods * self.period_s
        """The shortest window whose energy is trusted (s; 0: any)."""

    def describe(self) -> str:
        """The minimum in words, for the job's first status ("" when there is none)."""
        if not self.min_window_s:
            return ""
        return (f"windows of at least {self.min_window_s:.2g} s ({self.periods} periods of the "
                f"GPUs' {_ms(self.period_s)} energy counters)")

    def epoch_note(self, options: PowerLimitOptions, min_steps: int) -> str:
        """What a window cut by an epoch end needs, when windows were lengthened ("" if not)."""
        if min_steps <= options.profile_steps:
            return ""
        return (f": windows are {min_steps} steps now (profile_steps is a minimum), so an "
                f"epoch must hold {options.warmup_steps + min_steps} steps for one to finish")

    def judge(self, name: str, steps: int, covered: int, span_s: float,
              min_steps: int) -> Verdict | None:
        """What to do about a measured window, None when it lasted long enough.

        Args:
            name: The window's name.
            steps: The steps it was meant to cover.
            covered: The steps it covered (its marks' steps).
            span_s: How long those steps lasted (s, the longest over the ranks).
            min_steps: The machine's `min_window_steps` now.
        """
        if span_s >= self.min_window_s or covered <= 0 or span_s <= 0:
            return None
        per_step = span_s / covered
        need = min(MAX_WINDOW_STEPS, math.ceil(self.min_window_s * MARGIN / per_step))
        floor = max(need, min_steps)
        lasted = (f"{covered} step{'s' if covered != 1 else ''} lasted {_ms(span_s)}, under "
                  f"{self.periods} energy-counter periods ({_ms(self.period_s)})")
        if steps >= floor:  # As long as windows get (or it lost steps at its edges).
            why = (f"windows are at most {MAX_WINDOW_STEPS} steps" if need >= MAX_WINDOW_STEPS
                   else f"it was meant to cover {steps}")
            return Verdict(min_steps, False, f"window {name}: {lasted}; kept as measured "
                           f"({why})")
        if steps < min_steps:  # Opened before the minimum, which an as short one raised.
            return Verdict(min_steps, True, f"window {name}: {lasted}; profiling it again "
                           f"with {min_steps} steps")
        return Verdict(need, True, f"windows of {lasted}: profiling {need} steps per limit "
                       f"(profile_steps is a minimum), {name} again")


def _ms(seconds: float) -> str:
    """A duration in ms, or in s from 10 s on."""
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"
