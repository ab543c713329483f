"""The layout of the coordinator's durable state in JetStream KV (pure: keys and values).

One bucket holds the state of every job, one key per fact, so a change writes only that fact
(never the whole registry):

| key | value |
|---|---|
| `v.job.<h>` | the job (`JobRecord.plain(with_ranks=False)`) |
| `v.rank.<h>.<rank>` | one registered rank (`RankRecord.plain()`, its GPU's limit range), once |
| `v.prog.<h>` | the job's optimiser progress (`JobOptimizer.persisted()`), or its profile |
| `gpu.<h>.<n>.<i>` | the rank driving GPU `i` of node digest `<n>` in the job (created once) |

Replicas follow the `v.` keys (`FOLLOWED`); the `gpu.` keys only make a GPU's binding unique.

`<h>` is a digest of the job id (KV keys allow few characters; job ids carry `+`, `:`...), so
every value names its job id. A second bucket, `<bucket>-owners`, holds one ownership lease per
job (`coordinator.state.ownership`). Values are versioned JSON (`"v": 1`): an operator can read
them with `nats kv get`.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from coordinator.jobs import JobRecord, RankRecord
from zeus_agent.wire.subjects import state_buckets as bucket_names

__all__ = ["bucket_names"]  # re-exported: the buckets' names live in the wire contract

VERSION = 2
"""Version of the values' layout (`"v"` in every value). 2: a job's value has `join_digest`; a
replica of version 1 would ignore it and accept ranks without the job's token, so it must not
read version 2 values (it refuses any other version, and then does not know the job)."""
READABLE = (1, 2)
"""Layouts this coordinator reads (a version-1 job has no join token: any rank of its user
may join, as before)."""

class RecordError(ValueError):
    """A value in the bucket is not what this version of the coordinator wrote."""


def _digest(text: str, chars: int) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:chars]


@functools.lru_cache(maxsize=4096)
def job_hash(job_id: str) -> str:
    """The key token of a job: 32 hex digits of the SHA-256 of its id."""
    return _digest(job_id, 32)


FOLLOWED = "v.>"
"""The keys every replica follows (the view); the others are locks."""


def job_key(job_id: str) -> str:
    """The key of a job's record."""
    return f"v.job.{job_hash(job_id)}"


def rank_key(job_id: str, rank: int) -> str:
    """The key of one rank of a job."""
    return f"v.rank.{job_hash(job_id)}.{rank}"


def gpu_key(job_id: str, node: str, gpu_index: int) -> str:
    """The key of one GPU binding of a job."""
    return f"gpu.{job_hash(job_id)}.{_digest(node, 16)}.{gpu_index}"


def progress_key(job_id: str) -> str:
    """The key of a job's optimiser progress."""
    return f"v.prog.{job_hash(job_id)}"


def job_keys_filter(job_id: str, kind: str) -> str:
    """The subject filter (within the bucket) of all `kind` keys ("rank", "gpu") of a job."""
    return f"{'v.' if kind == 'rank' else ''}{kind}.{job_hash(job_id)}.>"


def _dump(data: dict[str, Any]) -> bytes:
    return json.dumps({"v": VERSION, **data}, separators=(",", ":")).encode()


def _load(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RecordError(f"not JSON: {e}") from None
    if not isinstance(data, dict):
        raise RecordError("not a JSON object")
    if data.get("v") not in READABLE:
        raise RecordError(
            f"layout version {data.get('v')!r}, this coordinator reads {READABLE[0]} to "
            f"{READABLE[-1]}"
        )
    return data


def encode_job(record: JobRecord) -> bytes:
    """A job's value (without its ranks)."""
    return _dump(record.plain(with_ranks=False))


def encode_rank(job_id: str, rank: RankRecord,
                limits: tuple[int, int] | None = None) -> bytes:
    """A rank's value, with its GPU's power limit range when known.

    So the job's owner need not ask the GPU's agent again.
    """
    return _dump({"job_id": job_id, **rank.plain(), "limits": list(limits) if limits else None})


def encode_gpu(job_id: str, rank: int) -> bytes:
    """A GPU binding's value (the rank that drives it)."""
    return _dump({"job_id": job_id, "rank": rank})


def encode_progress(job_id: str, kind: str, state: Any) -> bytes:
    """A job's progress value.

    `kind`: "windows" (power-limit windows measured), "profile" (the measured profile) or
    "pipeline" (a pipeline job's discovered orders and observed rounds).
    """
    return _dump({"job_id": job_id, "kind": kind, "state": state})


@dataclass(frozen=True)
class Change:
    """One entry of the state bucket, decoded."""

    kind: str
    """"job", "rank", "gpu" or "prog"."""
    job_hash: str
    deleted: bool
    job: JobRecord | None = None
    job_id: str | None = None
    rank: RankRecord | None = None
    progress: dict[str, Any] | None = None
    limits: tuple[int, int] | None = None
    """A rank's GPU's power limit range (min, max) in W, when recorded."""


def decode(key: str, raw: bytes | None, deleted: bool, now_s: float) -> Change:
    """Decode one bucket entry (a deletion carries no value).

    Raises:
        RecordError: An unknown key or a value this version cannot read.
    """
    parts = key.split(".")
    if parts[0] == "v":
        parts = parts[1:]
    kind = parts[0]
    if kind not in ("job", "rank", "gpu", "prog") or len(parts) < 2:
        raise RecordError(f"unknown key {key!r}")
    if deleted or not raw:
        return Change(kind, parts[1], True)
    data = _load(raw)
    try:
        if kind == "job":
            record = JobRecord.from_plain(data, now_s)
            return Change(kind, parts[1], False, job=record, job_id=record.job_id)
        if kind == "rank":
            limits = data.get("limits")
            return Change(kind, parts[1], False, job_id=str(data["job_id"]),
                          rank=RankRecord.from_plain(data),
                          limits=(int(limits[0]), int(limits[1])) if limits else None)
        if kind == "prog":
            return Change(kind, parts[1], False, job_id=str(data["job_id"]),
                          progress={"kind": data["kind"], "state": data["state"]})
        return Change(kind, parts[1], False, job_id=str(data["job_id"]))
    except (KeyError, TypeError, ValueError) as e:
        raise RecordError(f"{key}: {e}") from None


def rank_of_gpu_value(raw: bytes) -> int:
    """The rank recorded under a `gpu.` key (raises RecordError)."""
    data = _load(raw)
    try:
        return int(data["rank"])
    except (KeyError, TypeError, ValueError) as e:
        raise RecordError(f"gpu binding: {e}") from None
