"""`LimitHistory`: which power limit one GPU was at, at a given time (its recent limit changes).

The agent measures a trainer event some time after the event happened (the event is queued,
then an energy read in a thread brackets it), and a power-limit command may be applied in
between: typically the coordinator's command for the next profiling window, sent as soon as
rank 0's `step_begin` closed the current one, reaching another rank's agent before that rank's
own `step_begin` of the same step is measured. A step mark stamped with the limit current at
measuring time would then say the step ran at the next limit. The agent records every change
here and stamps each mark with `at(event.t_ns)`.

Times are monotonic nanoseconds of the agent's host, the clock trainers stamp events with
(`zeus_agent.emit`). No clock is read here.

Invariants:

1. Changes are kept in time order; a change recorded with a time before the newest one (two
   overlapping commands) is taken as happening at the newest one's time.
2. A "change" to the current limit is not recorded (repeated reads of the same limit never
   push real changes out).
3. At most `capacity` changes are kept; `at` a time before the oldest kept one is None
   (unknown), as is `at` any time before the first change.
"""

from __future__ import annotations

from collections import deque

DEFAULT_CAPACITY = 64
"""Changes kept: a limit changes once per profiling window, events are measured within a second."""


class LimitHistory:
    """The recent power-limit changes of one GPU, as (t_ns, limit W) in time order."""

    __slots__ = ("_changes",)

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, not {capacity}")
        self._changes: deque[tuple[int, int | None]] = deque(maxlen=capacity)

    @property
    def current(self) -> int | None:
        """The limit now in force (the newest change), None before any."""
        return self._changes[-1][1] if self._changes else None

    def record(self, t_ns: int, limit_w: int | None) -> None:
        """The GPU is at `limit_w` from `t_ns` on (None: unknown from then on)."""
        if self._changes:
            last_t, last_limit = self._changes[-1]
            if limit_w == last_limit:
                return
            t_ns = max(t_ns, last_t)
        self._changes.append((t_ns, limit_w))

    def at(self, t_ns: int) -> int | None:
        """The limit in force at `t_ns`: the newest change at or before it (None if unknown)."""
        for t, limit in reversed(self._changes):  # Events are recent: O(1) in practice.
            if t <= t_ns:
                return limit
        return None

    def __len__(self) -> int:
        return len(self._changes)
