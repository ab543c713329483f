"""`History`: what a process did, one JSON object a line, for an outside checker.

An agent started with `--history FILE` records every GPU command it applied (with the replica
that sent it and that replica's ownership lease, the fencing token), every lease renewal and
every restore of a GPU's defaults; a coordinator records every write JetStream acknowledged
and every ownership lease it took. The chaos soak's checker (`zeus_demo.chaos.checker`) reads
these files; nothing in the services reads them back.

Each line is flushed as it is written, so a process killed by SIGKILL leaves every record it
made before the kill (the last line may be cut: readers skip a line that does not parse).

`LEASE_HEADER` is the NATS header a coordinator sets on every GPU command: the owner's name,
incarnation, lease revision and lease end (wall-clock s), space-separated. Agents that
predate it ignore it; it changes no payload of the wire contract.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["LEASE_HEADER", "History", "SenderLease", "parse_lease_header"]

LEASE_HEADER = "Zeus-Lease"


@dataclass(frozen=True)
class SenderLease:
    """Who sent a command and under which ownership lease (the command's fencing token)."""

    owner: str
    incarnation: str
    revision: int
    until: float

    def header(self) -> str:
        """The value of `LEASE_HEADER` that carries it."""
        return f"{self.owner} {self.incarnation or '-'} {self.revision} {self.until:.6f}"


def parse_lease_header(value: str | None) -> SenderLease | None:
    """The lease a `LEASE_HEADER` value names (None: absent or malformed)."""
    if not value:
        return None
    parts = value.split()
    if len(parts) != 4:
        return None
    try:
        return SenderLease(parts[0], "" if parts[1] == "-" else parts[1], int(parts[2]),
                           float(parts[3]))
    except ValueError:
        return None


class History:
    """An append-only JSON-lines file; `record` is safe from any thread."""

    def __init__(self, path: str, source: str) -> None:
        self.path = path
        self.source = source
        self._lock = threading.Lock()
        self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - kept open

    def record(self, kind: str, **fields: Any) -> None:
        """Append one record: its kind, wall-clock time, source and `fields`."""
        line = json.dumps({"kind": kind, "t": time.time(), "src": self.source, **fields},
                          separators=(",", ":"), default=str)
        with self._lock:
            if not self._file.closed:
                self._file.write(line + "\n")

    def close(self) -> None:
        """Stop recording (later records are dropped)."""
        with self._lock:
            self._file.close()
