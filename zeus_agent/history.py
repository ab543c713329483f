"""`History`: what a process did, one JSON object a line, for an outside checker.

An agent started with `--history FILE` records every GPU command it applied (with the replica
that sent it and that replica's ownership lease, the fencing token), every lease renewal and
every restore of a GPU's defaults; a coordinator records every write JetStream acknowledged
and every ownership lease it took. The chaos soak's checker (`zeus_demo.chaos.checker`) reads
these files; nothing in the services reads them back.

Each line is flushed as it is written, so a process killed by SIGKILL leaves every record it
made before the kill (the last line may be cut: readers skip a line that does not parse).

The fencing token recorded with each command is its `Zeus-Lease` header
(`zeus_agent.wire.fencing`).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

__all__ = ["History"]


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
