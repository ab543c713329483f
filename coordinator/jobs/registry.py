"""`JobRegistry`: jobs, ranks and their GPU bindings, as a pure in-memory core.

Invariants:
1. A job id is made by Zeus 0.16's `JobInfo.set_job_id` (`%F-%H-%M-%S+dp+pp+tp+Scheduler[+meta]`);
   if that id is taken (two jobs of the same shape in the same second), `+2`, `+3`, ... is
   appended so ids stay unique. Taken: known here, or refused by the shared state (another
   replica holds it, or is recording it: `refuse_id`), so a replica never offers an id twice
   however far its view lags; the refused ids of the current second only are kept.
2. A rank is registered once per job. Registering the same rank again with the same
   `RankInfo` and GPU is idempotent (a retry); with anything different it is a `DuplicateError`.
   Two ranks of one job may not drive the same GPU (checked through a per-job index, so
   registering n ranks costs O(n), not O(n^2)).
3. A rank's coordinates must fit the job: rank < world_size, dp_rank < dp_degree, etc.
   `check_rank` validates without changing anything (the shell calls it before asking the
   GPU's agent); `register_rank` validates again and records.
4. A job registered by a trainer of user id U (as its agent saw it on the socket) accepts
   only ranks of user U (`ForbiddenError`): another user cannot take a rank of it. A job
   registered with a join token accepts only ranks that present it (`ForbiddenError`): a
   process of the same user that learnt or guessed the job id cannot take a rank either. Only
   the token's SHA-256 digest is kept (and persisted); the caller makes the token.
5. Quotas: at most `max_jobs` jobs, and at most `max_jobs_per_node` registered through one
   node's agent (`QuotaError`), so one node cannot fill the coordinator. `unregister_job` and
   `unregister_rank` undo a registration that could not be persisted.
6. Time is an argument (`now_s`, any monotonic clock of the caller); `collect_idle` removes
   jobs idle longer than the limit. Nothing here does I/O: `snapshot`/`restore` give the
   service plain data to persist.
"""

from __future__ import annotations

import functools
import hmac
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from zeus_agent.errors import ReplyError
from zeus_agent.models import MAX_ID_CHARS, JobInfo, RankInfo
from zeus_agent.wire.messages import (
    GpuBinding,
    PowerLimitOptions,
    RegisterJob,
    RegisterRank,
    join_token_digest,
)

_presented_digest = functools.lru_cache(maxsize=1024)(join_token_digest)
"""`join_token_digest` of the tokens ranks present, kept for the most recent jobs' tokens: every
rank of a job presents the same one (a SHA-256 each for 16,384 ranks registering together)."""


class RegistryError(ReplyError):
    """A registration was refused. `code` is the wire error code."""

    code = "bad_request"


class UnknownJobError(RegistryError, KeyError):
    """No job has this id (never registered, or collected after being idle)."""

    code = "unknown_job"

    def __str__(self) -> str:
        return str(self.args[0])


class RankRangeError(RegistryError):
    """A rank's coordinates do not fit the job's degrees."""

    code = "out_of_range"


class QuotaError(RegistryError):
    """Too many jobs (in all, or registered through one node)."""

    code = "quota"


class ForbiddenError(RegistryError):
    """The rank may not join the job (another user's job)."""

    code = "forbidden"


class DuplicateError(RegistryError):
    """The rank (or its GPU) is already registered differently."""

    code = "duplicate"


@dataclass
class RankRecord:
    """One registered rank."""

    info: RankInfo
    gpu: GpuBinding
    _plain: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)

    def plain(self) -> dict[str, Any]:
        """JSON-able data (computed once: a registered rank never changes)."""
        if self._plain is None:
            self._plain = {"info": self.info.model_dump(), "gpu": self.gpu.model_dump()}
        return self._plain

    @classmethod
    def from_plain(cls, data: dict[str, Any]) -> RankRecord:
        """Rebuild from `plain()` data (raises KeyError, TypeError, ValueError if it is not)."""
        return cls(RankInfo(**data["info"]), GpuBinding(**data["gpu"]))


