"""`WindowJoin`: a power-limit job's windows, joined with every rank's GPU marks (sans-I/O).

A window opened at rank 0's step `a` and closed at its step `b` covers, on every rank, the
interval between that rank's own `step_begin` marks of steps `a` and `b`. Steps are identified
by the (epoch, step) counters, so trainers that restart their step count every epoch never
match a stale mark of an earlier epoch. A mark carries the GPU's energy counter and power limit
at the event, stamped on the rank's own host: only differences of one GPU's marks are used,
never timestamps across hosts. Why the marks come apart from the events that pace the job:
docs/concepts/architecture.md, "Why a step boundary travels twice".

* `open` / `close` / `drop`: the job says where a window begins and ends (rank 0's steps);
  a closed window keeps the set of ranks whose marks of its two steps have not arrived
  (`missing`), so a mark costs O(open windows), not O(ranks);
* `add_mark`: a GPU's mark of a step; says whether it completed a window. Marks of one GPU
  come in step order (one agent, one connection, one subscription), in whatever order the
  ranks' marks and the events interleave: a rank's mark missing behind a later mark of that
  rank was lost (`lost`: its agent restarted, the bus was down, no energy reading). A rank's
  marks that go back (an earlier epoch, more than `MAX_LATE_STEPS` behind, or `RESTART_RUN`
  ascending ones in a row behind its highest) say its step count restarted: its marks of the
  old count after the new one are dropped, so they never measure the new count's windows (a
  closed window that had counted a dropped mark in waits for the rank's marks of its steps
  again: the new count's, or proof that they were lost, or the timeout);
* `lost` / `overdue`: closed windows whose marks can never come, proved by later marks, or
  not all in `mark_timeout_s` after the window closed (the job redoes them);
* `measure`: a complete window (every rank's two marks in): its first step settled to one
  every rank ran at the window's limit, and its last step to one before the next limit's
  command landed (a rank a little behind rank 0 may begin the window's closing step after it),
  the limits its marks show other than the window's
  (then the job redoes it), its time (the maximum over ranks) and energy (the sum over the
  job's GPUs), normalised to its intended steps when it covered another number.

Pure: no I/O, no clock (the job passes the time), no asyncio. It decides nothing about the
search: `PowerLimitJob` paces the state machine on rank 0's events and asks the join.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from zeus_agent.wire.node_columns import MarkLike

__all__ = [
    "MAX_LATE_STEPS",
    "MAX_MARKS_PER_RANK",
    "RESTART_RUN",
    "StepKey",
    "Window",
    "WindowJoin",
    "WindowMeasure",
]

MAX_MARKS_PER_RANK = 4096
"""Marks kept per rank: past twice this, the oldest half goes (but the edges of open windows)."""
MAX_LATE_STEPS = 100
"""A step further back than this in its epoch restarts the step count (re-anchors)."""
RESTART_RUN = 3
"""Steps in a row, ascending but behind the highest one, that say a step count restarted."""

StepKey = tuple[int, int]
"""(epoch, step): a step of the job, as counted by every rank's trainer."""
MarkValue = tuple[int, float, int | None]
"""A rank's mark of a step: (t_ns on its host, energy counter J, power limit W or None)."""


@dataclass
class Window:
    """One window of the job: the steps it covers and, once closed, the marks it waits for."""

    name: str
    begin_step: StepKey
    steps: int
    """The steps the window is meant to cover."""
    power_limit: int | None = None
    check_begin: bool = True
    """Whether the begin marks must show `power_limit` too (the limit was set steps before)."""
    end_step: StepKey | None = None
    missing: set[int] = field(default_factory=set)
    """Once closed: ranks whose marks of `begin_step` or `end_step` have not arrived."""
    closed_s: float = 0.0
    lost: list[int] = field(default_factory=list)
    """Once closed: ranks whose missing marks a later mark proved lost (redo at the next step)."""

    @property
    def complete(self) -> bool:
        """Whether it is closed and every rank's marks of its two steps are in."""
        return self.end_step is not None and not self.missing


@dataclass(frozen=True)
class WindowMeasure:
    """What a complete window's marks say (`WindowJoin.measure`).

    `ran_at`: the limits (W) its marks show other than the window's, sorted; when not empty
    the steps ran at another limit and `time_s`/`energy_j` are 0 (not measured).
    """

    name: str
    power_limit: int | None
    ran_at: tuple[int, ...] = ()
    time_s: float = 0.0
    """The maximum over ranks of the window's time (s), normalised to `steps`."""
    energy_j: float = 0.0
    """The sum over the job's GPUs of the window's energy (J), normalised to `steps`."""
    steps: int = 0
    """The steps the window was meant to cover."""
    covered: int = 0
    """The steps it covered."""
    normalised: bool = False
    """Whether `covered` differed from `steps` and time and energy were scaled to `steps`."""


