"""What every benchmark stamps on its JSON line: the machine and the date."""

from __future__ import annotations

import datetime as dt
import os
import platform


def machine() -> str:
    """The host, CPU count, platform and Python version."""
    return (
        f"{platform.node()} {platform.machine()} {os.cpu_count()} cpu "
        f"{platform.platform()} python {platform.python_version()}"
    )


def now() -> str:
    """The current UTC time, ISO 8601 to the second."""
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
