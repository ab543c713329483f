"""Execution of one rank's per-instruction frequency schedule (Perseus client, Zeus 0.16).

Pieces:

* `ScheduleStep`: what `on_instruction_begin` decided: the position, the expected instruction,
  the frequency to apply and an error message when the trainer and the schedule disagree.
* `ScheduleCursor`: holds the installed schedule of the rank bound to this GPU and walks it, one
  `(instruction, frequency)` pair per `instruction_begin`, rewinding at every `step_end`.

Invariants (mirroring `PerseusOptimizer.on_instruction_begin` / `on_step_end`):

1. A schedule holds one iteration's worth of pairs. Each `on_instruction_begin` consumes the next
   pair, whether or not the name matches (Zeus 0.16 consumed it with `next()` before checking).
2. If the iteration's pairs are exhausted, the step carries the error "... returned fewer
   frequencies than expected" and no frequency (`frequency_mhz is None`).
3. If the name differs from the expected instruction, the step carries an error naming both, and
   the scheduled frequency is still returned: the shell decides whether to apply it (Zeus 0.16
   raised before applying; the agent instead reports an error event and, by default, applies
   the frequency the schedule says for that slot, so one mislabelled event does not desynchronise
   the rest of the iteration).
4. `on_step_end` returns "... returned more frequencies than expected. Next expected instruction
   and frequency is (...)" if pairs remain, then rewinds to the first pair and counts the
   iteration, either way.
5. Trainer mistakes are returned as values, never raised; only invalid schedules (`install`)
   raise `ValueError`. Without an installed schedule, `on_instruction_begin` returns an error
   step and `on_step_end` returns None.
6. `install` replaces the schedule at once and rewinds to iteration 0, position 0; the shell
   installs between steps. `clear` removes it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

__all__ = ["ScheduleCursor", "ScheduleStep"]


@dataclass(frozen=True, slots=True)
class ScheduleStep:
    """The outcome of one `instruction_begin` against the schedule.

    Attributes:
        index: Position of this instruction in the iteration (0-based), counting every
            `instruction_begin` since the last `step_end`.
        iteration: Iterations completed under this schedule before this one (0-based).
        name: The instruction name the trainer reported.
        expected_name: The instruction the schedule expected here, or None if exhausted.
        frequency_mhz: The SM frequency the schedule gives for this slot (MHz), or None if the
            schedule is exhausted or none is installed.
        error: Human-readable error, or None when the trainer and the schedule agree.
    """

    index: int
    iteration: int
    name: str
    expected_name: str | None
    frequency_mhz: int | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Whether the instruction matched the schedule."""
        return self.error is None


