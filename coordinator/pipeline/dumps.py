"""A job's dumps: `<dump_dir>/<job id>/` as Zeus 0.16 (a safe directory name), never overwritten."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import tempfile
from pathlib import Path

__all__ = ["job_dir_name", "keep_dump"]

_SAFE = re.compile(r"[A-Za-z0-9_\-+=:@,.]{1,200}")


def job_dir_name(job_id: str) -> str:
    """The job id itself when it is a safe file name, else a readable prefix and a digest.

    A job id ends with the trainer's `job_metadata`, which may hold '/' or '..': such an id
    never names a path outside the dump directory.
    """
    if _SAFE.fullmatch(job_id) and job_id not in (".", ".."):
        return job_id
    head = re.sub(r"[^A-Za-z0-9_\-+=:@,]", "_", job_id)[:64]
    return f"{head}~{hashlib.sha256(job_id.encode()).hexdigest()[:16]}"


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
    path.parent.mkdir(parents=True, exist_ok=True)
    stem = path.name.removesuffix(".json")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
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
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


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