@dataclass
class JobRecord:
    """One registered job."""

    job_id: str
    job: JobInfo
    scheduler: str
    power_limit: PowerLimitOptions | None
    created_s: float
    last_active_s: float
    node: str = ""
    """The node whose agent registered the job (for per-node quotas)."""
    uid: int | None = None
    """The user id of the trainer that registered the job (its ranks must share it)."""
    join_digest: str | None = None
    """SHA-256 (hex) of the job's join token, which every rank must present; None: no token
    (a job registered before tokens existed)."""
    ranks: dict[int, RankRecord] = field(default_factory=dict)
    gpu_ranks: dict[tuple[str, int], int] = field(default_factory=dict, repr=False)
    """Index (node, GPU index) -> rank, kept in step with `ranks`."""
    node_ranks: bool = field(default=True, compare=False, repr=False)
    """Whether the durable state records this job's ranks in node entries (a job recorded
    by a coordinator of state layout 3 or later); False: one entry per rank, as a job recorded
    by an older coordinator keeps (`coordinator.state.records`)."""

    def admits(self, digest: str | None) -> bool:
        """Whether a join token with this digest (None: no token) is the job's own."""
        if self.join_digest is None:
            return True  # A job from before join tokens.
        return digest is not None and hmac.compare_digest(digest, self.join_digest)

    def add_rank(self, rank: RankRecord) -> None:
        """Record a rank and index its GPU."""
        self.ranks[rank.info.rank] = rank
        self.gpu_ranks[(rank.gpu.node, rank.gpu.gpu_index)] = rank.info.rank

    def remove_rank(self, rank: int) -> RankRecord | None:
        """Forget a rank and its GPU's index entry; the rank's record (None: unknown)."""
        gone = self.ranks.pop(rank, None)
        if gone is not None:
            key = (gone.gpu.node, gone.gpu.gpu_index)
            if self.gpu_ranks.get(key) == rank:
                del self.gpu_ranks[key]
        return gone

    @property
    def complete(self) -> bool:
        """Whether every rank of the job has registered."""
        return len(self.ranks) == self.job.world_size

    def gpus(self) -> list[GpuBinding]:
        """The GPUs of the job, in rank order."""
        return [self.ranks[r].gpu for r in sorted(self.ranks)]

    def plain(self, with_ranks: bool = True) -> dict[str, Any]:
        """JSON-able data (the durable store keeps ranks apart: `with_ranks=False`)."""
        data: dict[str, Any] = {
            "job_id": self.job_id,
            "job": self.job.model_dump(),
            "scheduler": self.scheduler,
            "power_limit": self.power_limit.model_dump() if self.power_limit else None,
            "node": self.node,
            "uid": self.uid,
            "join_digest": self.join_digest,
        }
        if with_ranks:
            data["ranks"] = [rr.plain() for rr in self.ranks.values()]
        return data

    @classmethod
    def from_plain(cls, data: dict[str, Any], now_s: float) -> JobRecord:
        """Rebuild from `plain()` data; its idle clock starts at `now_s`.

        Raises:
            KeyError, TypeError, ValueError: The data is not a job record.
        """
        job_data = dict(data["job"])
        job_id = job_data.pop("job_id")
        job = JobInfo(**job_data)
        job.job_id = _typed(job_id, str, "job.job_id")  # (set after: JobInfo wants "" in)
        record = cls(
            job_id=_typed(data["job_id"], str, "job_id"),
            job=job,
            scheduler=_typed(data["scheduler"], str, "scheduler"),
            power_limit=_options(data["power_limit"]),
            created_s=now_s,
            last_active_s=now_s,
            node=_typed(data.get("node", ""), str, "node", MAX_SUBJECT_TOKEN_CHARS),
            uid=_uid(data.get("uid")),
            join_digest=_digest(data.get("join_digest")),
        )
        for rr in data.get("ranks", []):
            record.add_rank(RankRecord.from_plain(rr))
        return record


