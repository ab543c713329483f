"""A job's dumps: `<dump_dir>/<job id>/` as Zeus 0.16 (a safe directory name), never overwritten."""

from __future__ import annotations

import hashlib
import os
import re
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
    """Write a dump file atomically, never over a different one; returns where (None: kept).

    A coordinator killed after dumping `<n>.prof.json` but before recording that round's
    progress profiles the schedule again once restarted: the first dump stays, the new one is
    written as `<n>.prof.rerun-<k>.json`. A file already holding `content` is left as it is.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    stem = path.name.removesuffix(".json")
    target, k = path, 0
    while target.exists():
        if target.read_text() == content:
            return None
        k += 1
        target = path.with_name(f"{stem}.rerun-{k}.json")
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(content)
    os.replace(tmp, target)  # A kill mid-write leaves no half-written dump.
    return target
