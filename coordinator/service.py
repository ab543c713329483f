"""`CoordinatorService`: the coordinator's NATS shell (config in, `serve()` runs it).

Endpoints (a `nats.micro` service "zeus-coordinator", queue group so replicas share load):
* `<p>.coord.jobs.register`: `RegisterJob` -> `Reply{job_id}`;
* `<p>.coord.ranks.register`: `RegisterRank` -> `Reply{...}`; the rank's GPU is checked with
  its agent (`info` command) and, once every rank is in, the job's optimiser starts;
* `<p>.coord.jobs.query`: `JobQuery` -> `Reply{job or jobs}`.

Streams it follows: trainer events `<p>.job.*.ev.*` (rank 0 paces the power-limit machine),
GPU marks `<p>.gpu.*.*.meas` (window energies). It commands agents on `<p>.gpu.<n>.<i>.cmd`,
renews leases on `<p>.lease.<job>` and reports on `<p>.job.<job>.status`.

Handlers are decode -> core (`JobRegistry`, `PowerLimitJob`) -> encode; domain errors go out
as coded `Reply`s. Jobs persist in `state_dir/jobs.json`; profiles in `state_dir/profiles/`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from coordinator.jobs import JobRecord, JobRegistry, RegistryError
from coordinator.power_limit.job import (
    Action,
    ApplyPowerLimit,
    PowerLimitJob,
    SaveProfile,
    StatusUpdate,
)
from coordinator.power_limit.machine import PowerLimitError
from coordinator.power_limit.profile import load_profile, save_profile
from coordinator.config import CoordinatorSettings
from zeus_agent import __version__
from zeus_agent.broker import EmbeddedNats, connect
from zeus_agent.errors import BrokerError, PayloadError
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import (
    CommandEnvelope,
    InfoCmd,
    JobQuery,
    JobStatus,
    LeaseRenewal,
    MeasurementBatch,
    RegisterJob,
    RegisterRank,
    Reply,
    SetPowerLimitCmd,
    TrainerEventBatch,
)

LOG = logging.getLogger(__name__)


class CoordinatorService:
    """The coordinator. `await serve()` runs until `should_exit` is set."""

    def __init__(self, settings: CoordinatorSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self.state_dir = Path(settings.state_dir)
        self.registry = JobRegistry()
        self.power_limit_jobs: dict[str, PowerLimitJob] = {}
        self.gpu_limits: dict[tuple[str, int], tuple[int, int]] = {}
        self.should_exit = asyncio.Event()
        self.started = asyncio.Event()
        self.nc: Any = None
        self._embedded: EmbeddedNats | None = None
        self._service: Any = None
        self._subs: list[Any] = []
        self._locks: dict[str, asyncio.Lock] = {}

    # ------------------------------------------------------------------ lifecycle
    def install_signal_handlers(self) -> None:
        """SIGINT/SIGTERM ask for a graceful exit."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.should_exit.set)

    async def serve(self) -> None:
        """Start, serve until asked to exit, shut down (always)."""
        try:
            await self.startup()
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(self._every(self.settings.lease_s / 3, self._renew_leases, "lease renewal")),
                    tg.create_task(self._every(min(60.0, self.settings.max_job_idle_time / 10),
                                               self._collect_idle, "idle job collection")),
                ]
                self.started.set()
                await self.should_exit.wait()
                for t in tasks:
                    t.cancel()
        finally:
            await self.shutdown()

    @property
    def url(self) -> str | None:
        """The NATS URL in use (the embedded server's when there is one)."""
        return self._embedded.url if self._embedded else self.settings.nats_url

    async def startup(self) -> None:
        """Restore state, connect, serve endpoints and follow job streams."""
        s = self.settings
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._restore()
        if s.embedded_nats:
            self._embedded = await asyncio.to_thread(EmbeddedNats().start)
        if not self.url:
            raise BrokerError("no NATS: pass --nats-url URL (or ZEUS_PFO_NATS_URL), or --embedded-nats")
        self.nc = await connect(self.url, "zeus-coordinator")
        from nats import micro

        self._service = await micro.add_service(
            self.nc, name="zeus-coordinator", version=__version__,
            description="Jobs, ranks and power-limit optimisation", queue_group="coord",
        )
        for name, subject, handler in (
            ("register_job", subjects.coord_register_job(s.prefix), self.handle_register_job),
            ("register_rank", subjects.coord_register_rank(s.prefix), self.handle_register_rank),
            ("query", subjects.coord_job_query(s.prefix), self.handle_query),
        ):
            await self._service.add_endpoint(name=name, subject=subject, handler=self._endpoint(handler))
        self._subs.append(await self.nc.subscribe(f"{s.prefix}.job.*.ev.*", cb=self._on_events))
        self._subs.append(await self.nc.subscribe(f"{s.prefix}.gpu.*.*.meas", cb=self._on_measurements))
        for record in self.registry.jobs.values():
            if record.complete:
                await self._start_optimiser(record)
        LOG.info("coordinator ready on %s (state in %s, %d job(s) restored)",
                 self.url, self.state_dir, len(self.registry.jobs))

    async def shutdown(self) -> None:
        """Stop endpoints, persist, drain NATS, stop the embedded server."""
        if self._service is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._service.stop(), 2)
        self._persist()
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.drain(), 5)
        if self._embedded is not None:
            await asyncio.to_thread(self._embedded.stop)
        LOG.info("coordinator stopped")

    @staticmethod
    async def _every(period_s: float, fn: Callable[[], Awaitable[Any]], what: str) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                await fn()
            except Exception:  # noqa: BLE001 - a loop never dies of one bad tick
                LOG.exception("%s failed; continuing", what)

    # ------------------------------------------------------------------ persistence
    def _persist(self) -> None:
        path = self.state_dir / "jobs.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.registry.snapshot()))
        os.replace(tmp, path)

    def _restore(self) -> None:
        path = self.state_dir / "jobs.json"
        if path.exists():
            try:
                self.registry = JobRegistry.restore(json.loads(path.read_text()), self.clock())
            except (ValueError, KeyError, TypeError) as e:
                LOG.error("could not restore %s (%s); starting with no jobs", path, e)

    def profile_path(self, record: JobRecord) -> Path:
        """Where the job's power-limit profile is loaded from and saved to."""
        opts = record.power_limit
        if opts is not None and opts.profile_path:
            return Path(opts.profile_path)
        return self.state_dir / "profiles" / f"{subjects.token(record.job_id)}.json"

    # ------------------------------------------------------------------ endpoints
    @staticmethod
    def _endpoint(handler: Callable[[bytes], Awaitable[Reply]]) -> Callable[[Any], Awaitable[None]]:
        async def wrapped(req: Any) -> None:
            try:
                reply = await handler(req.data)
            except PayloadError as e:
                reply = Reply.failure("bad_request", str(e))
            except RegistryError as e:
                reply = Reply.failure(e.code, str(e))
            except Exception:  # noqa: BLE001 - never leak internals
                LOG.exception("request on %s failed", req.subject)
                reply = Reply.failure("internal", "internal error in the coordinator; see its log")
            await req.respond(codec.encode(reply))

        return wrapped

    async def handle_register_job(self, data: bytes) -> Reply:
        """Register a job and return its id."""
        request = codec.decode(data, RegisterJob)
        record = self.registry.register_job(request, self.clock())
        self._persist()
        what = "power-limit optimisation" if request.power_limit else request.scheduler
        await self.status(record.job_id, "registered",
                          f"job registered for {what}; waiting for {record.job.world_size} rank(s)")
        return Reply.success(job_id=record.job_id)

    async def handle_register_rank(self, data: bytes) -> Reply:
        """Register a rank after checking its GPU with the agent that drives it."""
        request = codec.decode(data, RegisterRank)
        record = self.registry.get(request.job_id)
        gpu = request.gpu
        info = await self._gpu_info(gpu.node, gpu.gpu_index)
        if info is None:
            return Reply.failure(
                "unavailable",
                f"no agent answers for GPU {gpu.gpu_index} on node {gpu.node!r}: start "
                "`zeus-agent run` on that node, connected to the same NATS and prefix",
            )
        if gpu.gpu_uuid and gpu.gpu_uuid != info["uuid"]:
            return Reply.failure(
                "conflict",
                f"GPU {gpu.gpu_index} on {gpu.node} has uuid {info['uuid']}, not {gpu.gpu_uuid}",
            )
        self.gpu_limits[(gpu.node, gpu.gpu_index)] = (info["min_power_limit_w"], info["max_power_limit_w"])
        record, new = self.registry.register_rank(request, self.clock())
        self._persist()
        if new:
            await self.status(record.job_id, "rank_registered",
                              f"rank {request.rank_info.rank} on {gpu.node}/gpu{gpu.gpu_index} "
                              f"({len(record.ranks)}/{record.job.world_size})")
        if new and record.complete:
            await self._start_optimiser(record)
        return Reply.success(job_id=record.job_id, rank=request.rank_info.rank,
                             registered=len(record.ranks), world_size=record.job.world_size)

    async def handle_query(self, data: bytes) -> Reply:
        """Describe one job, or list all jobs."""
        query = codec.decode(data, JobQuery)
        if query.job_id is None:
            return Reply.success(jobs=sorted(self.registry.jobs))
        record = self.registry.get(query.job_id)
        job = self.power_limit_jobs.get(record.job_id)
        return Reply.success(
            job_id=record.job_id,
            job=record.job.model_dump(),
            ranks={str(r): {"node": rr.gpu.node, "gpu_index": rr.gpu.gpu_index}
                   for r, rr in record.ranks.items()},
            power_limit=job.progress() if job else None,
            waiting_for=job.waiting_for() if job else {},
        )

    async def _gpu_info(self, node: str, index: int) -> dict[str, Any] | None:
        subject = subjects.gpu_command(node, index, self.settings.prefix)
        try:
            raw = await self.nc.request(subject, codec.encode(CommandEnvelope(cmd=InfoCmd())),
                                        timeout=self.settings.command_timeout_s)
            reply = codec.decode(raw.data, Reply)
        except Exception as e:  # noqa: BLE001 - timeout, no responders, bad reply
            LOG.warning("no info from %s: %s", subject, e)
            return None
        return reply.result.get("gpu") if reply.ok else None

    # ------------------------------------------------------------------ power-limit jobs
    async def _start_optimiser(self, record: JobRecord) -> None:
        if record.power_limit is None or record.job_id in self.power_limit_jobs:
            return
        limits = [self.gpu_limits.get((g.node, g.gpu_index)) for g in record.gpus()]
        if any(lim is None for lim in limits):
            for g in record.gpus():
                info = await self._gpu_info(g.node, g.gpu_index)
                if info is not None:
                    self.gpu_limits[(g.node, g.gpu_index)] = (info["min_power_limit_w"], info["max_power_limit_w"])
            limits = [self.gpu_limits.get((g.node, g.gpu_index)) for g in record.gpus()]
        if any(lim is None for lim in limits):
            await self.status(record.job_id, "error", "cannot reach every GPU's agent; not optimising")
            return
        lo = max(lim[0] for lim in limits if lim)
        hi = min(lim[1] for lim in limits if lim)
        path = self.profile_path(record)
        measurements = None
        try:
            if path.exists():
                measurements = await asyncio.to_thread(load_profile, path)
            job = PowerLimitJob(record.job_id, record.power_limit, record.ranks, lo, hi, measurements)
        except (PowerLimitError, ValueError) as e:
            await self.status(record.job_id, "error", f"power-limit optimiser refused: {e}")
            return
        self.power_limit_jobs[record.job_id] = job
        await self._execute(record, job.start())

    def _lock(self, job_id: str) -> asyncio.Lock:
        return self._locks.setdefault(job_id, asyncio.Lock())

    async def _on_events(self, msg: Any) -> None:
        try:
            batch = codec.decode(msg.data, TrainerEventBatch)
        except PayloadError as e:
            LOG.warning("ignored bad trainer events on %s: %s", msg.subject, e)
            return
        self.registry.touch(batch.job_id, self.clock())
        job = self.power_limit_jobs.get(batch.job_id)
        if job is None:
            return
        async with self._lock(batch.job_id):
            for event in batch.events:
                await self._act(batch.job_id, lambda e=event: job.on_event(batch.rank, e))

    async def _on_measurements(self, msg: Any) -> None:
        try:
            batch = codec.decode(msg.data, MeasurementBatch)
        except PayloadError as e:
            LOG.warning("ignored bad measurements on %s: %s", msg.subject, e)
            return
        job = self.power_limit_jobs.get(batch.job_id)
        if job is None or not batch.marks:
            return
        async with self._lock(batch.job_id):
            for mark in batch.marks:
                await self._act(batch.job_id, lambda m=mark: job.on_mark(batch.rank, m))

    async def _act(self, job_id: str, step: Callable[[], list[Action]]) -> None:
        record = self.registry.jobs.get(job_id)
        if record is None:
            return
        try:
            actions = step()
        except PowerLimitError as e:
            await self.status(job_id, "error", f"power-limit optimiser: {e}")
            return
        await self._execute(record, actions)

    async def _execute(self, record: JobRecord, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, ApplyPowerLimit):
                await self.apply_power_limit(record, action.watts)
            elif isinstance(action, SaveProfile):
                path = self.profile_path(record)
                await asyncio.to_thread(path.parent.mkdir, parents=True, exist_ok=True)
                await asyncio.to_thread(save_profile, path, list(action.measurements))
                await self.status(record.job_id, "profile_saved", f"profile saved to {path}",
                                  {"path": str(path), "optimal_power_limit_w": action.optimal_power_limit})
            elif isinstance(action, StatusUpdate):
                await self.status(record.job_id, action.state, action.message, action.progress)

    async def apply_power_limit(self, record: JobRecord, watts: int) -> None:
        """Command every GPU of the job to `watts`, under the job's lease."""
        cmd = codec.encode(CommandEnvelope(cmd=SetPowerLimitCmd(
            power_limit_w=watts, holder=record.job_id, lease_s=self.settings.lease_s)))

        async def one(node: str, index: int) -> str | None:
            subject = subjects.gpu_command(node, index, self.settings.prefix)
            try:
                raw = await self.nc.request(subject, cmd, timeout=self.settings.command_timeout_s)
                reply = codec.decode(raw.data, Reply)
            except Exception as e:  # noqa: BLE001
                return f"{node}/gpu{index}: {type(e).__name__}"
            return None if reply.ok else f"{node}/gpu{index}: {reply.error}"

        errors = [e for e in await asyncio.gather(*(one(g.node, g.gpu_index) for g in record.gpus())) if e]
        if errors:
            await self.status(record.job_id, "error", f"setting {watts} W failed on " + "; ".join(errors))

    async def status(self, job_id: str, state: str, message: str, progress: dict[str, Any] | None = None) -> None:
        """Publish a job status event (and log it)."""
        LOG.info("job %s: %s: %s", job_id, state, message)
        event = JobStatus(job_id=job_id, state=state, message=message, progress=progress or {})
        with contextlib.suppress(Exception):
            await self.nc.publish(subjects.job_status(job_id, self.settings.prefix), codec.encode(event))

    # ------------------------------------------------------------------ loops
    async def _renew_leases(self) -> None:
        now = self.clock()
        for record in list(self.registry.jobs.values()):
            if now - record.last_active_s > self.settings.lease_idle_s:
                continue
            renewal = LeaseRenewal(holder=record.job_id, lease_s=self.settings.lease_s)
            await self.nc.publish(subjects.lease_renewal(record.job_id, self.settings.prefix),
                                  codec.encode(renewal))

    async def _collect_idle(self) -> None:
        for job_id in self.registry.collect_idle(self.clock(), self.settings.max_job_idle_time):
            self.power_limit_jobs.pop(job_id, None)
            self._locks.pop(job_id, None)
            await self.status(job_id, "removed", "job removed after being idle (max_job_idle_time)")
            self._persist()
