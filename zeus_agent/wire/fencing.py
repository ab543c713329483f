"""The fencing token of a GPU command: the `Zeus-Lease` NATS header.

A coordinator sets `LEASE_HEADER` on every command it sends for a job: the owner's name,
incarnation, lease revision, lease end (`until`, wall-clock s) and the lease's key (the job's
hash in the ownership bucket), space-separated. An agent refuses a command whose lease has
ended by its clock, or whose revision is older than one it has already taken from another
owner for the same key (`zeus_agent.agent.core.fencing`). A command without the header
(an older coordinator, a tool, a test) is taken unfenced; the header changes no payload.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LEASE_HEADER", "SenderLease", "parse_lease_header"]

LEASE_HEADER = "Zeus-Lease"


@dataclass(frozen=True)
class SenderLease:
    """Who sent a command and under which ownership lease (the command's fencing token).

    Attributes:
        owner: The sending replica's name.
        incarnation: Its process's incarnation ("" if none).
        revision: The lease's revision in the ownership bucket (grows with every write).
        until: When the lease ends (wall-clock s).
        key: The lease's key (the job's hash); "" from senders that did not name it.
    """

    owner: str
    incarnation: str
    revision: int
    until: float
    key: str = ""

    def header(self) -> str:
        """The value of `LEASE_HEADER` that carries it."""
        value = f"{self.owner} {self.incarnation or '-'} {self.revision} {self.until:.6f}"
        return f"{value} {self.key}" if self.key else value


def parse_lease_header(value: str | None) -> SenderLease | None:
    """The lease a `LEASE_HEADER` value names (None: absent or malformed)."""
    if not value:
        return None
    parts = value.split()
    if len(parts) not in (4, 5):
        return None
    try:
        return SenderLease(parts[0], "" if parts[1] == "-" else parts[1], int(parts[2]),
                           float(parts[3]), parts[4] if len(parts) == 5 else "")
    except ValueError:
        return None
