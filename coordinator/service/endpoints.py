"""`Endpoints`: the coordinator's request handlers (a `nats.micro` service, queue group "coord").

* `<p>.coord.jobs.register.<node>`: `RegisterJob` -> `Reply{job_id, join_token}`;
* `<p>.coord.ranks.register.<node>`: `RegisterRank` -> `Reply{...}`; only through the agent of
  the rank's GPU's node (the subject's node, which NATS permissions tie to that agent's
  credentials); once every rank is in, the job's optimiser starts;
* `<p>.coord.jobs.query`: `JobQuery` -> `Reply{job or jobs}` (with the measured profile);
* `<p>.coord.jobs.straggler`: `StragglerNotice` -> `Reply{stragglers}` or a coded error.

Handlers are decode -> core -> encode; domain errors go out as coded `Reply`s
(`zeus_agent.errors.reply_for`). Each request runs in its own task (NATS runs a subscription's
callbacks one at a time, and a rank registration may wait for the GPU's agent), so thousands of
ranks register concurrently. A query or notice about a job another replica drives is forwarded
to that replica's own subject.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine
from datetime import datetime
from typing import Any

from coordinator.config import CoordinatorSettings
from coordinator.jobs import JobRecord, RankRecord
from coordinator.optimizer import StatusUpdate, StragglerError
from coordinator.pipeline.schedulers.settings import PFOServerSettings
from coordinator.service.actions import ActionExecutor
from coordinator.service.durable import DurableState
from coordinator.service.failures import JobFailures
from coordinator.service.gpus import GpuDirectory
from coordinator.service.leases import Leases
from coordinator.service.link import Link
from coordinator.service.node_writes import Item, NodeWrite, write_node
from coordinator.service.starter import OptimiserStarter
from coordinator.service.table import JobTable
from coordinator.state import records
from coordinator.state.jetstream import StateUnavailableError
from zeus_agent.errors import ReplyError, reply_for
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import (
    GpuDescription,
    JobQuery,
    RegisterJob,
    RegisterRank,
    Reply,
    StragglerNotice,
)
from zeus_agent.wire.rank_columns import decode_registration
from zeus_agent.wire.text import bounded, shown

__all__ = ["INTERNAL_REPLY", "Endpoints", "Handler"]

LOG = logging.getLogger(__name__)


def plain_reply(reply: Reply) -> dict[str, Any]:
    """A reply's fields as a dict, for a node's batch reply (pure).

    Encoded as `reply.model_dump()` would be (the batch's reply dumps its contents when it is
    encoded), without dumping each of thousands of ranks' replies once more first.
    """
    return dict(reply.__dict__)


_SUCCESS = plain_reply(Reply.success())


def plain_success(**result: Any) -> dict[str, Any]:
    """`plain_reply(Reply.success(**result))` without building the `Reply` (pure).

    One per rank of a node's batch: validating each rank's `Reply` was ~3 us a rank.
    """
    return {**_SUCCESS, "result": result}


Handler = Callable[[bytes, str], Awaitable[Reply]]
"""An endpoint handler: (request payload, request subject) -> reply."""

INTERNAL_REPLY = Reply.failure("internal", "internal error in the coordinator; see its log")
"""The answer to a request whose handling failed in a way the coordinator did not expect."""
JOIN_TOKEN_BYTES = 18
"""Randomness in a job's join token (144 bits; 24 URL-safe characters)."""
JOB_ID_TRIES = 64
"""Ids tried for one job before answering `unavailable`. Each try that fails is an id another
replica took in the same second for a job of the same shape (never offered again here), so
only a burst of that many same-shaped jobs on other replicas, in one second, exhausts it."""
RANK_STATUS_EVERY_UP_TO = 64
"""Jobs up to this world size get a status event per rank; bigger ones every 10 %."""


