"""A job's dumps and its scheduler's files, written. I/O edge: writes files.

* `keep_dump(path, content)`: a dump in `<dump_dir>/<job dir>/` as Zeus 0.16 lays them out
  (`coordinator.pipeline.paths.job_dir_name`: a safe directory name), never overwritten.
* `write_files(files)`: the files a scheduler produced (`FrequencyScheduler.take_files`: a
  profile, a frontier), each replacing what was there, atomically (`zeus_agent.fileio`); a
  file that cannot be written is logged and skipped (the scheduler keeps what it holds).
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from coordinator.pipeline.paths import job_dir_name
from coordinator.pipeline.schedulers.base import FileOut
from zeus_agent.fileio import atomic_write, written_beside

__all__ = ["job_dir_name", "keep_dump", "write_file", "write_files"]

logger = logging.getLogger(__name__)


def write_file(path: str, content: str, what: str) -> bool:
    """Write a produced file whole, replacing it (`atomic_write`); False if it cannot be.

    `what` names it in the log ("the frontier").
    """
    try:
        atomic_write(path, content)
    except OSError as e:  # The scheduler still holds it (its result, its frontier).
        logger.error("cannot write %s to %s: %s", what, path, e)
        return False
    logger.info("%s written to %s", what, path)
    return True


def write_files(files: Iterable[FileOut]) -> None:
    """Write each file a scheduler produced (`write_file`), in order."""
    for file in files:
        write_file(file.path, file.content, file.what)


def keep_dump(path: Path, content: str) -> Path | None:
    """Write a dump file whole, never over another file; returns where (None: already there).

    A coordinator killed after dumping `<n>.prof.json` but before recording that round's
    progress profiles the schedule again once restarted: the first dump stays, the new one is
    written as `<n>.prof.rerun-<k>.json`. A file already holding `content` is left as it is;
    one that cannot be read (binary, a directory) counts as different. The dump is written to
    a temporary file and linked to its name, which fails if the name is taken: two writers
    never overwrite each other, and no reader sees half a file.
    """
    data = content.encode()
    stem = path.name.removesuffix(".json")
    with written_beside(path, data) as tmp:
        target, k = path, 0
        while True:
            try:
                _link(tmp, target)
                return target
            except FileExistsError:
                if _holds(target, data):
                    return None
            k += 1
            target = path.with_name(f"{stem}.rerun-{k}.json")


def _link(tmp: str, target: Path) -> None:
    """Give `tmp` the name `target` unless it exists (`FileExistsError`)."""
    try:
        os.link(tmp, target)
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        # A file system without hard links: create the name exclusively, then fill it.
        with open(target, "xb") as f, open(tmp, "rb") as src:
            f.write(src.read())


def _holds(path: Path, data: bytes) -> bool:
    """Whether `path` is a file holding exactly `data` (unreadable: no)."""
    try:
        return path.stat().st_size == len(data) and path.read_bytes() == data
    except OSError:
        return False
