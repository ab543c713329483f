"""The errors the power-limit core raises on purpose, and the check of a GPU's limit range.

* `PowerLimitError` (base), `InvalidTransitionError` (an input the state cannot accept),
  `NothingMeasuredError` (the search is over with nothing measured), `ProfileRangeError` (a
  loaded profile or a choice outside the profiled limits), `PowerLimitRangeError` (a GPU's
  limits that are not `0 < min <= max`, or that give more than `MAX_POWER_LIMITS` candidate
  limits: refused by `check_range` before any list is built, so a hostile description such as
  `max_power_limit_w = 2**63 - 1` cannot exhaust the memory).

Pure. `coordinator.power_limit.machine` re-exports them.
"""

from __future__ import annotations

__all__ = [
    "MAX_POWER_LIMITS",
    "InvalidTransitionError",
    "NothingMeasuredError",
    "PowerLimitError",
    "PowerLimitRangeError",
    "ProfileRangeError",
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
