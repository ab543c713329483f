"""Profile files in Zeus's JSON format (the only file I/O of the power-limit package).

`{"measurements": [{"power_limit": W, "energy": J, "time": s}, ...]}`, highest limit first, as
Zeus's `GlobalPowerLimitOptimizer` writes with `profile_path` and reads back; files are
interchangeable with Zeus's.

* `save_profile(path, measurements)`: write a profile (highest limit first).
* `load_profile(path)`: read and validate a profile; pass it to `PowerLimitStateMachine` as
  `measurements`.
"""

from __future__ import annotations

from collections.abc import Sequence
from os import PathLike
from pathlib import Path

from pydantic import BaseModel

from zeus_agent.models import PowerLimitMeasurement

__all__ = ["load_profile", "save_profile"]


class _PowerLimitMeasurementList(BaseModel):
    """Proxy class to save and load a list of `PowerLimitMeasurement`s (Zeus's file layout)."""

    measurements: list[PowerLimitMeasurement]


def save_profile(path: str | PathLike[str], measurements: Sequence[PowerLimitMeasurement]) -> None:
    """Write measurements to a Zeus profile file, highest power limit first.

    Args:
        path: File to write (replaced if it exists).
        measurements: The measurements, in any order.

    Raises:
        ValueError: `measurements` is empty.
    """
    if not measurements:
        raise ValueError("Refusing to save an empty profile: profile at least one power limit.")
    ordered = sorted(measurements, key=lambda m: m.power_limit, reverse=True)
    text = _PowerLimitMeasurementList(measurements=ordered).model_dump_json(indent=4)
    Path(path).write_text(text, encoding="utf-8")


def load_profile(path: str | PathLike[str]) -> list[PowerLimitMeasurement]:
    """Read a Zeus profile file.

    Args:
        path: The file.

    Returns:
        The measurements, in file order (Zeus writes them highest limit first).

    Raises:
        OSError: The file cannot be read.
        pydantic.ValidationError: The file is not a valid profile (a `ValueError`).
    """
    text = Path(path).read_text(encoding="utf-8")
    return _PowerLimitMeasurementList.model_validate_json(text).measurements