class Endpoints:
    """The request handlers (each request in its own task, through `spawn`)."""

    def __init__(self, *, settings: CoordinatorSettings, pfo: PFOServerSettings,
                 clock: Callable[[], float], jobs: JobTable, link: Link, leases: Leases,
                 gpus: GpuDirectory, durable: DurableState, starter: OptimiserStarter,
                 failures: JobFailures, actions: ActionExecutor,
                 spawn: Callable[[Coroutine[Any, Any, Any]], None]) -> None:
        self.settings = settings
        self.pfo = pfo
        self.clock = clock
        self.jobs = jobs
        self.link = link
        self.leases = leases
        self.gpus = gpus
        self.durable = durable
        self.starter = starter
        self.failures = failures
        self.actions = actions
        self.spawn = spawn

    def table(self) -> list[tuple[str, str, Handler]]:
        """(name, subject, handler) of every endpoint."""
        p = self.settings.prefix
        return [
            ("register_job", subjects.all_coord_register_job(p), self.register_job),
            ("register_rank", subjects.all_coord_register_rank(p), self.register_rank),
            ("query", subjects.coord_job_query(p), self.query),
            ("straggler", subjects.coord_job_straggler(p), self.straggler),
        ]

    def forwardable(self) -> list[tuple[str, Handler]]:
        """Endpoints the other replicas forward requests about this replica's jobs to."""
        return [("query", self.query), ("straggler", self.straggler), ("take", self.take_job)]

    # ------------------------------------------------------------------ wrapping
    def wrap(self, handler: Handler) -> Callable[[Any], Awaitable[None]]:
        """Wrap a handler: one task per request; domain errors become coded replies.

        Nothing that goes wrong with one request leaves its task (a task of the service's task
        group: an exception there would stop the whole service): a failure while handling it
        is answered `internal`, one while answering it is logged.
        """

        async def answer(req: Any) -> None:
            try:
                reply = await handler(req.data, req.subject)
            except Exception as e:  # noqa: BLE001 - never leak internals
                if not isinstance(e, ReplyError):
                    LOG.exception("request on %s failed", bounded(req.subject, 300))
                reply = reply_for(e, INTERNAL_REPLY.error)
            try:
                data = codec.encode(reply)
            except Exception:  # noqa: BLE001 - a reply that cannot be encoded is a bug here
                LOG.exception("the reply to a request on %s could not be encoded",
                              bounded(req.subject, 300))
                data = codec.encode(INTERNAL_REPLY)
            try:
                await req.respond(data)
            except Exception as e:  # noqa: BLE001 - the asker left, or NATS is gone
                LOG.warning("could not answer a request on %s: %s", bounded(req.subject, 300),
                            bounded(e, 300))

        async def handle(req: Any) -> None:
            try:
                inbox = getattr(getattr(req, "_msg", None), "reply", "") or ""
                if not inbox.startswith("_INBOX."):
                    # A reply subject aimed elsewhere would make the coordinator publish where
                    # its asker may not (NATS's allow_responses lets it answer any reply subject).
                    self.link.drop("reply_not_an_inbox", req.subject, shown(inbox, 300))
                    return
                await answer(req)
            except Exception:  # noqa: BLE001 - the last guard of the service's task group
                LOG.exception("a request on %s failed outside its handler",
                              bounded(getattr(req, "subject", "?"), 300))

        async def wrapped(req: Any) -> None:
            self.spawn(handle(req))

        return wrapped

    def wrap_own(self, handler: Handler) -> Callable[[Any], Awaitable[None]]:
        """Wrap a handler for this replica's own subject (requests forwarded by replicas)."""
        endpoint = self.wrap(handler)

        async def handle(msg: Any) -> None:
            await endpoint(_Forwarded(msg))

        return handle

    async def _forward(self, job_id: str, endpoint: str, data: bytes,
                       subject: str) -> Reply | None:
        """Ask the job's owning replica when it is another one (None: answer here).

        A request forwarded to this replica is answered here (never forwarded again).
        """
        owner = self.leases.book.owner(records.job_hash(job_id), time.time())
        if (owner is None or owner == self.leases.book.me or self.link.nc is None
                or subject.startswith(subjects.all_coord_replicas(self.settings.prefix)[:-1])):
            return None
        subject = subjects.coord_replica(owner, endpoint, self.settings.prefix)
        try:
            msg = await self.link.nc.request(subject, data, timeout=self.settings.command_timeout_s)
            return codec.decode(msg.data, Reply)
        except Exception as e:  # noqa: BLE001 - the owner died meanwhile: answer here
            LOG.warning("replica %s did not answer a %s about job %s: %s", owner, endpoint,
                        job_id, e)
            return None

    # ------------------------------------------------------------------ handlers
    async def register_job(self, data: bytes, subject: str = "") -> Reply:
        """Register a job (through the node named by the subject) and return its id."""
        request = codec.decode(data, RegisterJob)
        if request.power_limit is not None and request.scheduler != "PowerLimitOptimizer":
            return Reply.failure(
                "bad_request",
                f"a job with power_limit options runs the power-limit optimizer, not "
                f"{request.scheduler[:64]!r}: drop the scheduler, or the power_limit options",
            )
        if request.power_limit is None:  # A pipeline job: this coordinator's scheduler runs it.
            name = self.pfo.scheduler
            if request.scheduler not in ("PowerLimitOptimizer", name):
                return Reply.failure(
                    "bad_request",
                    f"this coordinator runs pipeline jobs with {name} (ZEUS_PFO_SCHEDULER), not "
                    f"{request.scheduler[:64]!r}: omit the scheduler, or ask its operator",
                )
            request = request.model_copy(update={"scheduler": name})
        node = subjects.last_token(subject)
        token = secrets.token_urlsafe(JOIN_TOKEN_BYTES)
        state = self.link.require_state()
        for _ in range(JOB_ID_TRIES):
            record = self.jobs.register(request, self.clock(), node, datetime.now(),
                                        join_token=token)
            try:
                created = await state.create_job(record)
            except BaseException:  # Unavailable, or cancelled: nothing of it stays here.
                self.jobs.abandon(record.job_id)
                raise
            if created:
                self.jobs.confirm(record.job_id)
                break
            # Another replica holds (or is recording) a job with this id: take the next one.
            self.jobs.refuse(record.job_id)
        else:
            raise StateUnavailableError("could not give the job a unique id; retry")
        if self.leases.should_take(record.job_id) or not await self._handed(record.job_id):
            await self.leases.take(record.job_id, 0, "registered here")
        what = "power-limit optimisation" if request.power_limit else request.scheduler
        await self.link.status(record.job_id, "registered", f"job registered for {what}; "
                               f"waiting for {record.job.world_size} rank(s)")
        return Reply.success(job_id=record.job_id, join_token=token)

    async def _handed(self, job_id: str) -> bool:
        """Ask the replica preferred for a job registered here to take it; False: it did not.

        Before the reply goes out: the job's events are then followed from the first.
        """
        to = self.leases.prefer(records.job_hash(job_id))
        nc = self.link.nc
        if to is None or to == self.leases.book.me or nc is None:
            return False
        try:
            msg = await nc.request(subjects.coord_replica(to, "take", self.settings.prefix),
                                   codec.encode(JobQuery(job_id=job_id)),
                                   timeout=min(1.0, self.settings.command_timeout_s))
            reply = codec.decode(msg.data, Reply)
        except Exception as e:  # noqa: BLE001 - it is gone or slow: this replica takes it
            LOG.info("job %s: replica %s did not take it (%s); this replica does", job_id, to, e)
            return False
        return reply.ok and bool(reply.result.get("taken"))

    async def take_job(self, data: bytes, subject: str = "") -> Reply:
        """Take a job another replica registered, which rendezvous hashing prefers this one for.

        On `<p>.coord.replica.<me>.take`, which only replicas may publish to.
        """
        request = codec.decode(data, JobQuery)
        if request.job_id is None:
            return Reply.failure("bad_request", "which job to take? (job_id)")
        await self.durable.known_job(request.job_id)
        if request.job_id not in self.jobs:
            return Reply.failure("unknown_job", f"no job {shown(request.job_id)} here (yet)")
        job_hash = records.job_hash(request.job_id)
        book = self.leases.book
        lease = book.leases.get(job_hash)
        if lease is not None and time.time() < book.held_until(lease, self.leases.alive):
            return Reply.success(taken=book.is_mine(lease), owner=lease.owner)
        taken = await self.leases.take(request.job_id, lease.revision if lease else 0,
                                       "registered through another replica; rendezvous "
                                       "hashing prefers this one for it")
        return Reply.success(taken=taken, owner=book.me if taken else None)

    async def register_rank(self, data: bytes, subject: str = "") -> Reply:
        """Register a rank, or a node's ranks together (`RegisterRanks`, `RegisterRankColumns`).

        A node's batch is answered with one reply per rank, in order (`result["replies"]`):
        each rank is checked as if it came alone, side by side, and those that pass are
        recorded together, in one node entry: in the request's own task for the common batch
        (`_register_node`), else one task per rank (`NodeWrite`).
        """
        request = decode_registration(data)
        if isinstance(request, list):
            plain = await self._register_node(request, subject)
            if plain is None:  # (Not the common batch: one task per rank.)
                node = NodeWrite(self.link.require_state, len(request))
                replies = await asyncio.gather(*(self._answer_rank(r, subject, node)
                                                 for r in request))
                plain = [plain_reply(r) for r in replies]
            return Reply.success(replies=plain)
        return await self._register_rank(request, subject)

    async def _answer_rank(self, request: RegisterRank, subject: str,
                           node: NodeWrite | None = None) -> Reply:
        """One rank of a node's batch: its reply, a failure included (as `wrap` answers)."""
        try:
            return await self._register_rank(request, subject, node)
        except Exception as e:  # noqa: BLE001 - never leak internals
            return _failed(request, subject, e)
        finally:
            if node is not None:
                node.finish()

    async def _register_node(self, requests: list[RegisterRank],
                             subject: str) -> list[dict[str, Any]] | None:
        """A node's batch in this one task, when it is the common one; None: rank by rank.

        The common batch: ranks of one known job whose ranks go in node entries, each with its
        GPU's description from the agent that relayed it. Each rank is checked in turn as
        `_register_rank` checks it (nothing awaited between: as the tasks of one per rank
        checked them), those that pass go in one node write (`_record_node`), and a retry is
        then answered as it comes alone. One task per rank, and one for the write, were most
        of the handling's cost per rank.
        """
        job_id = requests[0].job_id
        if any(r.job_id != job_id or r.gpu_info is None or r.gpu_info.index != r.gpu.gpu_index
               for r in requests):
            return None  # (A GPU to describe first, or another job.)
        await self.durable.known_job(job_id)
        record = self.jobs.record(job_id)
        if record is None or not record.node_ranks:
            return None
        requests = [_without_instructions(r) for r in requests]
        replies: list[dict[str, Any] | None] = [None] * len(requests)
        given: list[int] = []
        retries: list[int] = []
        via = subjects.last_token(subject)
        for i, request in enumerate(requests):
            try:
                admitted = self._admit(request, via)
            except Exception as e:  # noqa: BLE001 - never leak internals
                replies[i] = plain_reply(_failed(request, subject, e))
                continue
            if isinstance(admitted, Reply):
                replies[i] = plain_reply(admitted)
            else:
                (retries if admitted else given).append(i)
        if given or retries:  # (A registration is activity, as events are.)
            self.jobs.registry.touch(job_id, self.clock())
        if given:
            recorded = await self._record_node(record, [requests[i] for i in given], subject)
            for i, reply in zip(given, recorded, strict=True):
                replies[i] = reply
        for i in retries:
            replies[i] = plain_reply(await self._answer_rank(requests[i], subject))
        return [r if r is not None else plain_reply(INTERNAL_REPLY) for r in replies]

    def _admit(self, request: RegisterRank, via: str) -> Reply | bool:
        """A rank of a common batch checked: a refusal, or whether it is a retry.

        False: new, its place in its node's quota held (`reserve_rank`), to be recorded.
        """
        gpu, info = request.gpu, request.gpu_info
        assert info is not None
        if via != subjects.token(gpu.node):
            return _wrong_node(gpu.node, via)
        registry = self.jobs.registry
        if registry.check_rank(request):
            return True
        self.gpus.know(gpu.node, info)
        refused = self._refuse_gpu(request, info)
        if refused is not None:
            return refused
        registry.reserve_rank(gpu.node)
        return False

    async def _record_node(self, checked: JobRecord, requests: list[RegisterRank],
                           subject: str) -> list[dict[str, Any]]:
        """Record checked ranks of one job together (their quota places held): their replies.

        As each rank's `_register_rank` would: recorded in one node entry, or else each alone;
        then registered here (each handler's entries applied once it is done, `defer`), their
        places in the quota given back, the status told, the optimiser started once complete.
        `checked`: the job's record they were checked against (`register_checked` checks
        again only what the write's wait may have changed).
        """
        jobs, registry, job_id = self.jobs, self.jobs.registry, checked.job_id
        held = [jobs.registering_rank(job_id, r.rank_info.rank, self.durable.apply)
                for r in requests]
        outcomes: list[bool | BaseException] = []
        registered: list[tuple[int, bool] | BaseException] = []
        record: JobRecord | None = None
        back = 0  # (Places given back: each as its rank registers, else counted twice.)
        try:
            for one in held:
                one.__enter__()
            try:
                outcomes = await self._create_node(job_id, requests)
            except Exception as e:  # noqa: BLE001 - each rank answers it
                outcomes = [e] * len(requests)
            for request, new in zip(requests, outcomes, strict=True):
                registry.unreserve_rank(request.gpu.node)
                back += 1
                if isinstance(new, BaseException):
                    registered.append(new)
                    continue
                try:
                    record, _ = registry.register_checked(request, self.clock(), checked)
                except Exception as e:  # noqa: BLE001 - its own reply says why
                    registered.append(e)
                    continue
                registered.append((len(record.ranks), new))
        finally:
            for one in held:
                one.__exit__(None, None, None)
            for request in requests[back:]:
                registry.unreserve_rank(request.gpu.node)
        return await self._node_replies(job_id, requests, registered, record, subject)

    async def _create_node(self, job_id: str,
                           requests: list[RegisterRank]) -> list[bool | BaseException]:
        """Write checked ranks of a job in one node entry, else each alone: new (or why not)."""
        state = self.link.require_state()
        items = [_item(r, r.gpu_info) for r in requests]
        outcome = await write_node(self.link.require_state, job_id, items)
        if outcome.committed:
            return [True] * len(items)
        alone = await asyncio.gather(*(
            state.create_rank(job_id, rank, limits, period, batch=True, node_ranks=True,
                              landed=outcome.batch_id) for rank, limits, period in items),
            return_exceptions=True)
        for one in alone:
            if isinstance(one, BaseException) and not isinstance(one, Exception):
                raise one  # (Cancelled: as each rank's own task would be.)
        return alone

    async def _node_replies(self, job_id: str, requests: list[RegisterRank],
                            registered: list[tuple[int, bool] | BaseException],
                            record: JobRecord | None, subject: str) -> list[dict[str, Any]]:
        """The replies (plain) to ranks `_record_node` recorded: (ranks then, new) or why not."""
        replies: list[dict[str, Any]] = []
        for request, done in zip(requests, registered, strict=True):
            if isinstance(done, BaseException):
                replies.append(plain_reply(_failed(request, subject, done)))
                continue
            assert record is not None  # (Set with every rank registered.)
            n, new = done
            world, gpu = record.job.world_size, request.gpu
            if new and (world <= RANK_STATUS_EVERY_UP_TO
                        or n * 10 // world != (n - 1) * 10 // world):
                await self.link.status(job_id, "rank_registered",
                                       f"rank {request.rank_info.rank} on {gpu.node}/gpu"
                                       f"{gpu.gpu_index} ({n}/{world} ranks registered)")
            replies.append(plain_success(job_id=job_id, rank=request.rank_info.rank,
                                         registered=n, world_size=world))
        if record is not None and record.complete and any(
                not isinstance(d, BaseException) and d[1] for d in registered):
            self.starter.maybe_start(self.jobs.driver(job_id))
        return replies

    async def _register_rank(self, request: RegisterRank, subject: str,
                             node: NodeWrite | None = None) -> Reply:
        """Register a rank after checking its GPU with the agent that drives it.

        Only the agent of the GPU's node may register it: the subject names the node the
        request came through.
        """
        request = _without_instructions(request)
        gpu = request.gpu
        via = subjects.last_token(subject)
        await self.durable.known_job(request.job_id)
        if via != subjects.token(gpu.node):
            return _wrong_node(gpu.node, via)
        retry = self.jobs.registry.check_rank(request)  # Refuse bad requests before asking agents.
        info: GpuDescription | None = None
        if not retry:
            info = request.gpu_info  # Set by the agent that relayed it (only it may).
            if info is None or info.index != gpu.gpu_index:
                info = await self.gpus.describe(gpu.node, gpu.gpu_index)
                # The job may have gone or the rank been taken meanwhile (here, or through
                # another replica: the state bucket decides, once): this checks again.
                self.jobs.registry.check_rank(request)
            else:
                self.gpus.know(gpu.node, info)
            refused = self._refuse_gpu(request, info)
            if refused is not None:
                return refused
        registry = self.jobs.registry
        # Activity, as events are, once admitted (as `_register_node` counts it): a rank
        # refused every time and retried by its agent would keep its job forever.
        registry.touch(request.job_id, self.clock())
        if not retry:  # Ranks checked side by side (a node's batch) share one quota.
            registry.reserve_rank(gpu.node)
        try:
            with self.jobs.registering_rank(request.job_id, request.rank_info.rank,
                                            self.durable.apply):
                new = await self._create_rank(request, info, node, retry)
                # (Known here before the rank's own state entry, if it came meanwhile, is
                # applied.)
                record, _ = registry.register_rank(request, self.clock(), reserved=not retry)
        finally:
            if not retry:
                registry.unreserve_rank(gpu.node)
        n, world = len(record.ranks), record.job.world_size  # Before awaiting anything.
        if new:
            # One event per rank is too many to follow for big jobs: then every 10 %.
            if world <= RANK_STATUS_EVERY_UP_TO or n * 10 // world != (n - 1) * 10 // world:
                await self.link.status(record.job_id, "rank_registered",
                                       f"rank {request.rank_info.rank} on {gpu.node}/gpu"
                                       f"{gpu.gpu_index} ({n}/{world} ranks registered)")
            if record.complete:
                self.starter.maybe_start(self.jobs.driver(record.job_id))
        return Reply.success(job_id=record.job_id, rank=request.rank_info.rank,
                             registered=n, world_size=world)

    async def _create_rank(self, request: RegisterRank, info: GpuDescription | None,
                           node: NodeWrite | None, retry: bool) -> bool:
        """Record the rank in the state bucket: with its node's batch, or alone.

        True: new; False: recorded identically before (a retry). A job recorded before node
        entries (`JobRecord.node_ranks` False) keeps one entry per rank.
        """
        state = self.link.require_state()
        record = self.jobs.record(request.job_id)
        node_ranks = record is not None and record.node_ranks
        rank, limits, period = _item(request, info)
        landed = None
        if node is not None and node_ranks and not retry:
            outcome = await node.create(request.job_id, (rank, limits, period))
            if outcome.committed:
                return True
            landed = outcome.batch_id
        elif node is not None:
            node.skip()
        return await state.create_rank(request.job_id, rank, limits, period, batch=not retry,
                                       node_ranks=node_ranks, landed=landed)

    def _refuse_gpu(self, request: RegisterRank, info: GpuDescription | None) -> Reply | None:
        """Why the rank's GPU cannot serve the job (no agent, another GPU, observe-only)."""
        gpu = request.gpu
        if info is None:
            return Reply.failure(
                "unavailable",
                f"no agent answers for GPU {gpu.gpu_index} on node {gpu.node!r}: start "
                "`zeus-agent run` on that node, connected to the same NATS and prefix",
            )
        if gpu.gpu_uuid and gpu.gpu_uuid != info.uuid:
            return Reply.failure(
                "conflict",
                f"GPU {gpu.gpu_index} on node {gpu.node!r} has uuid {info.uuid}, not "
                f"{gpu.gpu_uuid}: check the rank's CUDA_VISIBLE_DEVICES and GPU index",
            )
        if not info.controllable:
            held = self.jobs.record(request.job_id)
            what = ("its power limit" if held is not None and held.power_limit is not None
                    else "its SM clocks")
            return Reply.failure(
                "read_only",
                f"GPU {gpu.gpu_index} on node {gpu.node!r} is observe-only (its agent runs "
                "with --observe-only, or lacks the privilege to change GPU settings), and "
                f"job {shown(request.job_id)} must set {what}: run that node's agent "
                "without --observe-only, as root or with CAP_SYS_ADMIN; to measure only, "
                "use profiling windows, which need no job",
            )
        return None

    async def query(self, data: bytes, subject: str = "") -> Reply:
        """Describe one job, or list all jobs."""
        query = codec.decode(data, JobQuery)
        if query.job_id is None:
            ids = sorted(self.jobs.ids())
            end = query.offset + query.limit
            return Reply.success(jobs=ids[query.offset:end], total=len(ids),
                                 next_offset=end if end < len(ids) else None,
                                 quarantined=len(self.failures.quarantined))
        await self.durable.known_job(query.job_id)
        record = self.jobs.require(query.job_id)
        forwarded = await self._forward(record.job_id, "query", data, subject)
        if forwarded is not None:
            return forwarded
        optimiser = self.jobs.optimiser(record.job_id)
        quarantine = self.failures.quarantined.get(records.job_hash(record.job_id))
        progress: dict[str, Any] = {"power_limit": None, "pipeline": None}
        if optimiser is not None:
            progress[optimiser.kind] = optimiser.progress()
        return Reply.success(
            job_id=record.job_id,
            job=record.job.model_dump(),
            scheduler=record.scheduler,
            power_limit_options=record.power_limit.model_dump() if record.power_limit else None,
            complete=record.complete,
            idle_s=max(0.0, self.clock() - record.last_active_s),
            ranks={str(r): {"node": rr.gpu.node, "gpu_index": rr.gpu.gpu_index,
                            "gpu_uuid": rr.gpu.gpu_uuid}
                   for r, rr in sorted(record.ranks.items())},
            **progress,
            waiting_for=optimiser.waiting_for() if optimiser is not None else {},
            quarantine=quarantine,
        )

    async def straggler(self, data: bytes, subject: str = "") -> Reply:
        """A straggler notice about one pipeline of a pipeline job (or its clearing)."""
        notice = codec.decode(data, StragglerNotice)
        await self.durable.known_job(notice.job_id)
        record = self.jobs.require(notice.job_id)
        forwarded = await self._forward(record.job_id, "straggler", data, subject)
        if forwarded is not None:
            return forwarded
        if record.power_limit is not None:
            return Reply.failure(
                "not_supported",
                f"job {record.job_id} is optimised by the power-limit optimizer: straggler "
                "notices are for pipeline jobs (pipeline frequency optimizer)")
        driver = self.jobs.get(record.job_id)  # (None: removed meanwhile.)
        lock = driver.lock if driver is not None else asyncio.Lock()
        async with lock:
            job = driver.optimiser if driver is not None else None
            if job is None:
                why = ("it refused to start: see the job's status" if record.complete else
                       f"{len(record.ranks)}/{record.job.world_size} ranks registered: send the "
                       "notice again later")
                return Reply.failure(
                    "unavailable", f"job {record.job_id}'s optimiser is not running ({why})")
            try:
                actions = job.set_straggler(notice.pipeline, None if notice.clear
                                            else notice.factor)
            except StragglerError as e:
                return reply_for(e)
            await self.actions.execute(record, actions)
            progress = job.progress()
        message = next((a.message for a in reversed(actions) if isinstance(a, StatusUpdate)), "")
        return Reply.success(job_id=record.job_id, stragglers=progress["stragglers"],
                             slowed=progress["slowed"], schedule=progress["schedule"],
                             message=message)


def _without_instructions(request: RegisterRank) -> RegisterRank:
    """The request without the rank's instructions (pure).

    The coordinator learns a rank's instructions by observing it; what a registration says of
    them is not kept (up to 1 MB a rank, in every replica and the bucket).
    """
    if request.rank_info.instructions is None:
        return request
    return request.model_copy(update={
        "rank_info": request.rank_info.model_copy(update={"instructions": None})})


def _item(request: RegisterRank, info: GpuDescription | None) -> Item:
    """The rank to record, with its GPU's power-limit range and energy-counter period (pure).

    Without the GPU's description (a retry), neither is known.
    """
    limits = (info.min_power_limit_w, info.max_power_limit_w) if info else None
    return (RankRecord(info=request.rank_info, gpu=request.gpu), limits,
            info.energy_period_ms if info else None)


def _wrong_node(node: str, via: str) -> Reply:
    """The refusal of a rank registered through another node's agent than its GPU's (pure)."""
    return Reply.failure(
        "forbidden",
        f"a rank on node {node!r} must be registered through that node's agent, not "
        f"through {shown(via)}: run the trainer on the node of its GPU",
    )


def _failed(request: RegisterRank, subject: str, e: BaseException) -> Reply:
    """The reply to a rank of a batch whose handling failed (as `wrap` answers a request)."""
    if not isinstance(e, ReplyError):
        LOG.error("rank %d of a batch on %s failed", request.rank_info.rank,
                  bounded(subject, 300), exc_info=e)
    return reply_for(e, INTERNAL_REPLY.error)


class _Forwarded:
    """A plain NATS message in the shape of a `nats.micro` request (what `wrap` reads)."""

    def __init__(self, msg: Any) -> None:
        self._msg = msg
        self.subject = msg.subject
        self.data = msg.data

    async def respond(self, data: bytes) -> None:
        await self._msg.respond(data)
