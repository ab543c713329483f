"""The errors the power-limit core raises on purpose, and the checks of a machine's arguments.

* `PowerLimitError` (base), `InvalidTransitionError` (an input the state cannot accept),
  `NothingMeasuredError` (the search is over with nothing measured), `ProfileRangeError` (a
  loaded profile or a choice outside the profiled limits), `PowerLimitRangeError` (a GPU's
  limits that are not `0 < min <= max`, or that give more than `MAX_POWER_LIMITS` candidate
  limits: refused by `check_range` before any list is built, so a hostile description such as
  `max_power_limit_w = 2**63 - 1` cannot exhaust the memory).

`check_arguments`, `check_loaded` and `check_resumed` refuse what a machine is built from.

Pure. `coordinator.power_limit.machine` re-exports the errors.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

__all__ = [
    "MAX_POWER_LIMITS",
    "InvalidTransitionError",
    "NothingMeasuredError",
    "PowerLimitError",
    "PowerLimitRangeError",
    "ProfileRangeError",
    "check_arguments",
    "check_loaded",
    "check_resumed",
    "check_range",
]

MAX_POWER_LIMITS = 4096
"""Most candidate limits one machine profiles (a real GPU has tens: e.g. 100..700 W by 25 W)."""


class PowerLimitError(Exception):
    """Base class of the errors raised on purpose by the power-limit core."""


class InvalidTransitionError(PowerLimitError, RuntimeError):
    """An input that the current state cannot accept (a bug in the shell driving the machine)."""


class NothingMeasuredError(InvalidTransitionError):
    """The search is over and no window was measured: there is nothing to choose from.

    Every window was discarded (lost, unusable, or redone too often): the shell gives up.
    """


class ProfileRangeError(PowerLimitError, ValueError):
    """A loaded profile does not fit the GPU's power-limit range."""


class PowerLimitRangeError(PowerLimitError, ValueError):
    """A GPU's power-limit range no machine can profile (the message names the bound)."""


def check_range(min_power_limit: int, max_power_limit: int, pl_step: int) -> None:
    """Refuse limits no machine can profile, before any list of them is built.

    The limits come from the GPUs' descriptions, which an agent sends: `range(max, min - 1,
    -pl_step)` of a hostile `max_power_limit_w = 2**63 - 1` would take all the memory.

    Raises:
        PowerLimitRangeError: Not `0 < min <= max`, or more than `MAX_POWER_LIMITS` limits.
    """
    if not 0 < min_power_limit <= max_power_limit:
        raise PowerLimitRangeError(
            "Power limits must satisfy 0 < min_power_limit <= max_power_limit; got "
            f"min_power_limit={min_power_limit}, max_power_limit={max_power_limit}."
        )
    if pl_step > 0 and (max_power_limit - min_power_limit) // pl_step + 1 > MAX_POWER_LIMITS:
        count = (max_power_limit - min_power_limit) // pl_step + 1
        raise PowerLimitRangeError(
            f"Power limits {min_power_limit}..{max_power_limit} W by {pl_step} W give {count} "
            f"candidate limits, more than MAX_POWER_LIMITS={MAX_POWER_LIMITS}: the GPU's "
            "description is not physical (or pl_step is far too small)."
        )


class _AtLimit(Protocol):
    @property
    def power_limit(self) -> int: ...


def check_arguments(min_power_limit: int, max_power_limit: int, world_size: int,
                    wait_steps: int, warmup_steps: int, profile_steps: int, pl_step: int) -> None:
    """Refuse a machine's arguments out of range.

    Raises:
        ValueError: An argument is out of range (the message names it and the range).
        PowerLimitRangeError: The limits (see `check_range`).
    """
    check_range(min_power_limit, max_power_limit, pl_step)
    if world_size < 1:
        raise ValueError(f"world_size must be greater than or equal to 1; got {world_size}.")
    if wait_steps < 0:
        raise ValueError(f"wait_steps must be non-negative; got {wait_steps}.")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be non-negative; got {warmup_steps}.")
    if profile_steps <= 0:
        raise ValueError(f"profile_steps must be positive; got {profile_steps}.")
    if pl_step <= 0:
        raise ValueError(f"pl_step must be positive; got {pl_step}.")


def check_loaded(loaded: Sequence[_AtLimit], min_power_limit: int, max_power_limit: int) -> None:
    """Refuse a loaded profile that is empty or has a limit outside [min, max].

    Raises:
        ValueError: The profile is empty.
        ProfileRangeError: A limit is out of range (recorded on another GPU model).
    """
    if not loaded:
        raise ValueError("measurements (a loaded profile) must not be empty.")
    for m in loaded:
        if not min_power_limit <= m.power_limit <= max_power_limit:
            raise ProfileRangeError(
                f"Loaded profile has power limit {m.power_limit} W, outside this GPU's "
                f"range [{min_power_limit}, {max_power_limit}] W. The profile was "
                "recorded on another GPU model: delete it to profile again."
            )


def check_resumed(resume: Iterable[_AtLimit], power_limits: Sequence[int], pl_step: int) -> None:
    """Refuse resumed windows at a limit that is not one of `power_limits`.

    Raises:
        ProfileRangeError: The GPUs or the options changed since the windows were recorded.
    """
    for result in resume:
        if result.power_limit not in power_limits:
            raise ProfileRangeError(
                f"Resumed window at {result.power_limit} W is not one of this job's "
                f"power limits {power_limits[0]}..{power_limits[-1]} W "
                f"(step {pl_step} W): the GPUs or the options changed; profile again."
            )
