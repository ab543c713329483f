"""Where a job's dumps go: `<dump_dir>/<job id>/` as Zeus 0.16, with a safe directory name."""

from __future__ import annotations

import hashlib
import re

__all__ = ["job_dir_name"]

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
