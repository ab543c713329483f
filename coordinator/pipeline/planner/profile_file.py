"""Instruction profile CSV files, read. I/O edge: reads files.

`load_profile(path)` reads Zeus 0.16's `InstructionProfilingResult` CSV or lowtime 0.3.0's
(`stage,instruction,frequency,time,energy`) into an `InstructionProfile`.
"""

from __future__ import annotations

import csv
import os

from coordinator.pipeline.planner.profile import COLUMNS, ZEUS_COLUMNS, InstructionProfile

__all__ = ["load_profile"]


def load_profile(path: str | os.PathLike[str]) -> InstructionProfile:
    """Read an instruction profile CSV.

    Accepts Zeus 0.16's `InstructionProfilingResult` columns (`rank,dp_rank,pp_rank,tp_rank,
    stage,instruction,frequency,time,energy`) and lowtime 0.3.0's (`stage,instruction,
    frequency,time,energy`), in any column order.

    Raises:
        ValueError: A missing column or a bad row (see `InstructionProfile.from_rows`).
        OSError: The file cannot be read.
    """
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        header = [c.strip() for c in reader.fieldnames or ()]
        missing = [c for c in COLUMNS if c not in header]
        if missing:
            raise ValueError(
                f"{os.fspath(path)}: missing column(s) {', '.join(missing)} (need "
                f"{','.join(COLUMNS)}, optionally after {','.join(ZEUS_COLUMNS)})"
            )
        reader.fieldnames = header
        try:
            return InstructionProfile.from_rows(list(reader))
        except ValueError as e:
            raise ValueError(f"{os.fspath(path)}: {e}") from None
