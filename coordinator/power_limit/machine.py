"""The sans-I/O power-limit state machine: step events in, effects out.

Invariants (h11 style, everything that affects the machine lives here):

* Pure. No asyncio, nats, pynvml, files or clocks. The shell calls `start()`, `on_step_begin()`,
  `on_epoch_end()` and `record(...)`, executes the returned effects in order, and feeds window
  measurements back through `record`.
* Transitions are data: `TRANSITIONS` maps (phase, state, input) to the method that handles the
  input, as h11's tables map (role, state) to events. The phase is `new` before `start()` and
  `started` after it. An input the table does not list for the machine's phase and state raises
  `InvalidTransitionError` naming the state and the input. Every public input dispatches
  through the table, which reads (`tests/core/test_power_limit_transitions.py` holds the two
  to each other):

      phase    state      input          handler
      new      Ready      start          _start_profiling
      new      Ready      lengthen       _lengthen
      new      Ready      cap            _capped
      new      Done       start          _start_done
      new      Done       choose         _choose
      new      Done       lengthen       _lengthen
      new      Done       cap            _capped
      started  Ready      on_step_begin  _step_ready
      started  Ready      on_epoch_end   _ignore
      started  Ready      record         _record_ready
      started  Ready      discard        _discard_ready
      started  Ready      redo           _redo_ready
      started  Ready      lengthen       _lengthen
      started  Ready      cap            _capped
      started  Warmup     on_step_begin  _step_warmup
      started  Warmup     on_epoch_end   _interrupt
      started  Warmup     record         _record
      started  Warmup     discard        _discard
      started  Warmup     redo           _redo
      started  Warmup     lengthen       _lengthen_warmup
      started  Warmup     cap            _capped
      started  Profiling  on_step_begin  _step_profiling
      started  Profiling  on_epoch_end   _interrupt_window
      started  Profiling  record         _record
      started  Profiling  discard        _discard
      started  Profiling  redo           _redo
      started  Profiling  lengthen       _lengthen_window
      started  Profiling  cap            _capped
      started  Done       on_step_begin  _ignore
      started  Done       on_epoch_end   _ignore
      started  Done       choose         _choose
      started  Done       lengthen       _lengthen
      started  Done       cap            _capped

  No window is pending in `Done`, so `record`, `discard` and `redo` are refused there. `Ready`
  with `next_power_limit=None` waits for a pending window: its `_*_ready` handlers move on once
  that window is recorded, discarded or queued to be redone.
* Seed semantics (Zeus `GlobalPowerLimitOptimizer`): limits `range(max, min - 1, -pl_step)` (W),
  highest first, so an unaligned minimum is never tried; `wait_steps + 1` `on_step_begin` calls in
  `Ready`, then per limit `warmup_steps` calls of warm-up and `profile_steps` calls of profiling;
  the window closes on the call after the last profiling step. An epoch end during warm-up or
  profiling cancels the window, goes back to the maximum and redoes that limit's warm-up next
  epoch (`wait_steps` applies once). `SetPowerLimit` is emitted only when the target differs from
  the current limit. The optimum is computed when the last needed measurement is recorded.
* Lost measurements: a closed window whose measurement can never come (its marks were lost with
  an agent that restarted) is `redo`ne: its limit is profiled again (warm-up included) before the
  search's next probe, up to `MAX_REDOS` times, then left out like a `discard`ed window. A redo
  does not count as a new window for the search.
* Windows too short for the energy counter (`coordinator.power_limit.window_length`): `lengthen`
  makes every window from then on cover at least `min_window_steps` steps (the open one is
  lengthened in place), and a closed window shorter than that is redone without counting toward
  `MAX_REDOS` (`redo(..., counted=False)`). Measurements are still scaled to `profile_steps`.
* Deviations from Zeus 0.16: `warmup_steps=0` works (the window opens on the call that sets the
  limit); a loaded profile with a limit outside [min, max] is refused; impossible input raises
  `InvalidTransitionError` naming the state and the input.
* Delayed measurements: a window's measurement may be recorded any time after its `EndWindow`.
  With the exhaustive search the machine moves on to the next limit at once (the next limit does
  not depend on the result) and only `Done` waits for every record. With a search that needs the
  results (`Adaptive`) the machine enters `Ready(next_power_limit=None)` until the record arrives;
  steps meanwhile count toward nothing and run at the maximum limit (the first of them sets it:
  nothing is measured, so the GPUs do not stay at the last, often lowest, limit tried; Zeus's
  GPUs are never held at a profiled limit between windows either); the record then sets the next
  limit and starts its warm-up (or the window, if no warm-up is needed), or finishes.
* Under a power budget's cap (`cap`), only the limits at or under it are profiled; the rest
  wait for the lift (`coordinator.power_limit.capped`).

Effects, states and errors: `states`, `errors` (re-exported); `TRANSITIONS`: the table above.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError

from coordinator.power_limit.capped import CapDetour
from coordinator.power_limit.errors import (
    MAX_POWER_LIMITS,
    InvalidTransitionError,
    NothingMeasuredError,
    PowerLimitError,
    PowerLimitRangeError,
    ProfileRangeError,
    check_arguments,
    check_loaded,
    check_resumed,
)
from coordinator.power_limit.search import (
    Probe,
    Search,
    SearchStrategy,
    WindowResult,
    aggregate,
    resolve_search,
)
from coordinator.power_limit.selectors import OptimumSelector, ZeusCost
from coordinator.power_limit.states import (
    WINDOW_PREFIX,
    BeginWindow,
    Done,
    Effect,
    EndWindow,
    Profiling,
    Ready,
    SetPowerLimit,
    State,
    Warmup,
    window_name,
)
from coordinator.power_limit.transitions import CALLS, TRANSITIONS, WINDOW_INPUTS
from zeus_agent.models import PowerLimitMeasurement

__all__ = [
    "BeginWindow", "Done", "Effect", "EndWindow", "InvalidTransitionError", "MAX_POWER_LIMITS",
    "PowerLimitError", "PowerLimitRangeError", "PowerLimitStateMachine", "ProfileRangeError",
    "Profiling", "Ready", "SetPowerLimit", "State", "TRANSITIONS", "WINDOW_PREFIX", "Warmup",
    "window_name",
]

MAX_REDOS = 3
"""How many times one limit's window is redone before the limit is left out."""



