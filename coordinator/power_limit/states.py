"""The power-limit machine's effects and states: frozen dataclasses, replaced, never mutated.

* Effects (what the shell executes, in order): `SetPowerLimit`, `BeginWindow`, `EndWindow`,
  and their union `Effect`.
* States: `Ready`, `Warmup`, `Profiling`, `Done`, and their union `State`.
* `window_name`: Zeus 0.16's window name for a limit.

`coordinator.power_limit.machine` moves between the states (its transition table) and re-exports
everything here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BeginWindow",
    "Done",
    "Effect",
    "EndWindow",
    "Profiling",
    "Ready",
    "SetPowerLimit",
    "State",
    "WINDOW_PREFIX",
    "Warmup",
    "window_name",
]

WINDOW_PREFIX = "__GlobalPowerLimitOptimizer_"


def window_name(power_limit: int) -> str:
    """Return Zeus 0.16's profiling window name for a power limit (W)."""
    return f"{WINDOW_PREFIX}{power_limit}"


# Effects ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SetPowerLimit:
    """Set the power limit of every GPU of the job.

    Attributes:
        watts: The power limit (W).
    """

    watts: int


@dataclass(frozen=True, slots=True)
class BeginWindow:
    """Open a time/energy measurement window over the job's GPUs.

    Attributes:
        name: Window name (`__GlobalPowerLimitOptimizer_{limit}`).
    """

    name: str


@dataclass(frozen=True, slots=True)
class EndWindow:
    """Close a measurement window.

    Attributes:
        name: Window name.
        cancel: If True, discard the window: no measurement is expected for it. Otherwise the
            shell must later call `record(name, time, energy)`.
    """

    name: str
    cancel: bool = False


Effect = SetPowerLimit | BeginWindow | EndWindow


# States -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready:
    """Ready to start measuring the next power limit.

    Initial state if no profile was loaded (`steps = wait_steps + 1`), and the state after an
    epoch end interrupted warm-up or profiling (`steps = 1`).
    `Ready` -> `Warmup` on the `steps`'th `on_step_begin` (-> `Profiling` if no warm-up).
    With `next_power_limit=None` the machine waits for a pending measurement to choose the next
    limit: `on_step_begin` sets the maximum limit (nothing is measured meanwhile), and `record`
    -> `Warmup`, `Profiling` or `Done`.

    Attributes:
        next_power_limit: The limit (W) to warm up next, or None while waiting for a record.
        steps: `on_step_begin` calls left before the warm-up starts.
        profile_steps: Window length (steps) for that limit.
    """

    next_power_limit: int | None
    steps: int
    profile_steps: int = 0


@dataclass(frozen=True, slots=True)
class Warmup:
    """Warming up at a power limit before its window opens.

    `Warmup` -> `Profiling` on the `steps`'th `on_step_begin`.
    `Warmup` -> `Ready` on `on_epoch_end` before the `steps`'th `on_step_begin`.

    Attributes:
        current_power_limit: The limit (W) being warmed up.
        steps: `on_step_begin` calls left in the warm-up.
        profile_steps: Window length (steps) that follows.
    """

    current_power_limit: int
    steps: int
    profile_steps: int


@dataclass(frozen=True, slots=True)
class Profiling:
    """Profiling a power limit: its window is open.

    `Profiling` -> `Warmup` or `Profiling` (next window) after the `steps`'th `on_step_begin`
        when the search goes on and does not need this window's result to choose.
    `Profiling` -> `Ready(next_power_limit=None)` after the `steps`'th `on_step_begin` when the
        choice needs results not yet recorded.
    `Profiling` -> `Done` after the `steps`'th `on_step_begin` when nothing is left to profile and
        every result is recorded.
    `Profiling` -> `Ready` on `on_epoch_end` before the `steps`'th `on_step_begin`.

    Attributes:
        current_power_limit: The limit (W) being profiled.
        steps: `on_step_begin` calls left before the window closes.
        profile_steps: Length of the window (steps).
    """

    current_power_limit: int
    steps: int
    profile_steps: int

    @property
    def window_name(self) -> str:
        """Name of the open window."""
        return window_name(self.current_power_limit)


@dataclass(frozen=True, slots=True)
class Done:
    """Done profiling: the optimal power limit is known.

    Initial state if a profile was loaded. Final state in any case; every input is ignored.

    Attributes:
        optimal_power_limit: The selected limit (W).
    """

    optimal_power_limit: int


State = Ready | Warmup | Profiling | Done
