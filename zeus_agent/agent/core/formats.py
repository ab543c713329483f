"""`ColumnsChoice`: whether a job's batches go out in columns now (`--measurement-columns`).

`on` and `off` decide alone. `auto` (the default) sends a job's batches in columns only while
its owner is heard reading them and no coordinator heard does not: the agent hears the owners
of its jobs through their lease renewals (`zeus_agent.wire.formats`: a renewal of holder
`<job>` says whether its sender reads columns, and for how long it counts: its lease).

* A job's batches go only to its owner, so its owner's word counts, not another's: a job whose
  rank is bound here but that holds no lease on the node (a pipeline job observing its first
  iteration, a job before its first limit) has an owner the agent does not hear, perhaps an
  older replica, and gets rows. Its owner's latest renewal is its word (a job handed to an
  older replica: rows from that replica's first renewal on).
* An older coordinator heard (a renewal without the header) sends every job back to rows for
  that renewal's lease: during a rolling upgrade a job may be handed to it next.
* With no coordinator heard at all (no lease held, or none renewed for a lease) it sends rows,
  which every coordinator reads.
* A node's rank registrations try columns unless an older coordinator is heard (`try_columns`:
  a refused batch goes again in rows, `zeus_agent.agent.rank_relay`).

Pure: the caller gives the time (monotonic s).
"""

from __future__ import annotations

import math
from typing import Literal, get_args

__all__ = ["COLUMNS_MODES", "ColumnsChoice", "ColumnsMode"]

ColumnsMode = Literal["auto", "on", "off"]
COLUMNS_MODES: tuple[str, ...] = get_args(ColumnsMode)
_PRUNE_AT = 64
"""Holders remembered before those whose renewals' leases ended are forgotten."""


class ColumnsChoice:
    """The layout of the agent's batches, from the coordinators it hears (`heard`)."""

    def __init__(self, mode: ColumnsMode = "auto") -> None:
        if mode not in COLUMNS_MODES:
            raise ValueError(f"mode must be one of {', '.join(COLUMNS_MODES)}, not {mode!r}")
        self.mode = mode
        self._owners: dict[str, tuple[bool, float]] = {}
        """Holder (a job id) -> whether its latest renewal's sender reads columns, its end."""
        self._rows_until = -math.inf
        """Until when one heard does not read columns (rows until then, whatever else is heard)."""
        self._prune_at = _PRUNE_AT

    def heard(self, reads_columns: bool, lease_s: float, now: float, holder: str) -> None:
        """`holder`'s owner renewed its leases for `lease_s`; it reads columns or it does not."""
        until = now + lease_s
        self._owners[holder] = (reads_columns, until)
        if not reads_columns:
            self._rows_until = max(self._rows_until, until)
        if len(self._owners) > self._prune_at:  # (Jobs come and go: forget those gone.)
            self._owners = {h: o for h, o in self._owners.items() if o[1] > now}
            self._prune_at = max(_PRUNE_AT, 2 * len(self._owners))

    def try_columns(self, now: float) -> bool:
        """Whether to try columns where a refusal is heard and answered (rank registrations).

        `auto`: unless a coordinator heard does not read them (its renewal's lease not over);
        none heard (no lease yet, as when a job's ranks first register) is no reason not to.
        """
        if self.mode != "auto":
            return self.mode == "on"
        return self._rows_until <= now

    def columns(self, now: float, job_id: str | None = None) -> bool:
        """Whether to send `job_id`'s batches in columns at `now`.

        None: whether any job's are (`/healthz`'s `layout`).
        """
        if self.mode != "auto":
            return self.mode == "on"
        if now < self._rows_until:
            return False
        if job_id is None:
            return any(reads and now < until for reads, until in self._owners.values())
        reads, until = self._owners.get(job_id, (False, -math.inf))
        return reads and now < until
