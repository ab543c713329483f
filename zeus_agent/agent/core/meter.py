"""Measurement of a rank's steps, epochs and instructions, and nested profiling windows.

Pieces:

* `Interval`: a closed step, epoch or instruction: its counters and `[t0_ns, t1_ns]`. The shell
  turns it into time and energy with `EnergyRing.energy_between(t0_ns, t1_ns)`.
* `Gap`, `GapReason`: an anomaly in the trainer's event stream (counter jump, end without begin,
  begin whose end never came, duplicate, name mismatch), with a human-readable message.
* `RankMeter`: fed the trainer events of the rank bound to this GPU, with the rank's running
  counters; returns `Interval`s and `Gap`s, never raises for trainer mistakes.
* `WindowStack`: push/pop profiling windows (Zeus 0.16's `push_window`/`pop_window`), optionally
  named. Dependency-free so the trainer process can use it too.

Invariants of `RankMeter` (everything that pairs events lives in this file):

1. Begins and ends are paired by their counters, never by arrival order: a step by
   `(epoch, step)`, an epoch by `epoch`, an instruction by `(epoch, step, index)` where
   `(epoch, step)` is the newest step begun when the instruction event arrives (instruction
   events carry only their index). A dropped or reordered datagram therefore never shifts a count.
2. Both ends are required. An end that arrives before its begin (reordered) is held; the begin
   then closes it at once and the interval is returned from the begin call.
3. Unmatched ends and begins are pending for a bounded reordering window: a pending entry is given
   up once `reorder_window + 1` newer counters (of its kind) have been seen; it is then reported as
   a `Gap` ("never ended" is the begin-while-one-is-open anomaly, "without a begin" the
   end-without-begin one). With `reorder_window=0` a begin while another is open reports the open
   one at once. An event older than every counter still tracked is reported as late.
4. Counters that jump forward by more than one within the same parent (steps within an epoch,
   instructions within a step, epochs) report a `Gap` naming how many are missing. Step counters
   may restart per epoch or run globally: a new epoch resets the step check.
5. A second begin or end of the same counter is a duplicate `Gap` and is otherwise ignored (the
   last 256 counters per kind are remembered; the partner of a given-up entry is "late"); an
   interval whose end time precedes its begin time, or an instruction whose end name differs from
   its begin name, is reported as a `Gap` and not returned as an `Interval`.
6. Steps delimited by their begins only, as Zeus's callback API sends them
   (`GlobalPowerLimitOptimizer.on_step_begin`, `HFGlobalPowerLimitOptimizer`: no step end), are
   learnt, not reported: while a rank has never sent a step end, a step given up under rule 3 is
   no `Gap` but closed where the next step (its counter + 1) began, or where its epoch ended
   (its last step); when neither came, it is dropped silently (a lost begin is a counter jump).
   Once a step was closed so, an epoch end closes the epoch's open steps at once.
   Once the rank sends one step end, rule 3 holds again: a step end it skipped is reported.
   Epochs delimited by their ends only (Zeus's `on_epoch_end`, no `on_epoch_begin`) likewise:
   while a rank has never sent an epoch begin, an epoch end given up is closed from the previous
   epoch's end (the first one is dropped), never reported.

Invariants of `WindowStack`: windows close in reverse order of opening (a stack); an invalid pop
raises before changing anything.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

__all__ = [
    "Gap",
    "GapReason",
    "Interval",
    "IntervalKind",
    "MeterRecord",
    "RankMeter",
    "WindowStack",
]

IntervalKind = Literal["step", "epoch", "instruction"]
"""What an interval or gap is about."""

_RETIRED_MEMORY = 256
"""How many closed or abandoned counters per kind are remembered to spot duplicates."""


@dataclass(frozen=True, slots=True)
class Interval:
    """A closed step, epoch or instruction of one rank.

    Attributes:
        kind: "step", "epoch" or "instruction".
        name: Instruction name (e.g. "forward"); None for steps and epochs.
        step: Step counter (of the newest step begun, for instructions); None if unknown.
        epoch: Epoch counter; None if unknown (an instruction before any step).
        index: Instruction index; None for steps and epochs.
        t0_ns: Begin time (monotonic ns of the rank's host).
        t1_ns: End time (monotonic ns), `>= t0_ns`.
    """

    kind: IntervalKind
    name: str | None
    step: int | None
    epoch: int | None
    index: int | None
    t0_ns: int
    t1_ns: int

    @property
    def duration_s(self) -> float:
        """Length of the interval (s)."""
        return (self.t1_ns - self.t0_ns) / 1e9


class GapReason(StrEnum):
    """Why a `Gap` was reported."""

    COUNTER_JUMP = "counter_jump"
    """A counter advanced by more than one: events were lost."""
    NEVER_ENDED = "never_ended"
    """A begin's end did not arrive within the reordering window (a begin while one is open)."""
    NO_BEGIN = "no_begin"
    """An end's begin did not arrive within the reordering window."""
    LATE = "late"
    """An event older than every counter still tracked; too late to pair."""
    DUPLICATE = "duplicate"
    """A second begin or end of the same counter."""
    NAME_MISMATCH = "name_mismatch"
    """An instruction ended under another name than it began with."""
    END_BEFORE_BEGIN = "end_before_begin"
    """The end's time precedes the begin's time."""


@dataclass(frozen=True, slots=True)
class Gap:
    """An anomaly in a rank's event stream.

    Attributes:
        kind: "step", "epoch" or "instruction".
        reason: Machine-readable cause.
        message: Human-readable description naming the counters and times.
        t_ns: Time of the event that revealed the anomaly (monotonic ns).
    """

    kind: IntervalKind
    reason: GapReason
    message: str
    t_ns: int


MeterRecord = Interval | Gap
"""What `RankMeter` methods return."""


@dataclass(frozen=True, slots=True)
class _Mark:
    """One begin or end event, as recorded while waiting for its partner."""

    name: str | None
    epoch: int | None
    step: int | None
    index: int | None
    t_ns: int


def _label(kind: IntervalKind, mark: _Mark) -> str:
    if kind == "epoch":
        return f"epoch {mark.epoch}"
    if kind == "step":
        return f"step {mark.step} of epoch {mark.epoch}"
    where = "before any step" if mark.step is None else f"of step {mark.step}"
    return f"instruction {mark.index} ({mark.name!r}) {where}"


def _sentence(message: str) -> str:
    return message[0].upper() + message[1:] + "."


_Key = tuple[int, ...]
_Settle = Callable[[_Key, _Mark], list[MeterRecord] | None]
"""Decides a given-up entry (key, mark): the records instead of its `Gap`, or None to report it."""


def _remember(memory: OrderedDict[_Key, int], key: _Key, t_ns: int) -> None:
    """Keep the first time seen of `key`, and at most `_RETIRED_MEMORY` keys."""
    if key not in memory:
        memory[key] = t_ns
        if len(memory) > _RETIRED_MEMORY:
            memory.popitem(last=False)


class _Pairer:
    """Pairs begins and ends of one kind by key, with a bounded reordering window.

    `settle_open` and `settle_early` may decide a begin (an end) given up without its partner
    instead of the "never ended" ("without a begin") `Gap` (rule 6).
    """

    def __init__(
        self,
        kind: IntervalKind,
        window: int,
        settle_open: _Settle | None = None,
        settle_early: _Settle | None = None,
    ) -> None:
        self.kind = kind
        self.window = window
        self.settle_open = settle_open
        self.settle_early = settle_early
        self.open: dict[_Key, _Mark] = {}  # begins waiting for their end
        self.early: dict[_Key, _Mark] = {}  # ends waiting for their begin
        self.top: list[_Key] = []  # the `window + 1` largest keys seen, ascending
        self.retired: OrderedDict[_Key, bool] = OrderedDict()  # key -> was closed (not given up)

    def take_open(self, epoch: int) -> list[tuple[_Key, _Mark]]:
        """The begins of `epoch` still waiting for their end, in order: taken, never closed."""
        taken = []
        for key in sorted(k for k in self.open if k[0] == epoch):
            taken.append((key, self.open.pop(key)))
            self.retire(key, closed=False)
        return taken

    def begin(self, key: _Key, mark: _Mark) -> list[MeterRecord]:
        if key in self.open or self.retired.get(key):
            return [self._gap(GapReason.DUPLICATE, f"duplicate begin of {self._l(mark)}", mark)]
        if key in self.retired or self._too_old(key):
            return [
                self._gap(
                    GapReason.LATE,
                    f"begin of {self._l(mark)} at t={mark.t_ns} ns arrived after its end was "
                    "given up or outside the reordering window; not measured",
                    mark,
                )
            ]
        end = self.early.pop(key, None)
        if end is not None:
            return self._close(key, mark, end)
        self.open[key] = mark
        return self._see(key, mark.t_ns)

    def end(self, key: _Key, mark: _Mark) -> list[MeterRecord]:
        begin = self.open.pop(key, None)
        if begin is not None:
            return self._close(key, begin, mark)
        if key in self.early or self.retired.get(key):
            return [self._gap(GapReason.DUPLICATE, f"duplicate end of {self._l(mark)}", mark)]
        if key in self.retired or self._too_old(key):
            return [
                self._gap(
                    GapReason.LATE,
                    f"end of {self._l(mark)} at t={mark.t_ns} ns arrived after its begin was "
                    "given up or outside the reordering window; not measured",
                    mark,
                )
            ]
        self.early[key] = mark
        return self._see(key, mark.t_ns)

    # -- helpers

    def _l(self, mark: _Mark) -> str:
        return _label(self.kind, mark)

    def _gap(self, reason: GapReason, message: str, mark: _Mark) -> Gap:
        return Gap(self.kind, reason, _sentence(message), mark.t_ns)

    def _too_old(self, key: _Key) -> bool:
        return len(self.top) > self.window and key < self.top[0]

    def retire(self, key: _Key, closed: bool) -> None:
        self.retired[key] = closed
        if len(self.retired) > _RETIRED_MEMORY:
            self.retired.popitem(last=False)

    def _close(self, key: _Key, begin: _Mark, end: _Mark) -> list[MeterRecord]:
        self.retire(key, closed=True)
        out: list[MeterRecord] = []
        if end.t_ns < begin.t_ns:
            out.append(
                self._gap(
                    GapReason.END_BEFORE_BEGIN,
                    f"{self._l(begin)} ended at t={end.t_ns} ns, before it began at "
                    f"t={begin.t_ns} ns; not measured",
                    end,
                )
            )
        elif begin.name != end.name:
            out.append(
                self._gap(
                    GapReason.NAME_MISMATCH,
                    f"{self._l(begin)} ended as {end.name!r}; not measured",
                    end,
                )
            )
        else:
            out.append(
                Interval(
                    self.kind,
                    begin.name,
                    begin.step,
                    begin.epoch,
                    begin.index,
                    begin.t_ns,
                    end.t_ns,
                )
            )
        return out

    def _see(self, key: _Key, t_ns: int) -> list[MeterRecord]:
        """Track `key` among the newest keys and give up pending entries that fell out."""
        if key in self.top:
            return []
        bisect.insort(self.top, key)
        if len(self.top) > self.window + 1:
            del self.top[0]
        if len(self.top) <= self.window:
            return []
        floor = self.top[0]
        out: list[MeterRecord] = []
        for k in sorted(k for k in self.open if k < floor):
            mark = self.open.pop(k)
            self.retire(k, closed=False)
            settled = self.settle_open(k, mark) if self.settle_open is not None else None
            if settled is not None:
                out.extend(settled)
                continue
            out.append(
                Gap(
                    self.kind,
                    GapReason.NEVER_ENDED,
                    _sentence(
                        f"{_label(self.kind, mark)} began at t={mark.t_ns} ns but its end never "
                        "arrived (newer ones began); not measured"
                    ),
                    t_ns,
                )
            )
        for k in sorted(k for k in self.early if k < floor):
            mark = self.early.pop(k)
            self.retire(k, closed=False)
            settled = self.settle_early(k, mark) if self.settle_early is not None else None
            if settled is not None:
                out.extend(settled)
                continue
            out.append(
                Gap(
                    self.kind,
                    GapReason.NO_BEGIN,
                    _sentence(
                        f"{_label(self.kind, mark)} ended at t={mark.t_ns} ns without a begin; "
                        "not measured"
                    ),
                    t_ns,
                )
            )
        return out


class RankMeter:
    """Turns one rank's trainer events into closed intervals and gap reports.

    Every method returns a list of `Interval`s and `Gap`s in the order they were decided (often
    empty); see the module docstring for the pairing rules.
    """

    def __init__(self, reorder_window: int = 1) -> None:
        """Create a meter.

        Args:
            reorder_window: How many newer counters of a kind may be seen before a pending
                begin or end is given up and reported as a gap (>= 0).

        Raises:
            ValueError: A negative window.
        """
        if isinstance(reorder_window, bool) or not isinstance(reorder_window, int):
            raise ValueError(f"reorder_window must be an integer >= 0, got {reorder_window!r}.")
        if reorder_window < 0:
            raise ValueError(f"reorder_window must be >= 0, got {reorder_window}.")
        self._steps = _Pairer("step", reorder_window, settle_open=self._settle_step)
        self._epochs = _Pairer("epoch", reorder_window, settle_early=self._settle_epoch)
        self._instructions = _Pairer("instruction", reorder_window)
        self._step_ends_seen = False  # rule 6: False while steps are delimited by begins only
        self._steps_settled = False  # rule 6: a step was closed at the next begin
        self._epoch_begins_seen = False  # rule 6: False while epochs are delimited by ends only
        self._step_begins: OrderedDict[_Key, int] = OrderedDict()  # (epoch, step) -> t_ns
        self._epoch_ends: OrderedDict[_Key, int] = OrderedDict()  # (epoch,) -> t_ns
        self._newest_step: tuple[int, int] | None = None  # newest (epoch, step) seen
        self._context: tuple[int, int] | None = None  # newest (epoch, step) begun
        self._newest_epoch: int | None = None
        self._newest_index: tuple[tuple[int, int] | None, int] | None = None  # (context, index)

    @property
    def current_step(self) -> tuple[int, int] | None:
        """`(epoch, step)` of the newest step begun (instructions belong to it), or None."""
        return self._context

    @property
    def steps_end_at_next_begin(self) -> bool:
        """Whether this rank's steps are taken as delimited by their begins (no end seen yet)."""
        return not self._step_ends_seen

    def _settle_step(self, key: _Key, mark: _Mark) -> list[MeterRecord] | None:
        """A step given up without its end: closed at the next begin while no end was ever seen.

        The next step is counter + 1 of the same epoch; the last step of an epoch ends with it.
        """
        if self._step_ends_seen:
            return None  # A rank that ends its steps skipped an end: reported.
        self._steps_settled = True
        epoch, step = key
        t1_ns = self._step_begins.get((epoch, step + 1))
        if t1_ns is None:
            t1_ns = self._epoch_ends.get((epoch,))
        if t1_ns is None or t1_ns < mark.t_ns:
            return []  # Its successor was lost (a counter jump says so) or is out of order.
        return [Interval("step", None, step, epoch, None, mark.t_ns, t1_ns)]

    def _settle_epoch(self, key: _Key, mark: _Mark) -> list[MeterRecord] | None:
        """An epoch end given up without its begin: from the previous end, while no begin seen."""
        if self._epoch_begins_seen:
            return None
        (epoch,) = key
        t0_ns = self._epoch_ends.get((epoch - 1,))
        if t0_ns is None or t0_ns > mark.t_ns:
            return []
        return [Interval("epoch", None, None, epoch, None, t0_ns, mark.t_ns)]

    # ----------------------------------------------------------------------------- steps

    def step_begin(self, step: int, epoch: int, t_ns: int) -> list[MeterRecord]:
        """Record the begin of `step` of `epoch` at `t_ns`."""
        mark = _Mark(None, epoch, step, None, t_ns)
        out = self._step_counter(mark)
        if self._context is None or (epoch, step) > self._context:
            self._context = (epoch, step)
        _remember(self._step_begins, (epoch, step), t_ns)
        return out + self._steps.begin((epoch, step), mark)

    def step_end(self, step: int, epoch: int, t_ns: int) -> list[MeterRecord]:
        """Record the end of `step` of `epoch` at `t_ns`."""
        self._step_ends_seen = True
        mark = _Mark(None, epoch, step, None, t_ns)
        out = self._step_counter(mark)
        return out + self._steps.end((epoch, step), mark)

    def _step_counter(self, mark: _Mark) -> list[MeterRecord]:
        assert mark.epoch is not None and mark.step is not None
        key = (mark.epoch, mark.step)
        last = self._newest_step
        if last is not None and key <= last:
            return []
        self._newest_step = key
        if last is not None and key[0] == last[0] and key[1] > last[1] + 1:
            missing = key[1] - last[1] - 1
            return [
                Gap(
                    "step",
                    GapReason.COUNTER_JUMP,
                    f"Step counter jumped from {last[1]} to {key[1]} in epoch {key[0]}: "
                    f"{missing} step(s) missing.",
                    mark.t_ns,
                )
            ]
        return []

    # ----------------------------------------------------------------------------- epochs

    def epoch_begin(self, epoch: int, t_ns: int) -> list[MeterRecord]:
        """Record the begin of `epoch` at `t_ns`."""
        self._epoch_begins_seen = True
        mark = _Mark(None, epoch, None, None, t_ns)
        return self._epoch_counter(mark) + self._epochs.begin((epoch,), mark)

    def epoch_end(self, epoch: int, t_ns: int) -> list[MeterRecord]:
        """Record the end of `epoch` at `t_ns`."""
        mark = _Mark(None, epoch, None, None, t_ns)
        _remember(self._epoch_ends, (epoch,), t_ns)
        out = self._epoch_counter(mark) + self._epochs.end((epoch,), mark)
        if self._steps_settled and not self._step_ends_seen:
            # Steps delimited by their begins (learnt): the epoch's last steps end now, not
            # when the next epoch's steps begin (the run's last ones would never be measured).
            for key, begin in self._steps.take_open(epoch):
                out += self._settle_step(key, begin) or []
        return out

    def _epoch_counter(self, mark: _Mark) -> list[MeterRecord]:
        assert mark.epoch is not None
        last = self._newest_epoch
        if last is not None and mark.epoch <= last:
            return []
        self._newest_epoch = mark.epoch
        if last is not None and mark.epoch > last + 1:
            return [
                Gap(
                    "epoch",
                    GapReason.COUNTER_JUMP,
                    f"Epoch counter jumped from {last} to {mark.epoch}: "
                    f"{mark.epoch - last - 1} epoch(s) missing.",
                    mark.t_ns,
                )
            ]
        return []

    # ----------------------------------------------------------------------------- instructions

    def instruction_begin(self, name: str, index: int, t_ns: int) -> list[MeterRecord]:
        """Record the begin of instruction `index` named `name` at `t_ns`."""
        mark = self._instruction_mark(name, index, t_ns)
        out = self._instruction_counter(mark)
        return out + self._instructions.begin(self._instruction_key(mark), mark)

    def instruction_end(self, name: str, index: int, t_ns: int) -> list[MeterRecord]:
        """Record the end of instruction `index` named `name` at `t_ns`."""
        mark = self._instruction_mark(name, index, t_ns)
        out = self._instruction_counter(mark)
        return out + self._instructions.end(self._instruction_key(mark), mark)

    def _instruction_mark(self, name: str, index: int, t_ns: int) -> _Mark:
        ctx = self._context
        if ctx is None:
            return _Mark(name, None, None, index, t_ns)
        return _Mark(name, ctx[0], ctx[1], index, t_ns)

    @staticmethod
    def _instruction_key(mark: _Mark) -> _Key:
        assert mark.index is not None
        if mark.epoch is None or mark.step is None:
            return (-1, -1, mark.index)
        return (mark.epoch, mark.step, mark.index)

    def _instruction_counter(self, mark: _Mark) -> list[MeterRecord]:
        assert mark.index is not None
        ctx = self._context
        last = self._newest_index
        if last is not None and last[0] == ctx and mark.index <= last[1]:
            return []
        self._newest_index = (ctx, mark.index)
        if last is not None and last[0] == ctx and mark.index > last[1] + 1:
            where = "before any step" if ctx is None else f"in step {ctx[1]} of epoch {ctx[0]}"
            return [
                Gap(
                    "instruction",
                    GapReason.COUNTER_JUMP,
                    f"Instruction index jumped from {last[1]} to {mark.index} {where}: "
                    f"{mark.index - last[1] - 1} instruction(s) missing.",
                    mark.t_ns,
                )
            ]
        return []


class WindowStack:
    """Nested profiling windows of one trainer (Zeus 0.16's `push_window`/`pop_window`).

    Windows may be named; `pop(None, t)` closes the innermost window whatever its name.
    """

    def __init__(self) -> None:
        """Create an empty stack."""
        self._stack: list[tuple[str | None, int]] = []

    def push(self, name: str | None, t_ns: int) -> None:
        """Open a window named `name` (or unnamed) at `t_ns` (monotonic ns)."""
        self._stack.append((name, t_ns))

    def pop(self, name: str | None, t_ns: int) -> tuple[int, int]:
        """Close the innermost window at `t_ns`.

        Args:
            name: Name the innermost window must have, or None to close it whatever its name.
            t_ns: Time the window closes (monotonic ns).

        Returns:
            `(t0_ns, t1_ns)` of the closed window.

        Raises:
            RuntimeError: No window is open.
            ValueError: The innermost window has another name, or `t_ns` precedes its opening.
                The stack is left unchanged.
        """
        if not self._stack:
            raise RuntimeError("No profiling window active. Consider calling `push_window` first.")
        top_name, t0_ns = self._stack[-1]
        if name is not None and name != top_name:
            raise ValueError(
                f"Cannot pop profiling window {name!r}: the innermost open window is "
                f"{top_name!r}. Pop windows in the reverse order they were pushed."
            )
        if t_ns < t0_ns:
            raise ValueError(
                f"Profiling window {top_name!r} cannot close at t={t_ns} ns, before it opened at "
                f"t={t0_ns} ns."
            )
        self._stack.pop()
        return t0_ns, t_ns

    def peek(self) -> tuple[str | None, int] | None:
        """Return `(name, t0_ns)` of the innermost open window, or None."""
        return self._stack[-1] if self._stack else None

    def names(self) -> list[str | None]:
        """Return the names of the open windows, outermost first."""
        return [name for name, _ in self._stack]

    def clear(self) -> None:
        """Forget every open window (e.g. the trainer went away)."""
        self._stack.clear()

    def __len__(self) -> int:
        return len(self._stack)
