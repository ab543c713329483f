"""Where a job's files go: names only, nothing is read or written here. Pure.

A job's dumps (and, by default, the files its scheduler produces) go in `<dump_dir>/<job dir>/`,
as Zeus 0.16 lays them out, with a job directory name that is always safe (`job_dir_name`).
"""

from __future__ import annotations

import hashlib
import re

__all__ = ["job_dir_name", "job_file"]

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


def job_file(dump_dir: str, job_id: str, name: str) -> str:
    """`<dump_dir>/<job_dir_name(job_id)>/<name>`, joined as `os.path.join` joins them."""
    head = dump_dir if not dump_dir or dump_dir.endswith("/") else dump_dir + "/"
    return f"{head}{job_dir_name(job_id)}/{name}"
