"""Files written whole: a reader sees the old content or the new one, never half of either.

* `written_beside(path, data)`: a context manager yielding a temporary file beside `path`
  (same directory, so a rename or link to `path` stays on one file system) that holds `data`;
  removed on leaving unless it was renamed away.
* `atomic_write(path, data, mode)`: write `data` there, give it `mode`, rename it over `path`.

Zeus's coordinator writes its dumps with `written_beside` and a hard link (never over another
file: `coordinator.pipeline.dumps.keep_dump`); credentials and results use `atomic_write`.
The simulated GPU's device files are rewritten in place instead (`zeus_agent.gpu.sim.store`:
a rename costs too much at every clock change, and a generation counter tells readers).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_write", "written_beside"]


@contextlib.contextmanager
def written_beside(path: str | os.PathLike[str], data: str | bytes) -> Iterator[str]:
    """A temporary file `.<name>.<random>.tmp` beside `path` holding `data` (text as UTF-8).

    The parent directory is created if needed. The file (mode 0600, as `mkstemp` makes it) is
    removed when the block ends, whatever happens, unless the block renamed it away.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        yield tmp
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def atomic_write(path: str | os.PathLike[str], data: str | bytes, mode: int = 0o644) -> None:
    """Replace `path` by a file holding `data` (text as UTF-8) with file mode `mode`, atomically.

    The data is written to a temporary file beside `path` (`written_beside`), which gets `mode`
    and is then renamed over `path`: readers see the old file or the new one. On an error the
    temporary file is removed and `path` is left as it was. The parent directory is created if
    needed.

    Raises:
        OSError: The directory or the file could not be written.
    """
    with written_beside(path, data) as tmp:
        os.chmod(tmp, mode)
        os.replace(tmp, path)
