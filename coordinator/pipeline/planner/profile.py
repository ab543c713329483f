"""`InstructionProfile`: each pipeline stage's instructions' time and energy per SM clock. Pure.

What the frontier planner plans on: the mean time and energy of one forward or backward
instruction of each pipeline stage at each locked SM clock, from rows (Zeus 0.16's
`InstructionProfilingResult` columns or lowtime 0.3.0's `stage,instruction,frequency,time,
energy`). A CSV file of them is read by `coordinator.pipeline.planner.profile_file`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["COLUMNS", "DEFAULT_P_BLOCK_W", "ZEUS_COLUMNS", "InstructionProfile", "Plan"]

DEFAULT_P_BLOCK_W = 83.64
"""Blocking power of a waiting GPU (W): the A100 figure of the Perseus artifact."""

Plan = tuple[tuple[tuple[str, int], ...], ...]
"""Per stage, (instruction, MHz) pairs in execution order."""

ZEUS_COLUMNS = ("rank", "dp_rank", "pp_rank", "tp_rank")
"""The columns of Zeus 0.16's CSV before `COLUMNS` (ignored: rows of one stage are merged)."""
COLUMNS = ("stage", "instruction", "frequency", "time", "energy")
"""The columns a profile row needs."""


@dataclass(frozen=True)
class InstructionProfile:
    """Time and energy of each (stage, instruction) at each SM clock.

    Attributes:
        entries: (stage, instruction) -> ((MHz, seconds, joules), ...), fastest clock first.
            Rows of several ranks of one stage (data or tensor parallel) are merged: the time is
            the slowest rank's (a stage's instruction ends when all its ranks finish) and the
            energy the ranks' mean (the energy formula counts one GPU per stage).
    """

    entries: Mapping[tuple[int, str], tuple[tuple[int, float, float], ...]]

    @classmethod
    def from_rows(cls, rows: Iterable[Mapping[str, Any] | Sequence[Any]]) -> InstructionProfile:
        """Build a profile from rows.

        A row is a mapping with keys stage, instruction, frequency, time, energy (other keys,
        such as Zeus's rank columns, are ignored) or a (stage, instruction, frequency, time,
        energy) sequence.

        Raises:
            ValueError: A malformed row, a non-positive or non-finite time, a negative or
                non-finite energy, stages not numbered 0 to S-1, or no rows.
        """
        merged: dict[tuple[int, str, int], list[tuple[float, float]]] = {}
        for n, row in enumerate(rows):
            try:
                if isinstance(row, Mapping):
                    values = [row[c] for c in COLUMNS]
                else:
                    values = list(row)
                    if len(values) != len(COLUMNS):
                        raise ValueError(f"{len(values)} fields, need {len(COLUMNS)}")
                stage = int(values[0])
                name = str(values[1]).strip()
                freq = int(float(values[2]))
                if float(values[2]) != freq:
                    raise ValueError(f"frequency {values[2]!r} is not a whole number of MHz")
                time, energy = float(values[3]), float(values[4])
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"profile row {n}: {e!r}") from None
            if stage < 0 or not name or freq <= 0:
                raise ValueError(f"profile row {n}: bad stage, instruction or frequency")
            if not (math.isfinite(time) and time > 0):
                raise ValueError(f"profile row {n}: time must be positive, got {time}")
            if not (math.isfinite(energy) and energy >= 0):
                raise ValueError(f"profile row {n}: energy must be >= 0, got {energy}")
            merged.setdefault((stage, name, freq), []).append((time, energy))
        if not merged:
            raise ValueError("the profile has no rows")
        entries: dict[tuple[int, str], list[tuple[int, float, float]]] = {}
        for (stage, name, freq), values in merged.items():
            time = max(t for t, _ in values)
            energy = sum(e for _, e in values) / len(values)
            entries.setdefault((stage, name), []).append((freq, time, energy))
        stages = sorted({stage for stage, _ in entries})
        if stages != list(range(len(stages))):
            raise ValueError(f"profile stages must be numbered 0 to S-1, got {stages}")
        return cls(
            {key: tuple(sorted(rows_, reverse=True)) for key, rows_ in sorted(entries.items())}
        )

    @property
    def num_stages(self) -> int:
        """Stages in the profile."""
        return 1 + max(stage for stage, _ in self.entries)

    def instructions(self, stage: int) -> list[str]:
        """The instruction names profiled for `stage`."""
        return sorted(name for s, name in self.entries if s == stage)

    def lookup(self, stage: int, instruction: str, frequency: int) -> tuple[float, float]:
        """(time, energy) of one instruction at one clock.

        Raises:
            KeyError: Not in the profile.
        """
        for freq, time, energy in self.entries[(stage, instruction)]:
            if freq == frequency:
                return time, energy
        raise KeyError(f"stage {stage} {instruction} was not profiled at {frequency} MHz")

    def for_stages(self, num_stages: int) -> InstructionProfile:
        """This profile for `num_stages` stages (a one-stage profile is copied to every stage).

        Raises:
            ValueError: The profile has another number of stages (and not one).
        """
        if num_stages == self.num_stages:
            return self
        if self.num_stages != 1:
            raise ValueError(
                f"the profile has {self.num_stages} stages, not {num_stages} (only a one-stage "
                "profile can be used for any number of stages)"
            )
        return InstructionProfile(
            {(s, name): rows for s in range(num_stages) for (_, name), rows in self.entries.items()}
        )

    def with_split_backward(self) -> InstructionProfile:
        """This profile with each backward row also split in two halves of its time and energy.

        The halves are `backward_input` and `backward_weight` rows: a stand-in, for zero-bubble
        schedules, built from a profile measured with whole backwards (as the Perseus artifact's
        are).
        """
        entries = dict(self.entries)
        for (stage, name), rows in self.entries.items():
            if name == "backward":
                half = tuple((f, t / 2, e / 2) for f, t, e in rows)
                entries[(stage, "backward_input")] = entries[(stage, "backward_weight")] = half
        return InstructionProfile(entries)
