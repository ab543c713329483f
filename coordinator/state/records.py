"""The layout of the coordinator's durable state in JetStream KV (pure: keys and values).

One bucket holds the state of every job, one key per fact, so a change writes only that fact
(never the whole registry):

| key | value |
|---|---|
| `v.job.<h>` | the job (`JobRecord.plain(with_ranks=False)`) |
| `v.ranks.<h>.<rank>` | ranks recorded together (a node's batch, or one), `<rank>` the first |
| `v.rank.<h>.<rank>` | one registered rank (`RankRecord.plain()`, its GPU's limit range), once |
| `v.prog.<h>` | the job's optimiser progress (`JobOptimizer.persisted()`), or its profile |
| `v.quar.<h>` | the job is set aside: a record of it cannot be loaded, or its optimiser failed |
| `gpu.<h>.<n>.<i>` | the rank driving GPU `i` of node digest `<n>` in the job (created once) |
| `rank.<h>.<rank>` | a rank of a node entry, as `v.rank.` holds one (created once) |
| `budget_timing.<h>` | the job's options as measured under a budget (`budget.store.TimingStore`) |
| `budget_frontier.<h>`, `budget_point.<h>` | a Perseus job's frontier, the point given it |

Replicas follow the `v.` keys (`FOLLOWED`); the `gpu.` and `rank.` keys only make a GPU's
binding and a rank unique. A job recorded at layout 3 (`JobRecord.node_ranks`) has its ranks in
node entries: one `v.ranks.` entry per node's batch, so a replica follows a few thousand entries
for 16,384 ranks, not one each; every rank in one also has its `rank.` key, created in the same
atomic batch (`JetStreamState.create_node_ranks`). A job recorded earlier keeps one `v.rank.`
entry per rank (the key is the rank's uniqueness): a replica of layout 2 that knows the job may
still register its ranks, and would not see a `rank.` key. Readers take both forms.

`<h>` is a digest of the job id (KV keys allow few characters; job ids carry `+`, `:`...), so
every value names its job id. A second bucket, `<bucket>-owners`, holds one ownership lease per
job (`coordinator.state.ownership`). Values are versioned JSON (`"v": 1`): an operator can read
them with `nats kv get`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from coordinator.jobs import JobRecord, RankRecord
from zeus_agent.models import MAX_POWER_W, RankInfo
from zeus_agent.wire.messages import MAX_ENERGY_PERIOD_MS, GpuBinding
from zeus_agent.wire.subjects import state_buckets as bucket_names
from zeus_agent.wire.text import bounded

__all__ = ["bucket_names"]  # re-exported: the buckets' names live in the wire contract

VERSION = 3
"""Version of the values' layout (`"v"` in every value). 2: a job's value has `join_digest`; a
replica of version 1 would ignore it and accept ranks without the job's token, so it must not
read version 2 values (it refuses any other version, and then does not know the job). 3: a job's
ranks are in node entries (`v.ranks.`, with a `rank.` key each); a replica of version 2 would
not see them (it drops the unknown key) and could register a rank again, so it must not read
version 3 values (then it does not know the job and registers none of its ranks)."""
RANK_VERSION = 2
"""Version written in a rank's and a GPU binding's values, whose layout 3 left as it was: a
replica of layout 2 still serving a job of layout 2 reads the ranks a replica of layout 3 records
for it (one `v.rank.` entry each); at 3 it would drop them, never see them in, nor start the job.
It never reads those of a job of layout 3 (their keys are not followed, or not known to it)."""


def layout_of(record: JobRecord | None) -> int:
    """The version to write a job's progress and quarantine note at: the job's own layout.

    A job of layout 2 may be served by a replica of layout 2 (its owner after a handover),
    which must read them; one of layout 3 (or unknown) is not a layout-2 replica's to read.
    """
    return RANK_VERSION if record is not None and not record.node_ranks else VERSION
READABLE = (1, 2, 3)
"""Layouts this coordinator reads (a version-1 job has no join token: any rank of its user
may join, so jobs written before join tokens keep running)."""

class RecordError(ValueError):
    """A value in the bucket is not what this version of the coordinator wrote."""


class NewerRecordError(RecordError):
    """A value of a newer layout (a newer replica's, during an upgrade): not a bad record."""


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


def node_key(job_id: str, first_rank: int) -> str:
    """The key of ranks recorded together (a node entry), by the first of them."""
    return f"v.ranks.{job_hash(job_id)}.{first_rank}"


def rank_claim_key(job_id: str, rank: int) -> str:
    """The key that makes a rank of a node entry unique (not followed)."""
    return f"rank.{job_hash(job_id)}.{rank}"


def gpu_key(job_id: str, node: str, gpu_index: int) -> str:
    """The key of one GPU binding of a job."""
    return f"gpu.{job_hash(job_id)}.{_node_digest(node)}.{gpu_index}"


@functools.lru_cache(maxsize=16384)
def _node_digest(node: str) -> str:
    """A node's key token: 16 hex digits of its name's SHA-256 (one per rank registered)."""
    return _digest(node, 16)


def progress_key(job_id: str) -> str:
    """The key of a job's optimiser progress."""
    return f"v.prog.{job_hash(job_id)}"


TIMING_PREFIX = "budget_timing."
"""A Perseus job's options as measured under a budget (`budget.store.TimingStore`)."""


def timing_key(job_hash_: str) -> str:
    """The key of a job's options as measured under a power budget.

    Outside the `v.` keys: only the budgets' owner reads it (`coordinator.budget.store`).
    """
    return TIMING_PREFIX + job_hash_


FRONTIER_PREFIX = "budget_frontier."
"""A Perseus job's frontier, recorded by its driver for the budgets (`budget.remote`)."""
POINT_PREFIX = "budget_point."
"""The frontier point the budgets' owner gives a job another replica drives."""


def budget_keys(job_hash_: str) -> tuple[str, ...]:
    """The keys the budgets keep of a job (purged with the job)."""
    return timing_key(job_hash_), FRONTIER_PREFIX + job_hash_, POINT_PREFIX + job_hash_


def job_keys_filter(job_id: str, kind: str) -> str:
    """The subject filter (within the bucket) of all `kind` keys of a job.

    `kind`: "rank" (`v.rank.`), "ranks" (`v.ranks.`), "claim" (`rank.`) or "gpu".
    """
    return hash_keys_filter(job_hash(job_id), kind)


def hash_keys_filter(job_hash: str, kind: str) -> str:
    """`job_keys_filter` of the job whose key token is `job_hash`."""
    prefix = {"rank": "v.rank", "ranks": "v.ranks", "claim": "rank"}.get(kind, kind)
    return f"{prefix}.{job_hash}.>"


MANY_KINDS = ("rank", "ranks", "claim", "gpu")
"""The kinds of which a job has many keys (`hash_keys_filter`: purged by subject)."""


def quarantine_key(job_hash: str) -> str:
    """The key of a job's quarantine note (by its key token: a bad record may name no job)."""
    return f"v.quar.{job_hash}"


def hash_of_key(key: str) -> str | None:
    """The job key token a key of the bucket names (None: a key of no job)."""
    parts = key.split(".")
    if parts[0] == "v":
        parts = parts[1:]
    if len(parts) >= 2 and parts[0] in KINDS and len(parts[1]) == 32:
        return parts[1]
    return None


KINDS = ("job", "rank", "ranks", "gpu", "prog", "quar")
"""The kinds of keys (`v.<kind>.<h>...`, `gpu.<h>...`, `rank.<h>...`)."""


_ENCODE = json.JSONEncoder(separators=(",", ":")).encode
"""`json.dumps(..., separators=...)`, without building an encoder per value (thousands a
registration)."""


_ascii_json = json.encoder.encode_basestring_ascii
"""A string as JSON, as `json.dumps` writes it (ASCII only)."""


def _dump(data: dict[str, Any], version: int = VERSION) -> bytes:
    return _ENCODE({"v": version, **data}).encode()


def _load(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise RecordError(f"not JSON: {bounded(e, 300)}") from None
    if not isinstance(data, dict):
        raise RecordError("not a JSON object")
    if data.get("v") not in READABLE:
        newer = isinstance(data.get("v"), int) and data["v"] > READABLE[-1]
        raise (NewerRecordError if newer else RecordError)(
            f"layout version {data.get('v')!r}, this coordinator reads {READABLE[0]} to "
            f"{READABLE[-1]}"
        )
    return data


def encode_job(record: JobRecord) -> bytes:
    """A job's value (without its ranks)."""
    return _dump(record.plain(with_ranks=False))


def encode_rank(job_id: str, rank: RankRecord, limits: tuple[int, int] | None = None,
                energy_period_ms: float | None = None) -> bytes:
    """A rank's value, with its GPU's power limit range and energy-counter period when known.

    Both come from the GPU's description: with `limits` the period is recorded, even if None.
    So the job's owner need not ask the GPU's agent again (a replica that did not relay the
    registration would otherwise ask `info` of every such GPU before starting the job).

    The JSON `_dump` would write (`{"v", "job_id", **rank.plain(), "limits"[,
    "energy_period_ms"]}`; non-ASCII text as UTF-8, not escaped), its models serialised by
    pydantic: one per registered rank, and dumping them to dicts for the general encoder took
    3 times as long.
    """
    try:  # (`model_dump_json`'s bytes, without its wrapper: a third of the time.)
        info = type(rank.info).__pydantic_serializer__.to_json(rank.info)
        gpu = type(rank.gpu).__pydantic_serializer__.to_json(rank.gpu)
    except ValueError:  # (Text pydantic cannot write: built without validation.)
        value: dict[str, Any] = {"job_id": job_id, **rank.plain(),
                                 "limits": list(limits) if limits else None}
        if limits:
            value["energy_period_ms"] = energy_period_ms
        return _dump(value, RANK_VERSION)
    period = b',"energy_period_ms":%s' % _number(energy_period_ms) if limits else b""
    return b'{"v":%d,"job_id":%s,"info":%s,"gpu":%s,"limits":%s}' % (
        RANK_VERSION, _ascii_json(job_id).encode(), info, gpu,
        b"[%s,%s]%s" % (_number(limits[0]), _number(limits[1]), period) if limits else b"null")


def encode_node(job_id: str, rank_values: list[bytes]) -> bytes:
    """A node entry's value: ranks' values (`encode_rank`'s, in rank order) in one list.

    `{"v", "job_id", "ranks": [...]}`: each rank's value is the one its `rank.` key holds, so
    a rank reads the same in either form.
    """
    return b'{"v":%d,"job_id":%s,"ranks":[%s]}' % (
        VERSION, _ascii_json(job_id).encode(), b",".join(rank_values))


def _number(value: Any) -> bytes:
    """A number (or None) as `_ENCODE` writes it; None, an int or a finite float directly.

    (None: a GPU whose agent knows no energy-counter period, on every rank it records.)
    """
    if value is None:
        return b"null"
    kind = type(value)
    if kind is int or (kind is float and math.isfinite(value)):
        return repr(value).encode()  # (What `json` writes for these.)
    return _ENCODE(value).encode()


def encode_gpu(job_id: str, rank: int) -> bytes:
    """A GPU binding's value (the rank that drives it).

    `_dump`'s bytes, formatted directly: one per registered rank, and the general encoder
    took 7 times as long.
    """
    return b'{"v":%d,"job_id":%s,"rank":%d}' % (RANK_VERSION, _ascii_json(job_id).encode(), rank)


def encode_quarantine(job_id: str | None, key: str, reason: str, replica: str,
                      at_s: float, version: int = VERSION) -> bytes:
    """A quarantine note: which record (`key`) of the job was set aside, why, by whom, when.

    `at_s` is wall-clock time (UNIX seconds), for people.
    """
    return _dump({"job_id": job_id, "key": bounded(key, 300), "reason": bounded(reason, 2000),
                  "replica": bounded(replica, 300), "at": at_s}, version)


def encode_progress(job_id: str, kind: str, state: Any, version: int = VERSION) -> bytes:
    """A job's progress value.

    `kind`: "windows" (power-limit windows measured), "profile" (the measured profile) or
    "pipeline" (a pipeline job's discovered orders and observed rounds).
    """
    return _dump({"job_id": job_id, "kind": kind, "state": state}, version)


@dataclass(slots=True)
class Change:
    """One entry of the state bucket, decoded (not to be changed: read-only by convention).

    Not a frozen dataclass: a node entry's ranks are one each, and a frozen one's `__init__`
    (one `object.__setattr__` per field) made them 5 times as long to build.
    """

    kind: str
    """"job", "rank", "ranks" (a node entry: `ranks`), "gpu", "prog" or "quar"."""
    job_hash: str
    deleted: bool
    job: JobRecord | None = None
    job_id: str | None = None
    rank: RankRecord | None = None
    progress: dict[str, Any] | None = None
    limits: tuple[int, int] | None = None
    """A rank's GPU's power limit range (min, max) in W, when recorded."""
    period_recorded: bool = False
    """Whether the rank's record carries its GPU's energy-counter period (`energy_period_ms`,
    which may be None: not known to the GPU's agent then)."""
    energy_period_ms: float | None = None
    quarantine: dict[str, Any] | None = None
    """A quarantine note (`encode_quarantine`'s fields)."""
    ranks: tuple[Change, ...] = ()
    """A node entry's ranks, each as its own "rank" change, in rank order."""


def _limits(raw: Any) -> tuple[int, int] | None:
    """A recorded power-limit range, refused unless 1 <= min <= max <= `MAX_POWER_W`."""
    if not raw:
        return None
    if not isinstance(raw, list) or len(raw) != 2 or not all(type(w) is int for w in raw):
        raise RecordError(f"limits must be [min, max] in W, got {bounded(raw, 100)}")
    lo, hi = raw
    if not 1 <= lo <= hi <= MAX_POWER_W:
        raise RecordError(f"limits [{lo}, {hi}] W are outside 1 <= min <= max <= {MAX_POWER_W}")
    return lo, hi


def _fast_limits(raw: Any) -> tuple[int, int] | None:
    """`_limits`, the common value taken without its checks' calls.

    Two ints in order and in range: once per rank of every node entry.
    """
    if type(raw) is list and len(raw) == 2:
        lo, hi = raw
        if type(lo) is int and type(hi) is int and 1 <= lo <= hi <= MAX_POWER_W:
            return lo, hi
    return _limits(raw)


def _period(raw: Any) -> float | None:
    """A recorded energy-counter period (ms), refused unless None or in the wire's bounds."""
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int | float) \
            or not 0 <= raw <= MAX_ENERGY_PERIOD_MS:
        raise RecordError(f"energy_period_ms must be 0..{MAX_ENERGY_PERIOD_MS} ms or null, got "
                          f"{bounded(raw, 100)}")
    return float(raw)


def _note(data: dict[str, Any]) -> dict[str, Any]:
    """A quarantine note's fields as this version shows them: strings bounded, a finite time.

    Whatever else a note holds is left out (it is shown in queries and `quarantine list`).
    """
    note: dict[str, Any] = {}
    for name in ("job_id", "key", "reason", "replica"):
        value = data.get(name)
        note[name] = bounded(value, 2000) if isinstance(value, str) else None
    at = data.get("at")
    finite = isinstance(at, int | float) and not isinstance(at, bool) and abs(at) < 1e12
    note["at"] = float(at) if finite and at is not None else None
    return note


def _job_id(data: dict[str, Any]) -> str:
    job_id = data["job_id"]
    if not isinstance(job_id, str):
        raise RecordError(f"job_id must be a string, got {type(job_id).__name__}")
    return job_id


class _RankValue(BaseModel):
    """A rank's value read in one pass from its JSON (`decode`'s fast path).

    Its models as `RankRecord.from_plain` builds them; every other field as the JSON has it,
    checked by `decode`'s own rules.
    """

    model_config = ConfigDict(extra="ignore")

    v: Any = None
    job_id: Any = None
    info: RankInfo
    gpu: GpuBinding
    limits: Any = None
    energy_period_ms: Any = None


def _rank_change(job_hash_: str, rank: str, raw: bytes) -> Change | None:
    """A rank entry decoded in one pass, or None: anything unusual is left to `decode`.

    What every replica does with every other replica's rank: `json.loads`, then the models
    built from dicts, took 3 times as long. It accepts only what `decode` accepts, and then
    gives what `decode` gives; anything else (not JSON, a bad field, another rank...) goes the
    general way, whose errors say what is wrong.
    """
    try:
        value = _RankValue.model_validate_json(raw)
    except (ValidationError, ValueError, RecursionError):
        return None
    job_id = value.job_id
    if (value.v not in READABLE or not isinstance(job_id, str) or job_hash(job_id) != job_hash_
            or not rank.isdigit() or value.info.rank != int(rank)):
        return None
    try:
        limits = _limits(value.limits)
        recorded = limits is not None and "energy_period_ms" in value.model_fields_set
        period = _period(value.energy_period_ms) if recorded else None
    except RecordError:
        return None
    return Change("rank", job_hash_, False, job_id=job_id,
                  rank=RankRecord(value.info, value.gpu), limits=limits,
                  period_recorded=recorded, energy_period_ms=period)


class _NodeValue(BaseModel):
    """A node entry's value read in one pass (`_node_change`)."""

    model_config = ConfigDict(extra="ignore")

    v: Any = None
    job_id: Any = None
    ranks: list[_RankValue]


def _node_change(job_hash_: str, first: str, raw: bytes) -> Change:
    """A node entry decoded: each rank checked as its own `v.rank.` entry would be.

    Raises:
        RecordError: Not a node entry of this job (or not readable by this version).
    """
    try:
        value = _NodeValue.model_validate_json(raw)
    except (ValidationError, ValueError, RecursionError) as e:
        _load(raw)  # (A newer layout's value says so: `NewerRecordError`.)
        raise RecordError(f"not a node entry: {bounded(e, 300)}") from None
    job_id = value.job_id
    if value.v not in READABLE:
        _load(raw)
    if not isinstance(job_id, str) or job_hash(job_id) != job_hash_:
        raise RecordError("the value names another job than its key")
    changes: list[Change] = []
    previous = -1
    for part in value.ranks:
        rank = part.info.rank
        if part.v not in READABLE or part.job_id != job_id:
            raise RecordError(f"rank {rank} of the entry is of another job or layout")
        if rank <= previous:
            raise RecordError("a node entry's ranks must be distinct, in rank order")
        previous = rank
        limits = _fast_limits(part.limits)
        recorded = limits is not None and "energy_period_ms" in part.model_fields_set
        period = part.energy_period_ms
        if recorded and not (type(period) is float and 0.0 <= period <= MAX_ENERGY_PERIOD_MS):
            period = _period(period)
        changes.append(Change("rank", job_hash_, False, job_id=job_id,
                              rank=RankRecord(part.info, part.gpu), limits=limits,
                              period_recorded=recorded,
                              energy_period_ms=period if recorded else None))
    if not changes or str(changes[0].rank.info.rank) != first:  # type: ignore[union-attr]
        raise RecordError("a node entry's key must name its first rank")
    return Change("ranks", job_hash_, False, job_id=job_id, ranks=tuple(changes))


def decode(key: str, raw: bytes | None, deleted: bool, now_s: float) -> Change:
    """Decode one bucket entry (a deletion carries no value).

    Raises:
        RecordError: An unknown key or a value this version cannot read.
    """
    parts = key.split(".")
    if raw and not deleted and len(parts) == 4 and parts[0] == "v" and parts[1] == "rank":
        fast = _rank_change(parts[2], parts[3], raw)
        if fast is not None:
            return fast
    if parts[0] == "v":
        parts = parts[1:]
    kind = parts[0]
    if kind not in KINDS or len(parts) < 2:
        raise RecordError(f"unknown key {bounded(key, 300)!r}")
    if deleted or not raw:
        return Change(kind, parts[1], True)
    if kind == "ranks":
        if len(parts) != 3 or not parts[2].isdigit():
            raise RecordError(f"a node entry's key must end with a rank: {bounded(key, 300)}")
        return _node_change(parts[1], parts[2], raw)
    data = _load(raw)
    try:
        if kind == "quar":
            note = _note(data)
            return Change(kind, parts[1], False, job_id=note["job_id"], quarantine=note)
        if kind == "rank" and (len(parts) != 3 or not parts[2].isdigit()):
            raise RecordError(f"a rank key must end with the rank's number: {bounded(key, 300)}")
        job_id = _job_id(data)
        if kind != "gpu" and job_hash(job_id) != parts[1]:
            raise RecordError(f"the value names job {bounded(job_id, 100)!r}, whose key "
                              "is another")
        if kind == "job":
            record = JobRecord.from_plain(data, now_s)
            if record.job_id != job_id:
                raise RecordError("the job's id differs from its record's")
            record.node_ranks = data["v"] >= 3
            return Change(kind, parts[1], False, job=record, job_id=job_id)
        if kind == "rank":
            rank = RankRecord.from_plain(data)
            if rank.info.rank != int(parts[2]):
                raise RecordError(f"the value is rank {rank.info.rank}, its key another")
            limits = _limits(data.get("limits"))
            recorded = limits is not None and "energy_period_ms" in data
            return Change(kind, parts[1], False, job_id=job_id, rank=rank, limits=limits,
                          period_recorded=recorded,
                          energy_period_ms=_period(data["energy_period_ms"]) if recorded else None)
        if kind == "prog":
            return Change(kind, parts[1], False, job_id=job_id,
                          progress={"kind": data["kind"], "state": data["state"]})
        return Change(kind, parts[1], False, job_id=job_id)
    except RecordError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError,
            MemoryError) as e:
        raise RecordError(f"{bounded(key, 300)}: {bounded(e, 500)}") from None


def rank_of_gpu_value(raw: bytes) -> int:
    """The rank recorded under a `gpu.` key (raises RecordError)."""
    data = _load(raw)
    try:
        return int(data["rank"])
    except (KeyError, TypeError, ValueError) as e:
        raise RecordError(f"gpu binding: {e}") from None
