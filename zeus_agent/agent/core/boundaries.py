"""`BoundaryForecast`: when a rank's next clock changes are due, so counter reads avoid them.

On a real GPU an energy-counter read holds the driver for milliseconds (3 ms median, 24 ms p99
on an H200), and a clock change issued meanwhile waits for it. A rank running a frequency
schedule repeats the same iteration: the instructions that changed the clock in the last
iteration, at the same offsets from its step's begin, will change it again in this one and the
next. The forecast replays those offsets from the current step's begin (and one iteration on);
the counter reader (`ReadPolicy.plan_read`) then starts no read whose span holds one.

Pure: times in, times out (monotonic ns, as the trainer stamps its events).
"""

from __future__ import annotations

__all__ = ["MAX_BOUNDARIES", "BoundaryForecast"]

MAX_BOUNDARIES = 4096
"""Most clock changes remembered per iteration (a longer schedule is forecast in part)."""
GUARD_NS = 5_000_000
"""How long after its forecast instant a change may still be issued: the trainer stamps an
instruction's begin, its event reaches the agent and the agent issues the change a millisecond
or so later, and iterations jitter. A read must not start in that span either."""


class BoundaryForecast:
    """Forecast clock changes from the last complete iteration's offsets."""

    def __init__(self, max_boundaries: int = MAX_BOUNDARIES, guard_ns: int = GUARD_NS) -> None:
        """Create an empty forecast (nothing is due until one iteration has been seen)."""
        self._max = max_boundaries
        self._guard = guard_ns
        self.lead_ns = 0
        """How long before its instant a clock raise may be issued (`RaiseAhead`): a read must
        not start then either."""
        self._step_t: int | None = None
        self._period: int | None = None
        self._current: list[int] = []
        self._offsets: list[int] = []

    def raise_lead(self, lead_ns: int) -> None:
        """Clock raises may be issued `lead_ns` before their instant (`RaiseAhead`)."""
        self.lead_ns = lead_ns

    def clear(self) -> None:
        """Forget everything (a schedule installed, cleared or restored)."""
        self._step_t = self._period = None
        self._current = []
        self._offsets = []

    def on_step_begin(self, t_ns: int) -> None:
        """A step (iteration) began at `t_ns`: the previous one is complete."""
        if self._step_t is not None and t_ns > self._step_t:
            self._period = t_ns - self._step_t
            self._offsets = self._current
        self._current = []
        self._step_t = t_ns

    def on_clock_change(self, t_ns: int) -> None:
        """An instruction that changes the clock began at `t_ns` (in the current step)."""
        if self._step_t is not None and t_ns >= self._step_t and len(self._current) < self._max:
            self._current.append(t_ns - self._step_t)

    def due(self, now_ns: int, horizon_ns: int) -> list[int]:
        """The forecast clock changes in `[now_ns, now_ns + horizon_ns]`, in time order.

        Each change is given at its instant and `guard_ns` later (and `lead_ns` before, when
        raises are issued ahead): a read planned around them (`ReadPolicy.plan_read` keeps a
        read's span clear of each) neither starts shortly before the change nor just after
        its forecast instant, while it is being issued.
        """
        if self._step_t is None or not self._offsets:
            return []
        end = now_ns + horizon_ns
        bases = [self._step_t]
        if self._period:
            # Iterations may have gone by without a step event seen yet (a long horizon, or
            # events in flight): replay from the latest iteration that may still be running.
            behind = max(0, (now_ns - self._step_t) // self._period)
            bases = [self._step_t + k * self._period for k in (behind, behind + 1)]
        guards = tuple(dict.fromkeys((-self.lead_ns, 0, self._guard)))
        return sorted(t for base in bases for o in self._offsets for g in guards
                      if now_ns <= (t := base + o + g) <= end)