class JobRegistry:
    """Registered jobs by id."""

    def __init__(self, max_jobs: int = 10_000, max_jobs_per_node: int = 256,
                 max_ranks_per_node: int = 2048) -> None:
        self.jobs: dict[str, JobRecord] = {}
        self.max_jobs = max_jobs
        self.max_jobs_per_node = max_jobs_per_node
        self.max_ranks_per_node = max_ranks_per_node
        self._per_node: dict[str, int] = {}
        self._ranks_on: dict[str, int] = {}
        """Node -> ranks of every job registered on its GPUs."""
        self._reserved: dict[str, int] = {}
        """Node -> ranks on its GPUs being recorded right now (`reserve_rank`)."""
        self._refused: tuple[str, set[str]] = ("", set())
        """(stamp, ids): the ids of that second the shared state said were taken elsewhere."""

    def get(self, job_id: str) -> JobRecord:
        """The job with this id.

        Raises:
            UnknownJobError: No such job; the message lists what to check.
        """
        try:
            return self.jobs[job_id]
        except KeyError:
            raise UnknownJobError(
                f"unknown job {job_id!r}: register it first (rank 0 registers the job and passes "
                "the id to the other ranks), or it was removed after being idle"
            ) from None

    def register_job(
        self,
        request: RegisterJob,
        now_s: float,
        node: str = "",
        wall: datetime | None = None,
        join_token: str | None = None,
    ) -> JobRecord:
        """Register a job (through `node`'s agent) and give it an id (stamped with `wall`).

        `join_token` (made by the caller, e.g. `secrets.token_urlsafe`): every rank must present
        it; None: any rank of the job's user may join.

        Raises:
            QuotaError: `max_jobs` jobs are registered, or `max_jobs_per_node` through `node`.
        """
        if len(self.jobs) >= self.max_jobs:
            raise QuotaError(
                f"the coordinator holds {len(self.jobs)} jobs, its limit (max_jobs): wait for "
                "jobs to finish or be collected when idle, or raise the limit"
            )
        if self._per_node.get(node, 0) >= self.max_jobs_per_node:
            raise QuotaError(
                f"node {node!r} has registered {self._per_node[node]} jobs, the limit per node "
                "(max_jobs_per_node): wait for its jobs to finish or be collected when idle"
            )
        job = request.job.model_copy()
        job.set_job_id(request.scheduler, wall)
        base, n = job.job_id, 1
        stamp, refused = self._refused
        if stamp != _stamp(base):
            refused = set()
        while job.job_id in self.jobs or job.job_id in refused:
            n += 1
            job.job_id = f"{base}+{n}"
        record = JobRecord(
            job_id=job.job_id,
            job=job,
            scheduler=request.scheduler,
            power_limit=request.power_limit,
            created_s=now_s,
            last_active_s=now_s,
            node=node,
            uid=request.uid,
            join_digest=None if join_token is None else join_token_digest(join_token),
        )
        self._add(record)
        return record

    def refuse_id(self, job_id: str) -> None:
        """Never offer `job_id` again: the shared state holds it for another job.

        Called after `unregister_job` of a registration whose id another replica took first.
        Only the current second's refusals are kept (an id's stamp is its second: an older
        one is never offered again anyway), so this holds at most a second's worth of ids.
        """
        if self._refused[0] != _stamp(job_id):
            self._refused = (_stamp(job_id), set())
        self._refused[1].add(job_id)

    def _add(self, record: JobRecord) -> None:
        self.jobs[record.job_id] = record
        self._per_node[record.node] = self._per_node.get(record.node, 0) + 1
        for rr in record.ranks.values():
            self._count_rank(rr.gpu.node, 1)

    def _remove(self, job_id: str) -> JobRecord | None:
        record = self.jobs.pop(job_id, None)
        if record is not None:
            left = self._per_node.get(record.node, 1) - 1
            if left > 0:
                self._per_node[record.node] = left
            else:
                self._per_node.pop(record.node, None)
            for rr in record.ranks.values():
                self._count_rank(rr.gpu.node, -1)
        return record

    def _count_rank(self, node: str, delta: int) -> None:
        left = self._ranks_on.get(node, 0) + delta
        if left > 0:
            self._ranks_on[node] = left
        else:
            self._ranks_on.pop(node, None)

    def unregister_job(self, job_id: str) -> None:
        """Undo `register_job` (its persistence failed)."""
        self._remove(job_id)

    def unregister_rank(self, job_id: str, rank: int) -> None:
        """Undo a new rank's registration (not recorded, or undone by another replica)."""
        record = self.jobs.get(job_id)
        gone = record.remove_rank(rank) if record is not None else None
        if gone is not None:
            self._count_rank(gone.gpu.node, -1)

    def check_rank(self, request: RegisterRank, reserved: bool = False) -> bool:
        """Validate a rank registration without recording it.

        `reserved`: it holds a place in its node's quota (`reserve_rank`).

        Returns:
            True if the same rank is already registered identically (a retry), else False.

        Raises:
            UnknownJobError: The job is not registered.
            ForbiddenError: Another user's job, or a missing or wrong join token.
            RankRangeError: The rank does not fit the job's degrees.
            DuplicateError: The rank or its GPU is registered differently.
        """
        record = self.get(request.job_id)
        if record.uid is not None and request.uid != record.uid:
            raise ForbiddenError(
                f"job {record.job_id} belongs to another user: a job's ranks run as the user "
                "who registered it"
            )
        token = request.join_token
        if not record.admits(None if token is None else _presented_digest(token)):
            what = "a wrong" if token else "no"
            raise ForbiddenError(
                f"rank {request.rank_info.rank} of job {record.job_id} presented {what} join "
                "token: rank 0's registration returns it with the job id, and every rank "
                "presents it (zeus_agent.emit.init passes both to the other ranks over "
                "torch.distributed; without it, pass init(job_id=..., join_token=...))"
            )
        info, job = request.rank_info, record.job
        in_range = (info.rank < job.world_size and info.dp_rank < job.dp_degree
                    and info.pp_rank < job.pp_degree and info.tp_rank < job.tp_degree)
        for name, value, limit in () if in_range else (  # (Named only when one is out.)
            ("rank", info.rank, job.world_size),
            ("dp_rank", info.dp_rank, job.dp_degree),
            ("pp_rank", info.pp_rank, job.pp_degree),
            ("tp_rank", info.tp_rank, job.tp_degree),
        ):
            if value >= limit:
                raise RankRangeError(
                    f"{name} {value} is out of range for job {record.job_id} "
                    f"(dp{job.dp_degree} pp{job.pp_degree} tp{job.tp_degree}, "
                    f"world size {job.world_size}): it must be below {limit}"
                )
        return self._check_place(record, request, reserved)

    def _check_place(self, record: JobRecord, request: RegisterRank, reserved: bool) -> bool:
        """`check_rank`'s checks that the job's other ranks decide: a retry, or a place left.

        The rest (user, token, degrees) the job's record decides, and they never change.
        """
        info = request.rank_info
        existing = record.ranks.get(info.rank)
        if existing is not None:
            if existing.info == info and existing.gpu == request.gpu:
                return True
            raise DuplicateError(
                f"rank {info.rank} of job {record.job_id} is already registered with GPU "
                f"{existing.gpu.gpu_index} on {existing.gpu.node}; each rank registers once"
            )
        other_rank = record.gpu_ranks.get((request.gpu.node, request.gpu.gpu_index))
        if other_rank is not None:
            raise DuplicateError(
                f"GPU {request.gpu.gpu_index} on {request.gpu.node} already drives rank "
                f"{other_rank} of job {record.job_id}; give each rank its own GPU"
            )
        self._check_quota(request.gpu.node, 1 if reserved else 0)
        return False

    def reserve_rank(self, node: str) -> None:
        """Hold a place in `node`'s rank quota while a rank is recorded.

        Ranks checked side by side, before any is recorded, then cannot all pass the quota;
        `unreserve_rank` gives the place back.

        Raises:
            QuotaError: The node's ranks, recorded or being recorded, are at the limit.
        """
        self._check_quota(node, 0)
        self._reserved[node] = self._reserved.get(node, 0) + 1

    def unreserve_rank(self, node: str) -> None:
        """Give back a place `reserve_rank` held (the rank is recorded, or refused)."""
        left = self._reserved.get(node, 0) - 1
        if left > 0:
            self._reserved[node] = left
        else:
            self._reserved.pop(node, None)

    def _check_quota(self, node: str, own: int) -> None:
        held = self._ranks_on.get(node, 0) + self._reserved.get(node, 0) - own
        if held >= self.max_ranks_per_node:
            raise QuotaError(
                f"node {node!r} has {held} ranks registered (or being registered) on its GPUs, "
                "the limit per node (max_ranks_per_node): wait for jobs to finish or be "
                "collected when idle"
            )

    def register_rank(self, request: RegisterRank, now_s: float,
                      reserved: bool = False) -> tuple[JobRecord, bool]:
        """Register a rank; returns the job and whether the rank is new (False: a retry).

        `reserved`: it holds a place in its node's quota (`reserve_rank`), still to give back.

        Raises:
            UnknownJobError: The job is not registered.
            RankRangeError: The rank does not fit the job's degrees.
            DuplicateError: The rank or its GPU is registered differently.
        """
        return self._register(request, now_s, self.check_rank(request, reserved))

    def register_checked(self, request: RegisterRank, now_s: float,
                         checked: JobRecord) -> tuple[JobRecord, bool]:
        """`register_rank` (not `reserved`) for a rank `check_rank` passed against `checked`.

        While the job's record is still `checked` (not forgotten nor replaced meanwhile), only
        what may have changed since is checked again: its rank or GPU taken, its node's quota.
        One check a rank, not two, for a node's batch (`Endpoints._record_node`).
        """
        if self.jobs.get(request.job_id) is not checked:
            return self.register_rank(request, now_s)
        return self._register(request, now_s, self._check_place(checked, request, False))

    def _register(self, request: RegisterRank, now_s: float,
                  retry: bool) -> tuple[JobRecord, bool]:
        record = self.jobs[request.job_id]
        record.last_active_s = now_s
        if not retry:
            record.add_rank(RankRecord(info=request.rank_info, gpu=request.gpu))
            self._count_rank(request.gpu.node, 1)
        return record, not retry

    def touch(self, job_id: str, now_s: float) -> None:
        """Mark a job active (an event arrived)."""
        if job_id in self.jobs:
            self.jobs[job_id].last_active_s = now_s

    def collect_idle(self, now_s: float, max_idle_s: float) -> list[str]:
        """Remove and return the ids of jobs idle for more than `max_idle_s`."""
        idle = [j for j, r in self.jobs.items() if now_s - r.last_active_s > max_idle_s]
        for job_id in idle:
            self._remove(job_id)
        return idle

    # ------------------------------------------------------------------ replicas, persistence
    def apply_job(self, record: JobRecord) -> bool:
        """Take a job registered elsewhere (another replica, the durable store).

        Returns False if a job with that id is already known (kept as it is).
        """
        if record.job_id in self.jobs:
            return False
        self._add(record)
        return True

    def apply_rank(self, job_id: str, rank: RankRecord, now_s: float) -> bool:
        """Take a rank registered elsewhere; False if the job is unknown or the rank known."""
        record = self.jobs.get(job_id)
        if record is None or rank.info.rank in record.ranks:
            return False
        if (rank.gpu.node, rank.gpu.gpu_index) in record.gpu_ranks:
            return False  # Its GPU drives another rank: a registration being undone.
        record.add_rank(rank)
        self._count_rank(rank.gpu.node, 1)
        record.last_active_s = now_s
        return True

    def drop_job(self, job_id: str) -> JobRecord | None:
        """Forget a job removed elsewhere (collected by its owner)."""
        return self._remove(job_id)

    def snapshot(self) -> dict[str, Any]:
        """Plain data of every job (JSON-able), as the file store of earlier versions kept."""
        return {"jobs": [r.plain() for r in self.jobs.values()]}

    @classmethod
    def restore(
        cls, data: dict[str, Any], now_s: float, max_jobs: int = 10_000,
        max_jobs_per_node: int = 256,
    ) -> JobRegistry:
        """Rebuild a registry from `snapshot()` data; idle clocks restart at `now_s`.

        Quotas apply to new registrations only: restored jobs are all kept.
        """
        registry = cls(max_jobs, max_jobs_per_node)
        for j in data.get("jobs", []):
            registry._add(JobRecord.from_plain(j, now_s))
        return registry