@dataclass(frozen=True, slots=True)
class _Pending:
    power_limit: int
    steps: int


class PowerLimitStateMachine:
    """JIT power-limit profiler and optimum selection, as a pure state machine.

    Attributes:
        state: The current state (`Ready`, `Warmup`, `Profiling` or `Done`).
        power_limits: The limits the search may profile (W), highest first.
        optimum_selector: The selector that picks the optimum.
        search: The search strategy.
    """

    def __init__(
        self, min_power_limit: int, max_power_limit: int,
        optimum_selector: OptimumSelector | None = None, world_size: int = 1,
        wait_steps: int = 1, warmup_steps: int = 10, profile_steps: int = 40, pl_step: int = 25,
        measurements: Sequence[PowerLimitMeasurement] | None = None, *,
        search: str | SearchStrategy = "exhaustive", resume: Sequence[WindowResult] = (),
        resume_completed: int | None = None, resume_redo: Sequence[Probe] = (),
        resume_window_steps: int = 1, resume_cap_offset: int = 0,
    ) -> None:
        """Initialize the machine.

        Args:
            min_power_limit: The GPU's minimum power limit (W).
            max_power_limit: The GPU's maximum power limit (W).
            optimum_selector: Picks the optimum; default `ZeusCost(0.5, world_size)`.
            world_size: Number of GPUs of the job (for the default selector).
            wait_steps: Steps to let pass before anything happens.
            warmup_steps: Warm-up steps at each limit before its window (0 allowed).
            profile_steps: Steps in each profiling window.
            pl_step: Stride between limits (W).
            measurements: A loaded profile; the machine then starts `Done` at its optimum.
            search: `"exhaustive"` (Zeus 0.16's, default), `"adaptive"` or a `SearchStrategy`.
            resume: Windows recorded before (e.g. by a coordinator that restarted), in
                profiling order; the search goes on after them. Ignored with `measurements`.
            resume_completed: With `resume`: the windows the search had completed (default:
                as many as recorded), from `resume_state()`.
            resume_redo: With `resume`: windows to profile again first (redos queued, and
                windows whose marks had not all arrived), from `resume_state()`.
            resume_window_steps: The fewest steps a window covers (`lengthen`), from
                `resume_state()`.
            resume_cap_offset: Windows profiled under a cap outside the search, from
                `resume_state()`.

        Raises:
            ValueError: An argument is out of range (the message names it and the range).
            PowerLimitRangeError: The limits are not `0 < min <= max`, or they give more than
                `MAX_POWER_LIMITS` candidates (a `ValueError` too).
            ProfileRangeError: A loaded measurement's limit is outside [min, max].
        """
        check_arguments(min_power_limit, max_power_limit, world_size, wait_steps,
                        warmup_steps, profile_steps, pl_step)

        self.min_power_limit = min_power_limit
        self.max_power_limit = max_power_limit
        self.optimum_selector = optimum_selector or ZeusCost(eta_knob=0.5, world_size=world_size)
        self.world_size = world_size
        self.wait_steps = wait_steps
        self.warmup_steps = warmup_steps
        self.profile_steps = profile_steps
        self.pl_step = pl_step
        self.power_limits = list(range(max_power_limit, min_power_limit - 1, -pl_step))
        self.search = resolve_search(search)

        self._started = False
        self._current: int | None = None
        self._results: list[WindowResult] = []
        self._completed = 0  # Windows closed without cancel (recorded or not).
        self._pending: dict[str, _Pending] = {}
        self._loaded: list[PowerLimitMeasurement] | None = None
        self._search: Search | None = None
        self._probe: Probe | None = None  # Probe of the open window / warm-up.
        self._no_more_probes = False
        self._redo_queue: list[Probe] = []  # Windows to profile again, before the search's next.
        self._redos: dict[int, int] = {}  # Limit -> times redone.
        self._probe_is_redo = False
        self.min_window_steps = max(1, resume_window_steps)
        """The fewest steps a window covers (`lengthen`; 1: as each probe says)."""
        self._cap = CapDetour(resume_cap_offset)

        self.state: State = self._initial_state(measurements, resume, resume_completed,
                                                resume_redo)

    def _initial_state(self, measurements: Sequence[PowerLimitMeasurement] | None,
                       resume: Sequence[WindowResult], resume_completed: int | None,
                       resume_redo: Sequence[Probe]) -> State:
        """`__init__`'s first state: `Done` at a loaded profile's optimum, else the search's.

        Raises:
            ProfileRangeError: A loaded measurement's limit is outside [min, max].
        """
        if measurements is not None:
            loaded = list(measurements)
            check_loaded(loaded, self.min_power_limit, self.max_power_limit)
            self._loaded = loaded
            return Done(optimal_power_limit=self.optimum_selector.select(loaded))
        self._search = self.search.plan(
            self.power_limits, self.warmup_steps, self.profile_steps, self.optimum_selector
        )
        check_resumed(resume, self.power_limits, self.pl_step)
        self._results = list(resume)
        self._completed = len(self._results) if resume_completed is None else max(
            len(self._results), resume_completed)
        self._redo_queue = [p for p in resume_redo if p.power_limit in self.power_limits]
        first = self._next_probe()
        if first is None:  # everything was measured before the restart
            return Done(optimal_power_limit=self.optimum_selector.select(self.measurements))
        self._probe = first
        return Ready(
            next_power_limit=first.power_limit,
            steps=self.wait_steps + 1,
            profile_steps=first.profile_steps,
        )

    # Public views --------------------------------------------------------------------------------

    @property
    def measurements(self) -> list[PowerLimitMeasurement]:
        """Measurements so far (or the loaded profile), one per limit, highest limit first.

        Windows shorter than `profile_steps` are scaled to `profile_steps`; several windows of one
        limit are pooled.
        """
        if self._loaded is not None:
            return list(self._loaded)
        return aggregate(self._results, self.profile_steps)

    @property
    def optimal_power_limit(self) -> int | None:
        """The optimal power limit (W) once known, else None."""
        return self.state.optimal_power_limit if isinstance(self.state, Done) else None

    @property
    def current_power_limit(self) -> int | None:
        """The last limit (W) the machine asked the shell to set, or None before `start()`."""
        return self._current

    @property
    def cap_w(self) -> int | None:
        """The cap the job's GPUs are held to (W, `cap`), None if none."""
        return self._cap.cap_w

    @property
    def parked(self) -> bool:
        """Whether every limit under the cap is profiled and the rest waits for the lift."""
        return self._cap.parked and isinstance(self.state, Ready)

    @property
    def pending_windows(self) -> tuple[str, ...]:
        """Names of closed windows whose measurement has not been recorded yet."""
        return tuple(self._pending)

    @property
    def window_results(self) -> tuple[WindowResult, ...]:
        """Every recorded window, in profiling order, with its own length (not scaled)."""
        return tuple(self._results)

    # Inputs: each dispatches through `TRANSITIONS` ----------------------------------------------

    def start(self) -> list[Effect]:
        """Start the machine: set the maximum limit, or the loaded profile's optimum.

        Returns:
            The effects to execute.

        Raises:
            InvalidTransitionError: Already started.
        """
        return self._dispatch("start")

    def on_step_begin(self) -> list[Effect]:
        """Mark the beginning of a training step.

        Returns:
            The effects to execute before the step runs.

        Raises:
            InvalidTransitionError: Called before `start()`.
        """
        return self._dispatch("on_step_begin")

    def on_epoch_end(self) -> list[Effect]:
        """Mark the end of a training epoch.

        Warm-up or profiling in progress is interrupted: the window is cancelled, the GPU goes
        back to the maximum limit and that limit's warm-up is redone from the next epoch's
        first step.

        Returns:
            The effects to execute.

        Raises:
            InvalidTransitionError: Called before `start()`.
        """
        return self._dispatch("on_epoch_end")

    def record(self, window_name: str, time: float, energy: float) -> list[Effect]:
        """Record the measurement of a closed window.

        Args:
            window_name: The window's name, as in its `EndWindow`.
            time: The window's duration (s), the maximum over the job's ranks.
            energy: The window's energy (J), summed over the job's GPUs.

        Returns:
            The effects to execute (next limit, or the optimum once profiling is over).

        Raises:
            InvalidTransitionError: The window is not closed-and-pending (unknown, still open,
                cancelled or already recorded), or time/energy are not positive.
        """
        return self._dispatch("record", window_name, time, energy)

    def discard(self, window_name: str) -> list[Effect]:
        """Give up a closed window whose measurement is unusable (e.g. no energy measured).

        Its limit is left out of the measurements; if it was the last one awaited, the optimum
        is chosen from the others (or the search goes on).

        Raises:
            InvalidTransitionError: The window is not closed-and-pending.
            NothingMeasuredError: It was the last window and no other was measured.
        """
        return self._dispatch("discard", window_name)

    def redo(self, window_name: str, counted: bool = True) -> list[Effect]:
        """Profile a closed window's limit again: its measurement will never come.

        The limit is queued ahead of the search's next probe (with a full warm-up). After
        `MAX_REDOS` redos of one limit, the window is discarded instead (see `discard`).
        `counted=False`: a window shorter than `min_window_steps` (`lengthen`), redone at that
        length; it does not count toward `MAX_REDOS`.

        Returns:
            The effects to execute (the redo starts at once if the machine was waiting).

        Raises:
            InvalidTransitionError: The window is not closed-and-pending.
        """
        return self._dispatch("redo", window_name, counted)

    def lengthen(self, steps: int) -> None:
        """Make every window from now on cover at least `steps` steps (a minimum).

        The open window is lengthened in place, closed ones are not (the shell redoes those
        too short: `redo(name, counted=False)`).
        """
        self._dispatch("lengthen", steps)

    def cap(self, cap_w: int | None) -> list[Effect]:
        """A budget holds the GPUs at or under `cap_w` (None: lifted): profile only under it.

        A probe above it is abandoned (its window cancelled) and waits for the lift with every
        limit above it, the GPUs meanwhile at the best limit measured under it.
        """
        return self._dispatch("cap", cap_w)

    def choose(self, power_limit: int) -> list[Effect]:
        """Pin a limit chosen outside the machine (a user's selector run in rank 0's process).

        Only once done, and only a measured limit.

        Raises:
            InvalidTransitionError: Not done yet.
            ProfileRangeError: `power_limit` was not measured.
        """
        return self._dispatch("choose", power_limit)

    def resume_state(self) -> dict[str, Any]:
        """What a machine resuming this profile needs (see `resume*` in the constructor).

        Windows closed but not yet recorded, and an open window that was a redo, are to be
        profiled again: a machine built from this state profiles them first.
        """
        redo = list(self._redo_queue)
        redo += [Probe(p.power_limit, self.warmup_steps, p.steps) for p in self._pending.values()]
        if (self._probe is not None and self._probe_is_redo
                and isinstance(self.state, Warmup | Profiling)):
            redo.append(self._probe)
        return {
            "windows": [dataclasses.asdict(w) for w in self._results],
            "completed": self._completed,
            "redo": [[p.power_limit, p.warmup_steps, p.profile_steps] for p in redo],
            "window_steps": self.min_window_steps,
            "cap_offset": self._cap.offset,
        }

    def redos(self) -> dict[int, int]:
        """Limit (W) -> how many times its window was redone."""
        return dict(self._redos)

    # Handlers (`TRANSITIONS`): called with the state, then the input's arguments ----------------

    def _dispatch(self, name: str, *args: Any) -> Any:
        handler = TRANSITIONS.get((self._started, type(self.state), name))
        if handler is None:
            detail = ("the profile is not complete yet" if name == "choose"
                      else self._pending_detail() if name in WINDOW_INPUTS else "")
            raise self._invalid(CALLS[name].format(*args), detail)
        return getattr(self, handler)(self.state, *args)

    def _ignore(self, state: State) -> list[Effect]:
        return []

    def _start_profiling(self, state: Ready) -> list[Effect]:
        self._started = True
        return self._set(self.max_power_limit)

    def _start_done(self, state: Done) -> list[Effect]:
        self._started = True
        return self._set(state.optimal_power_limit)

    def _step_ready(self, state: Ready) -> list[Effect]:
        if state.next_power_limit is None:
            # Waiting for a record (or parked under a cap): steps count toward nothing, so they
            # run at the maximum, or the best under a cap (a lost window can take many steps).
            return self._set(self._waiting_limit())
        if self._count_down(state):
            return []
        assert self._probe is not None
        return self._begin_probe(self._probe)

    def _step_warmup(self, state: Warmup) -> list[Effect]:
        if self._count_down(state):
            return []
        return self._open_window(state.current_power_limit, state.profile_steps)

    def _step_profiling(self, state: Profiling) -> list[Effect]:
        if self._count_down(state):
            return []
        return self._close_window(state)

    def _interrupt(self, state: Warmup | Profiling) -> list[Effect]:
        assert self._probe is not None
        # The redo always warms up: the GPU goes back to the maximum meanwhile.
        self._probe = replace(self._probe, warmup_steps=self.warmup_steps)
        self.state = Ready(
            next_power_limit=state.current_power_limit,
            steps=1,
            profile_steps=state.profile_steps,
        )
        return self._set(self._waiting_limit())

    def _interrupt_window(self, state: Profiling) -> list[Effect]:
        return [EndWindow(state.window_name, cancel=True), *self._interrupt(state)]

    def _record(self, state: Warmup | Profiling, name: str, time: float,
                energy: float) -> list[Effect]:
        self._keep(name, time, energy)
        return []

    def _record_ready(self, state: Ready, name: str, time: float, energy: float) -> list[Effect]:
        self._keep(name, time, energy)
        return self._advance() if state.next_power_limit is None else []

    def _discard(self, state: Warmup | Profiling, name: str) -> list[Effect]:
        self._drop(name)
        return []

    def _discard_ready(self, state: Ready, name: str) -> list[Effect]:
        self._drop(name)
        if state.next_power_limit is not None:
            return []
        if self._pending or self._results:
            return self._advance()
        probe = self._next_probe()  # nothing measured yet: the search must go on
        if probe is None:
            raise self._invalid(CALLS["discard"].format(name),
                                "no window was measured: nothing to choose from",
                                NothingMeasuredError)
        return self._begin_probe(probe)

    def _redo(self, state: Warmup | Profiling, name: str, counted: bool = True) -> list[Effect]:
        return [] if self._queue_redo(name, counted) else self.discard(name)

    def _redo_ready(self, state: Ready, name: str, counted: bool = True) -> list[Effect]:
        if not self._queue_redo(name, counted):
            return self.discard(name)
        return self._advance() if state.next_power_limit is None else []

    def _lengthen(self, state: Ready | Done, steps: int) -> None:
        self._raise_minimum(steps)

    def _lengthen_warmup(self, state: Warmup, steps: int) -> None:
        if self._raise_minimum(steps) and state.profile_steps < steps:
            self.state = replace(state, profile_steps=steps)

    def _lengthen_window(self, state: Profiling, steps: int) -> None:
        if self._raise_minimum(steps) and state.profile_steps < steps:
            self.state = replace(state, steps=state.steps + steps - state.profile_steps,
                                 profile_steps=steps)

    def _capped(self, state: State, cap_w: int | None) -> list[Effect]:
        self._cap.cap_w = cap_w
        if not self._started or isinstance(state, Done):
            return []
        if isinstance(state, Ready) and state.next_power_limit is None:
            return self._advance() if self._cap.parked else self._set(self._waiting_limit())
        probe = self._probe
        if probe is None or not self._cap.above(probe.power_limit):
            return []
        self._cap.put_back(probe, self._redo_queue if self._probe_is_redo else None)
        effects: list[Effect] = []
        if isinstance(state, Profiling):
            effects.append(EndWindow(state.window_name, cancel=True))
        nxt = None if self.search.waits_for_results and self._pending else self._next_probe()
        if nxt is None:
            return effects + self._advance()
        self._probe = nxt
        self.state = Ready(next_power_limit=nxt.power_limit, steps=1,
                           profile_steps=nxt.profile_steps)
        return effects + self._set(self._waiting_limit())

    def _waiting_limit(self) -> int:
        """The limit while nothing is measured: the maximum, or the best under a cap."""
        return self._cap.waiting_limit(self.power_limits, self.measurements,
                                       self.optimum_selector)

    def _choose(self, state: Done, power_limit: int) -> list[Effect]:
        measured = [m.power_limit for m in self.measurements]
        if power_limit not in measured:
            raise ProfileRangeError(f"{power_limit} W was not profiled (profiled: "
                                    f"{', '.join(map(str, measured))} W)")
        self.state = Done(optimal_power_limit=power_limit)
        return self._set(power_limit)

    # Internals -----------------------------------------------------------------------------------

    def _invalid(self, call: str, detail: str = "",
                 error: type[InvalidTransitionError] = InvalidTransitionError,
                 ) -> InvalidTransitionError:
        started = "" if self._started else " (start() not called yet)"
        extra = f"; {detail}" if detail else ""
        return error(f"Can't handle {call} in state {self.state!r}{started}{extra}.")

    def _pending_detail(self) -> str:
        return f"pending windows are {sorted(self._pending) or 'none'}"

    def _pending_window(self, name: str, window: str, *args: Any) -> _Pending:
        """The closed window `window` awaiting its measurement, for input `name`; else raise."""
        pending = self._pending.get(window)
        if pending is None:
            raise self._invalid(CALLS[name].format(window, *args), self._pending_detail())
        return pending

    def _keep(self, window: str, time: float, energy: float) -> None:
        """Keep a pending window's measurement (`record`)."""
        pending = self._pending_window("record", window, time, energy)
        try:
            PowerLimitMeasurement(power_limit=pending.power_limit, energy=energy, time=time)
        except ValidationError:
            raise self._invalid(CALLS["record"].format(window, time, energy),
                                "time and energy must be positive") from None
        del self._pending[window]
        self._results.append(WindowResult(pending.power_limit, pending.steps, time, energy))

    def _drop(self, window: str) -> None:
        """Forget a pending window: its limit is left out (`discard`)."""
        self._pending_window("discard", window)
        del self._pending[window]

    def _raise_minimum(self, steps: int) -> bool:
        """Raise `min_window_steps` to `steps` (True), unless it is at least that already."""
        if steps <= self.min_window_steps:
            return False
        self.min_window_steps = steps
        return True

    def _queue_redo(self, window: str, counted: bool) -> bool:
        """Queue a pending window's limit to be profiled again; False: redone too often."""
        pending = self._pending_window("redo", window)
        done = self._redos.get(pending.power_limit, 0)
        if counted and done >= MAX_REDOS:
            return False
        if counted:
            self._redos[pending.power_limit] = done + 1
        del self._pending[window]
        self._redo_queue.append(Probe(pending.power_limit, self.warmup_steps, pending.steps))
        return True

    def _count_down(self, state: Ready | Warmup | Profiling) -> bool:
        """One `on_step_begin` of several left in `state` (True), or the last one (False)."""
        if state.steps > 1:
            self.state = replace(state, steps=state.steps - 1)
            return True
        return False

    def _set(self, watts: int) -> list[Effect]:
        if self._current == watts:
            return []
        self._current = watts
        return [SetPowerLimit(watts)]

    def _next_probe(self) -> Probe | None:
        assert self._search is not None
        redo = self._cap.first_redo(self._redo_queue)
        self._probe_is_redo = redo is not None
        if redo is not None:
            return self._redo_queue.pop(redo)
        if self._no_more_probes:
            self._cap.parked = bool(self._redo_queue)  # redos above the cap wait for the lift
            return None
        probe = self._cap.next_probe(self._search, tuple(self._results), self._completed,
                                     self.power_limits, (self.warmup_steps, self.profile_steps),
                                     self._search.sweeps, self._pending.values())
        if probe is None and not self._cap.parked:
            self._no_more_probes = True
            self._cap.parked = bool(self._redo_queue)
        return probe

    def _begin_probe(self, probe: Probe) -> list[Effect]:
        """Set the probe's limit and start its warm-up, or its window if no warm-up is due."""
        self._probe = probe
        effects = self._set(probe.power_limit)
        if probe.warmup_steps == 0:
            return effects + self._open_window(probe.power_limit, probe.profile_steps)
        self.state = Warmup(
            probe.power_limit, steps=probe.warmup_steps, profile_steps=probe.profile_steps
        )
        return effects

    def _open_window(self, power_limit: int, profile_steps: int) -> list[Effect]:
        profile_steps = max(profile_steps, self.min_window_steps)
        self.state = Profiling(power_limit, steps=profile_steps, profile_steps=profile_steps)
        return [BeginWindow(window_name(power_limit))]

    def _close_window(self, state: Profiling) -> list[Effect]:
        name = state.window_name
        if name in self._pending:  # Only if a search re-probes a limit without waiting.
            raise self._invalid("on_step_begin()", f"window {name!r} is still pending")
        self._pending[name] = _Pending(state.current_power_limit, state.profile_steps)
        if not self._probe_is_redo:
            self._completed += 1
        effects: list[Effect] = [EndWindow(name)]
        if self.search.waits_for_results:
            self.state = Ready(next_power_limit=None, steps=0)
            return effects
        return effects + self._advance()

    def _advance(self) -> list[Effect]:
        """Choose what follows a closed window (results permitting)."""
        if self.search.waits_for_results and self._pending:
            self.state = Ready(next_power_limit=None, steps=0)
            return []
        probe = self._next_probe()
        if probe is not None:
            return self._begin_probe(probe)
        if self._pending or self._cap.parked:
            self.state = Ready(next_power_limit=None, steps=0)
            return self._set(self._waiting_limit()) if self._cap.parked else []
        optimum = self.optimum_selector.select(self.measurements)
        self.state = Done(optimal_power_limit=optimum)
        return self._set(optimum)
