"""Which payload layouts a coordinator reads: the `Zeus-Reads` NATS header of its renewals.

Agents send a node's marks and measurements (`NodeColumnBatch`) and a rank's trainer events
(`TrainerEventColumns`) in columns only to coordinators that read them: an older one drops
them as malformed. A coordinator that reads them says so on every lease renewal it publishes
(`LeaseRenewal`, `<p>.lease.<holder>`), the message every agent holding one of its jobs'
leases already hears, in a header: `READS_HEADER: COLUMNS`. A header, not a field, so an older
agent (its `extra="forbid"` models) still decodes the renewal; an older coordinator sends none,
and its agents hear that (`zeus_agent.agent.core.formats`). Values are space-separated
tokens, `<layout>/<version>`: a later layout adds a token, an unknown one is ignored.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["COLUMNS", "READS_HEADER", "reads_columns", "reads_headers"]

READS_HEADER = "Zeus-Reads"
COLUMNS = "columns/1"
"""The coordinator decodes `NodeColumnBatch` and `TrainerEventColumns` (`columns: 1`)."""


def reads_headers() -> dict[str, str]:
    """The headers a coordinator of this version sets on its lease renewals."""
    return {READS_HEADER: COLUMNS}


def reads_columns(headers: Mapping[str, str] | None) -> bool:
    """Whether a renewal's headers say its coordinator reads columns (None: no headers)."""
    if not headers:
        return False
    value = headers.get(READS_HEADER)
    return isinstance(value, str) and COLUMNS in value[:200].split()
