"""`ColumnsChoice`: whether the agent sends its batches in columns now (`--measurement-columns`).

`on` and `off` decide alone. `auto` (the default) sends columns only while every coordinator
the agent hears reads them: it hears the owners of its jobs through their lease renewals
(`zeus_agent.wire.formats`: a renewal says whether its sender reads columns, and for how long
it counts: its lease). Columns once a renewal from a coordinator that reads them is in its
lease, and none from one that does not is: an older coordinator heard sends the agent back to
rows for that renewal's lease (its jobs' batches must stay readable to it), and with no
coordinator heard at all (no lease held, or none renewed for a lease) it sends rows, which
every coordinator reads. Pure: the caller gives the time (monotonic s).
"""

from __future__ import annotations

import math
from typing import Literal, get_args

__all__ = ["COLUMNS_MODES", "ColumnsChoice", "ColumnsMode"]

ColumnsMode = Literal["auto", "on", "off"]
COLUMNS_MODES: tuple[str, ...] = get_args(ColumnsMode)


class ColumnsChoice:
    """The layout of the agent's batches, from the coordinators it hears (`heard`)."""

    def __init__(self, mode: ColumnsMode = "auto") -> None:
        if mode not in COLUMNS_MODES:
            raise ValueError(f"mode must be one of {', '.join(COLUMNS_MODES)}, not {mode!r}")
        self.mode = mode
        self._columns_until = -math.inf
        """Until when a coordinator heard reads columns (its renewal's lease end)."""
        self._rows_until = -math.inf
        """Until when one heard does not (rows until then, whatever else is heard)."""

    def heard(self, reads_columns: bool, lease_s: float, now: float) -> None:
        """A coordinator renewed leases for `lease_s`; it reads columns or it does not."""
        until = now + lease_s
        if reads_columns:
            self._columns_until = max(self._columns_until, until)
        else:
            self._rows_until = max(self._rows_until, until)

    def columns(self, now: float) -> bool:
        """Whether to send columns at `now`."""
        if self.mode != "auto":
            return self.mode == "on"
        return self._rows_until <= now < self._columns_until