class WindowJoin:
    """A job's windows and its ranks' marks, joined by (epoch, step).

    Args:
        ranks: The job's ranks (each drives one GPU), sorted.
        mark_timeout_s: How long a closed window waits for marks that nothing proved lost
            before it is `overdue`.
    """

    def __init__(self, ranks: Iterable[int], mark_timeout_s: float) -> None:
        self.ranks = sorted(ranks)
        self.mark_timeout_s = mark_timeout_s
        self._marks: dict[int, dict[StepKey, MarkValue]] = {r: {} for r in self.ranks}
        self._last_mark: dict[int, StepKey] = {}  # Each rank's latest step_begin mark.
        self._windows: dict[str, Window] = {}
        self._high_mark: dict[int, StepKey] = {}  # Each rank's highest mark of its count.
        self._marks_behind: dict[int, list[StepKey]] = {}  # Its marks behind that, in a row.

    # ------------------------------------------------------------------ windows
    def __contains__(self, name: str) -> bool:
        return name in self._windows

    def windows(self) -> list[Window]:
        """Every window, open or closed, in the order they opened (a snapshot)."""
        return list(self._windows.values())

    def open(self, name: str, begin_step: StepKey, steps: int, power_limit: int | None,
             check_begin: bool) -> None:
        """Window `name` begins at rank 0's step `begin_step`, meant to cover `steps` steps."""
        self._windows[name] = Window(name, begin_step=begin_step, steps=steps,
                                     power_limit=power_limit, check_begin=check_begin)

    def open_window(self) -> Window | None:
        """The window not yet closed, if any."""
        return next((w for w in self._windows.values() if w.end_step is None), None)

    def lengthen_open(self, steps: int) -> None:
        """The open window (if any) is meant to cover `steps` steps now (it was lengthened)."""
        window = self.open_window()
        if window is not None:
            window.steps = steps

    def restart_open(self, key: StepKey) -> Window | None:
        """The open window (if any) begins at step `key` instead, its begin marks checked."""
        window = self.open_window()
        if window is not None:
            window.begin_step, window.check_begin = key, True
        return window

    def close(self, name: str, end_step: StepKey, now_s: float) -> None:
        """Window `name` ends at rank 0's step `end_step` (at `now_s`): it waits for marks."""
        window = self._windows[name]
        window.end_step = end_step
        window.closed_s = now_s
        window.missing = {
            r for r in self.ranks
            if window.begin_step not in self._marks[r] or end_step not in self._marks[r]
        }
        window.lost = sorted(r for r in window.missing if self._marks_lost(window, r))

    def drop(self, name: str) -> None:
        """Forget window `name` (cancelled, redone or measured)."""
        del self._windows[name]

    def clear(self) -> None:
        """Forget every window (the job gave up)."""
        self._windows.clear()

    def lost(self) -> list[Window]:
        """Closed windows a later mark proved some of their marks lost."""
        return [w for w in self._windows.values() if w.lost]

    def overdue(self, now_s: float) -> list[Window]:
        """Closed windows still missing marks `mark_timeout_s` after they closed."""
        return [w for w in self._windows.values()
                if w.end_step is not None and w.missing
                and now_s - w.closed_s >= self.mark_timeout_s]

    def waiting_for(self) -> dict[str, list[int]]:
        """Closed windows still missing marks: window name -> ranks."""
        return {w.name: sorted(w.missing) for w in self._windows.values()
                if w.end_step is not None and w.missing}

    # ------------------------------------------------------------------ marks
    def kept(self, rank: int) -> int:
        """How many marks of `rank` are kept."""
        return len(self._marks[rank])

    def add_mark(self, rank: int, mark: MarkLike) -> bool:
        """A GPU's mark of `rank`; whether it completed a window (`step_begin` marks only)."""
        if rank not in self._marks or mark.kind != "step_begin":
            return False
        marks = self._marks[rank]
        key = (mark.epoch, mark.step)
        if self._mark_count_restarted(rank, key):
            # Marks after it are of the old count: they must not measure the new one's windows.
            dropped = {k for k in marks if k > key}
            for step in dropped:
                del marks[step]
            self._await_again(rank, dropped)
        marks[key] = (mark.t_ns, mark.energy_j, mark.power_limit_w)
        self._last_mark[rank] = key
        if len(marks) > 2 * MAX_MARKS_PER_RANK:  # Forget the oldest half, amortised O(1)...
            edges = {e for w in self._windows.values() for e in (w.begin_step, w.end_step)}
            for step in sorted(marks)[:MAX_MARKS_PER_RANK]:
                if step not in edges:  # ...but the edges of windows not yet measured.
                    del marks[step]
        completed = False
        for w in self._windows.values():
            if w.end_step is None or rank not in w.missing:
                continue
            if key in (w.begin_step, w.end_step) and w.begin_step in marks and w.end_step in marks:
                w.missing.discard(rank)
                completed = completed or not w.missing
            elif rank not in w.lost and self._marks_lost(w, rank):
                w.lost.append(rank)
        return completed

    def _await_again(self, rank: int, dropped: set[StepKey]) -> None:
        """Closed windows that counted in a mark of `rank` now `dropped` wait for it again.

        Those marks were of the rank's old count (a window closed on rank 0's steps of the new
        count may have counted them in while they were still kept): the window is measured
        from the new count's marks of its steps when they come, redone if later marks prove
        them lost or they are overdue, never measured without them.
        """
        for w in self._windows.values():
            if w.end_step is not None and dropped.intersection((w.begin_step, w.end_step)):
                w.missing.add(rank)

    def _marks_lost(self, w: Window, rank: int) -> bool:
        """Whether a mark of `rank` that closed window `w` needs can never come.

        Marks of one GPU arrive in step order (one agent, one connection, one subscription):
        one missing behind the rank's latest mark was lost.
        """
        latest = self._last_mark.get(rank)
        marks = self._marks[rank]
        return latest is not None and any(
            edge not in marks and edge < latest for edge in (w.begin_step, w.end_step)
            if edge is not None)

    def _mark_count_restarted(self, rank: int, key: StepKey) -> bool:
        """Whether `rank`'s mark of step `key` says its step count restarted.

        A GPU's marks come in step order: one of an earlier epoch or far behind the highest,
        or `RESTART_RUN` ascending ones in a row behind it, come from a restarted count (or the
        highest was bogus). A few marks handled in reverse order are not a restart.
        """
        high = self._high_mark.get(rank)
        if high is None or key >= high:
            self._high_mark[rank], self._marks_behind[rank] = key, []
            return False
        behind = self._marks_behind.setdefault(rank, [])
        if behind and key <= behind[-1]:
            behind.clear()
        behind.append(key)
        if (key[0] < high[0] or high[1] - key[1] > MAX_LATE_STEPS
                or len(behind) >= RESTART_RUN):
            self._high_mark[rank], self._marks_behind[rank] = key, []
            return True
        return False

    # ------------------------------------------------------------------ measuring
    def measure(self, w: Window) -> WindowMeasure:
        """Take complete window `w` out of the join and say what its marks measured.

        Its first and last steps are settled first (`_settled_begin`, `_settled_end`); the
        limits checked are those of its marks at both steps (only the end's when the limit was
        set on its first step, as a mark of that step may predate the command).
        """
        del self._windows[w.name]
        assert w.end_step is not None
        if w.check_begin:
            w.begin_step = self._settled_begin(w)
        w.end_step = self._settled_end(w)
        edges = (w.begin_step, w.end_step) if w.check_begin else (w.end_step,)
        limits = (self._marks[r][e][2] for r in self.ranks for e in edges)
        ran_at = {x for x in limits if x is not None and x != w.power_limit}
        if ran_at:
            return WindowMeasure(w.name, w.power_limit, ran_at=tuple(sorted(ran_at)),
                                 steps=w.steps)
        time_s, energy_j = 0.0, 0.0
        for r in self.ranks:
            marks = self._marks[r]
            (t0_ns, e0_j, _), (t1_ns, e1_j, _) = marks[w.begin_step], marks[w.end_step]
            time_s = max(time_s, (t1_ns - t0_ns) / 1e9)
            energy_j += e1_j - e0_j
        covered = w.end_step[1] - w.begin_step[1]
        normalised = covered != w.steps and covered > 0 and w.steps > 0
        if normalised:
            time_s, energy_j = time_s * w.steps / covered, energy_j * w.steps / covered
        return WindowMeasure(w.name, w.power_limit, time_s=time_s, energy_j=energy_j,
                             steps=w.steps, covered=covered, normalised=normalised)

    def _settled_begin(self, w: Window) -> StepKey:
        """The window's first step at which every rank's GPU ran at the window's limit.

        Under load the limit command can land just after the window's first step began on
        some rank (its mark then shows the previous limit): the window starts at the first
        step all marks agree on instead of being redone, if at least half its steps (and 2)
        are left (it is then normalised to its intended steps).
        """
        assert w.end_step is not None
        (epoch, first), (end_epoch, end) = w.begin_step, w.end_step
        if self._at_limit(w, w.begin_step) or epoch != end_epoch:
            return w.begin_step
        for later in range(first + 1, end):
            if end - later < max(2, (w.steps + 1) // 2):
                break
            if self._at_limit(w, (epoch, later)):
                return (epoch, later)
        return w.begin_step

    def _settled_end(self, w: Window) -> StepKey:
        """The window's last step at which every rank's GPU still ran at the window's limit.

        The next limit is commanded when rank 0's closing step begins: a rank a little behind
        (data-parallel ranks on a loaded host) may begin that step after the command landed, and
        its mark then shows the next limit. The window ends at the last step all marks agree on
        instead of being redone, if at least half its steps (and 2) are left (it is then
        normalised to its intended steps).
        """
        assert w.end_step is not None
        (epoch, first), (end_epoch, end) = w.begin_step, w.end_step
        if self._at_limit(w, w.end_step) or epoch != end_epoch:
            return w.end_step
        for earlier in range(end - 1, first, -1):
            if earlier - first < max(2, (w.steps + 1) // 2):
                break
            if self._at_limit(w, (epoch, earlier)):
                return (epoch, earlier)
        return w.end_step

    def _at_limit(self, w: Window, step: StepKey) -> bool:
        """Whether every rank's mark of `step` is in and shows the window's limit (or none)."""
        return all(step in self._marks[r] and self._marks[r][step][2] in (None, w.power_limit)
                   for r in self.ranks)