class ScheduleCursor:
    """Walks one rank's installed frequency schedule (see the module docstring)."""

    def __init__(self) -> None:
        """Create a cursor with no schedule installed."""
        self._rank: int | None = None
        self._pairs: tuple[tuple[str, int], ...] = ()
        self._pos = 0
        self._iteration = 0

    # ----------------------------------------------------------------------------- control

    def install(
        self,
        rank: int,
        frequencies: Sequence[tuple[str, int]],
        supported_clocks_mhz: Collection[int] | None = None,
    ) -> None:
        """Validate and install a schedule, rewinding to its start.

        Args:
            rank: Global rank the schedule is for (>= 0).
            frequencies: `(instruction name, SM frequency in MHz)` pairs of one iteration, in
                execution order; non-empty.
            supported_clocks_mhz: If given, every frequency must be one of these.

        Raises:
            ValueError: The rank is negative, the list is empty, a name is empty, a frequency is
                not a positive integer or not supported; the message names the index. The
                previous schedule stays installed.
        """
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"Schedule rank must be an integer >= 0, got {rank!r}.")
        if not frequencies:
            raise ValueError(
                f"Schedule for rank {rank} is empty; it needs one pair per instruction."
            )
        supported = None if supported_clocks_mhz is None else frozenset(supported_clocks_mhz)
        pairs: list[tuple[str, int]] = []
        for i, item in enumerate(frequencies):
            if isinstance(item, str | bytes) or not isinstance(item, Sequence) or len(item) != 2:
                raise ValueError(
                    f"Schedule for rank {rank}: instruction {i} must be an (instruction, "
                    f"frequency_mhz) pair, got {item!r}."
                )
            name, freq = item
            if not isinstance(name, str) or not name:
                raise ValueError(
                    f"Schedule for rank {rank}: instruction {i} has an empty or non-string "
                    f"name {name!r}."
                )
            if isinstance(freq, bool) or not isinstance(freq, int) or freq <= 0:
                raise ValueError(
                    f"Schedule for rank {rank}: instruction {i} ({name!r}) has frequency "
                    f"{freq!r}; it must be a positive integer in MHz."
                )
            if supported is not None and freq not in supported:
                raise ValueError(
                    f"Schedule for rank {rank}: instruction {i} ({name!r}) asks for {freq} MHz, "
                    f"which this GPU does not support (supported: "
                    f"{', '.join(str(f) for f in sorted(supported, reverse=True))} MHz)."
                )
            pairs.append((name, freq))
        self._rank = rank
        self._pairs = tuple(pairs)
        self._pos = 0
        self._iteration = 0

    def clear(self) -> None:
        """Remove the installed schedule (no-op if none)."""
        self._rank = None
        self._pairs = ()
        self._pos = 0
        self._iteration = 0

    # ----------------------------------------------------------------------------- state

    @property
    def installed(self) -> bool:
        """Whether a schedule is installed."""
        return self._rank is not None

    @property
    def rank(self) -> int | None:
        """Rank of the installed schedule, or None."""
        return self._rank

    @property
    def frequencies(self) -> tuple[tuple[str, int], ...]:
        """The installed pairs (empty if none)."""
        return self._pairs

    @property
    def position(self) -> int:
        """Instructions begun in the current iteration."""
        return self._pos

    @property
    def iteration(self) -> int:
        """Iterations completed under the installed schedule."""
        return self._iteration

    def next_pair(self) -> tuple[str, int] | None:
        """The pair the next `instruction_begin` will take, without taking it.

        The current iteration's next pair or, when they are used up, the first (as after the
        `step_end` due next); None without a schedule. Nothing is consumed: a raise issued ahead
        (`zeus_agent.agent.core.raise_ahead`) leaves mismatches to the event.
        """
        if not self._pairs:
            return None
        return self._pairs[self._pos] if self._pos < len(self._pairs) else self._pairs[0]

    # ----------------------------------------------------------------------------- events

    def on_instruction_begin(self, name: str) -> ScheduleStep:
        """Take the next pair of the schedule for instruction `name`.

        Args:
            name: The instruction the trainer is about to run, e.g. "forward".

        Returns:
            The step: the frequency to apply (None if there is none) and an error message if the
            schedule is missing, exhausted for this iteration, or expected another instruction.
        """
        index = self._pos
        self._pos += 1
        if self._rank is None:
            return ScheduleStep(
                index,
                self._iteration,
                name,
                None,
                None,
                f"No frequency schedule installed; instruction {index} ({name!r}) runs at the "
                "current clocks.",
            )
        if index >= len(self._pairs):
            return ScheduleStep(
                index,
                self._iteration,
                name,
                None,
                None,
                f"The schedule of rank {self._rank} returned fewer frequencies than expected: "
                f"it has {len(self._pairs)} per iteration, but instruction {index} ({name!r}) "
                f"began in iteration {self._iteration}.",
            )
        expected, freq = self._pairs[index]
        error = None
        if expected != name:
            error = (
                f"The next expected instruction of rank {self._rank} is {expected!r} "
                f"(index {index} of iteration {self._iteration}), got {name!r}; its scheduled "
                f"frequency is {freq} MHz."
            )
        return ScheduleStep(index, self._iteration, name, expected, freq, error)

    def on_step_end(self) -> str | None:
        """Close the iteration: report leftover pairs, then rewind.

        Returns:
            An error message if pairs of this iteration were not consumed, else None.
        """
        error = None
        if self._rank is not None and self._pos < len(self._pairs):
            item = self._pairs[self._pos]
            error = (
                f"The schedule of rank {self._rank} returned more frequencies than expected. "
                f"Next expected instruction and frequency is {item}"
            )
        self._pos = 0
        if self._rank is not None:
            self._iteration += 1
        return error