MAX_SUBJECT_TOKEN_CHARS = 4096
"""Longest node a job record may name: the subject token it was registered through (NATS's
control line holds 4 KiB)."""


def _stamp(job_id: str) -> str:
    """The second a job id was made in (its `%F-%H-%M-%S` part)."""
    return job_id.split("+", 1)[0]


def _typed(value: Any, kind: type, name: str, most: int = MAX_ID_CHARS) -> Any:
    """A recorded field checked for its type (and a string for its length)."""
    if not isinstance(value, kind) or (isinstance(value, str) and len(value) > most):
        raise ValueError(f"{name} must be a {kind.__name__}"
                         + (f" of at most {most} characters" if kind is str else ""))
    return value


def _uid(value: Any) -> int | None:
    if value is None:
        return None
    if type(value) is not int or not 0 <= value <= 2**32 - 1:
        raise ValueError("uid must be an integer in [0, 2**32 - 1] or null")
    return value


def _digest(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not re.fullmatch(r"[0-9a-f]{64}", value):
        raise ValueError("join_digest must be 64 hex digits or null")
    return value


def _options(data: dict[str, Any] | None) -> PowerLimitOptions | None:
    """Restored options; `profile_path` (a client's path, no longer accepted) is dropped."""
    if not data:
        return None
    return PowerLimitOptions(**{k: v for k, v in data.items() if k != "profile_path"})
