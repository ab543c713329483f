"""`CoordinatorService`: the coordinator's NATS shell (config in, `serve()` runs it).

Endpoints (a `nats.micro` service "zeus-coordinator", queue group so replicas share load):
* `<p>.coord.jobs.register.<node>`: `RegisterJob` -> `Reply{job_id}` (quotas per node);
* `<p>.coord.ranks.register.<node>`: `RegisterRank` -> `Reply{...}`; only through the agent of
  the rank's GPU's node (the subject's node, which NATS permissions tie to that agent's
  credentials); the GPU is checked with its agent (`info`) and, once every rank is in, the
  job's optimiser starts;
* `<p>.coord.jobs.query`: `JobQuery` -> `Reply{job or jobs}` (with the measured profile);
* `<p>.coord.jobs.straggler`: `StragglerNotice` -> `Reply{stragglers}` or a coded error
  (`unknown_job`, `not_supported`: not a pipeline job, `unavailable`: its ranks are still
  registering, `out_of_range`: no such pipeline, `bad_request`: a bad factor, `conflict`: its
  optimiser stopped); the job's other pipelines are slowed down (`PipelineJob.set_straggler`).

Streams it follows: trainer events `<p>.job.*.ev.*.<node>` (rank 0 paces the power-limit
machine), GPU marks `<p>.gpu.*.*.meas` (window energies), both accepted only from the GPU the
rank is bound to (as its node's agent names it); agent announcements `<p>.agent.*.hello`, on
which it reconciles: a GPU whose limit is not its job's desired limit (its agent restarted)
gets it again. It commands agents on `<p>.gpu.<n>.<i>.cmd`, renews leases on `<p>.lease.<job>`
and reports on `<p>.job.<job>.status`.

Never deaf: if the NATS server closes the connection for good (nats-py then stops
reconnecting), the coordinator stops and exits with `BUS_LOST` (4) so its supervisor starts a
fresh one; `/healthz` (`status_port`, beside Prometheus `/metrics`: `coordinator.metrics`)
answers 503 while it is disconnected or closed. After a reconnection it pings the agents, whose
announcements reconcile every GPU's limit.

The coordinator never opens a path a client names: a profile comes with the job's options and
goes back in the job's status and queries (the trainer's drop-in reads and writes its own
`profile_path`); the coordinator's copies live in `state_dir/profiles/` under names it makes.

Handlers are decode -> core (`JobRegistry`, `PowerLimitJob`) -> encode; domain errors go out
as coded `Reply`s. Each request runs in its own task (NATS runs a subscription's callbacks one
at a time, and a rank registration waits for the GPU's agent), so thousands of ranks register
concurrently. Agents' GPU descriptions are cached for `GPU_INFO_TTL_S`.

Durable state (`coordinator.state`): jobs, ranks, GPU bindings and each optimiser's progress
live in a JetStream KV bucket, one key per fact; a registration is acknowledged once JetStream
has it (so nothing acknowledged is lost), and a write that fails is undone and refused
(`unavailable`), so a retry never makes a second job. Every replica follows the bucket, so
all share one view of the jobs. An existing `state_dir/jobs.json` (earlier versions) is
imported once and renamed.

Replicas: request endpoints are a queue group (any replica answers); each job is driven by
one owner (`OwnershipBook`: a lease in the `-owners` bucket, taken by compare-and-set). Only
the owner follows the job's events and measurements, commands its GPUs, renews their leases
and writes its progress; queries and straggler notices about it are forwarded to the owner.
When an owner stops renewing (it died), another replica takes the job over after the lease
and resumes it from its recorded progress; a stopping replica gives its jobs up at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from coordinator import metrics
from coordinator.config import CoordinatorSettings
from coordinator.jobs import JobRecord, JobRegistry, RankRecord, RegistryError
from coordinator.optimizer import (
    Action,
    ApplyPowerLimit,
    ClearSchedules,
    InstallSchedules,
    JobOptimizer,
    KeepFile,
    SaveProfile,
    StatusUpdate,
)
from coordinator.pipeline.dumps import job_dir_name, keep_dump
from coordinator.pipeline.job import PipelineJob, StragglerError
from coordinator.pipeline.memory import MB, NodeBudget
from coordinator.pipeline.scheduler import SchedulerError
from coordinator.power_limit.job import PowerLimitJob
from coordinator.power_limit.machine import PowerLimitError
from coordinator.power_limit.profile import save_profile
from coordinator.power_limit.search import WindowResult
from coordinator.state import OwnershipBook, RecordError, records
from coordinator.state.jetstream import JetStreamState, StateUnavailableError
from coordinator.state.ownership import Lease
from zeus_agent import __version__, status_http
from zeus_agent.aio import ExitSignals, every
from zeus_agent.broker import EmbeddedNats, confirm_subscriptions, connect, redact_url
from zeus_agent.cli_kit import BUS_LOST
from zeus_agent.errors import BrokerError, PayloadError
from zeus_agent.models import FrequencySchedule, JobInfo, PowerLimitMeasurement, RankInfo
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import (
    AgentHello,
    ClearScheduleCmd,
    CommandEnvelope,
    ErrorEvent,
    GpuBinding,
    GpuDescription,
    InfoCmd,
    InstallScheduleCmd,
    JobQuery,
    JobStatus,
    LeaseRenewal,
    MeasurementBatch,
    RegisterJob,
    RegisterRank,
    Reply,
    SetPowerLimitCmd,
    StragglerNotice,
    TrainerEventBatch,
)
from zeus_agent.wire.text import bounded, shown

LOG = logging.getLogger(__name__)

GPU_INFO_TTL_S = 30.0
"""How long an agent's answer to `info` is trusted before asking again (s)."""
JOIN_TOKEN_BYTES = 18
"""Randomness in a job's join token (144 bits; 24 URL-safe characters)."""

INFO_COMMAND = codec.encode(CommandEnvelope(cmd=InfoCmd()))

RANK_STATUS_EVERY_UP_TO = 64
"""Jobs up to this world size get a status event per rank; bigger ones every 10 %."""

M = TypeVar("M", bound=BaseModel)

Handler = Callable[[bytes, str], Awaitable[Reply]]
"""An endpoint handler: (request payload, request subject) -> reply."""

TICK_S = 1.0
"""How often the jobs' timers (overdue windows) are checked (s)."""

GC_THRESHOLD = 20_000
"""Allocations between young-generation collections (Python's default: 700)."""
_gc_tuned = False

OWNERSHIP_POLL_S = 0.5
"""How often leases are checked for jobs to take over (renewals: every lease / 3)."""
EVENTS_PER_YIELD = 256
"""Trainer events handled between two yields to the event loop (a 1 MB batch holds ~50,000)."""


class CoordinatorService(ExitSignals):
    """The coordinator. `await serve()` runs until `should_exit` is set."""

    def __init__(
        self, settings: CoordinatorSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.state_dir = Path(settings.state_dir)
        self.registry = JobRegistry(settings.max_jobs, settings.max_jobs_per_node)
        self.pfo = settings.pfo_settings()
        self.pipeline_budget = NodeBudget(
            settings.max_pipeline_mb_per_node * MB,
            alive=lambda job: self.optimisers.get(getattr(job, "job_id", "")) is job)
        """What the pipeline jobs driven here keep of their measurements, per node."""
        self.optimisers: dict[str, JobOptimizer] = {}
        """Job id -> the optimiser driving it (power-limit or pipeline frequency)."""
        self.progress: dict[str, dict[str, Any]] = {}
        """Job id -> its optimiser's recorded progress (what a new owner resumes from)."""
        self.book = OwnershipBook(settings.replica_name,
                                  min(settings.ownership_lease_s, settings.lease_s / 2))
        self.state: JetStreamState | None = None
        self._job_ids: dict[str, str] = {}
        """Job hash (state keys) -> job id."""
        self._starting: set[str] = set()
        self._registering: set[tuple[str, int]] = set()
        self._unsaved: dict[str, tuple[str, Any]] = {}  # progress JetStream has not taken yet
        self._unsaved_warned: set[str] = set()
        self._progress_locks: dict[str, asyncio.Lock] = {}
        self._renewed_at = 0.0
        """When this replica last renewed its leases (wall clock)."""
        self._job_tokens: dict[str, str] = {}
        """Subject token of a known job's id -> the id (to skip others' jobs' events cheaply)."""
        self._bound: dict[tuple[str, str], str] = {}
        """(node token, GPU index token) -> the known job whose rank drives that GPU (the one
        this replica drives, when it has an optimiser for it)."""
        """Job id -> (kind, progress) JetStream has not taken yet (written again later)."""
        """(job id, rank) being recorded by this replica's handlers right now."""
        self.gpu_limits: dict[tuple[str, int], tuple[int, int]] = {}
        self._agent_ids: dict[str, str] = {}
        self._installed_at: dict[tuple[str, int], float] = {}
        """(job id, rank) -> when its schedule was last sent (coordinator clock)."""
        self._switch_steps: dict[tuple[str, int], int | None] = {}
        """(job id, schedule version) -> the step its ranks switch at (None: at once)."""
        self._lapse_reapplies: dict[tuple[str, int], list[float]] = {}
        """(job id, rank) -> when its lapsed settings were set again (`REAPPLY_LIMIT`)."""
        self._late_renewals: dict[str, float] = {}
        """Job hash -> when an action last renewed its late ownership lease (`_owns_now`)."""
        self._pending_lapses: dict[tuple[str, int], set[str]] = {}
        """(job id, rank) -> settings an agent restored while this replica's own ownership
        lease had lapsed: set again once the ownership loop has taken the lease back."""
        self.dropped: Counter[str] = Counter()
        """Stream messages dropped, by reason (spoofed node, unknown rank...)."""
        super().__init__()
        self.started = asyncio.Event()
        self.nc: Any = None
        self._embedded: EmbeddedNats | None = None
        self._service: Any = None
        self._subs: list[Any] = []
        self._locks: dict[str, asyncio.Lock] = {}
        self._gpu_info_cache: dict[tuple[str, int], tuple[float, GpuDescription]] = {}
        self._tg: asyncio.TaskGroup | None = None
        self._inflight: set[asyncio.Task[Any]] = set()
        self.exit_code = 0
        """What the process should exit with: 0, or `BUS_LOST` (the server closed NATS)."""
        self.bus_state: tuple[str, float, str] = ("starting", time.time(), "not connected yet")
        self._status_server: status_http.StatusServer | None = None
        self.writes = 0  # Writes to the state bucket (for benchmarks and tests).
        self._observe_only_said: dict[tuple[str, str, int], None] = {}
        """(job, node token, GPU) whose GPU was said to be observe-only (once each)."""
        self.fenced_commands = 0  # GPU commands not sent: the job was no longer this replica's.

    # ------------------------------------------------------------------ lifecycle
    async def serve(self) -> None:
        """Start, serve until asked to exit, shut down (always).

        Raises:
            BrokerError: NATS could not be reached (nothing was served).
        """
        try:
            await self.startup()
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                s = self.settings
                loops = [
                    tg.create_task(
                        every(s.lease_s / 3, self._renew_leases, "lease renewal", first_now=False)
                    ),
                    tg.create_task(every(TICK_S, self._tick_jobs, "job timers", first_now=False)),
                    tg.create_task(every(min(OWNERSHIP_POLL_S, self.book.lease_s / 3),
                                         self._ownership, "job ownership", first_now=True)),
                    tg.create_task(
                        every(
                            min(60.0, s.max_job_idle_time / 10),
                            self._collect_idle,
                            "idle job collection",
                            first_now=False,
                        )
                    ),
                ]
                self.started.set()
                await self.should_exit.wait()
                await self._stop_intake()
                await self._finish_inflight()
                for t in loops:
                    t.cancel()
        finally:
            self._tg = None
            await self.shutdown()

    @property
    def power_limit_jobs(self) -> dict[str, PowerLimitJob]:
        """The power-limit optimisers, by job id."""
        return {k: j for k, j in self.optimisers.items() if isinstance(j, PowerLimitJob)}

    @property
    def pipeline_jobs(self) -> dict[str, PipelineJob]:
        """The pipeline frequency optimisers, by job id."""
        return {k: j for k, j in self.optimisers.items() if isinstance(j, PipelineJob)}

    @property
    def url(self) -> str | None:
        """The NATS URL in use (the embedded server's when there is one)."""
        return self._embedded.url if self._embedded else self.settings.nats_url

    async def startup(self) -> None:
        """Restore state, connect, serve endpoints and follow job streams."""
        s = self.settings
        self.state_dir.mkdir(parents=True, exist_ok=True)
        probe = self.state_dir / f".write-probe-{os.getpid()}"
        probe.write_text("")  # An unwritable state directory fails here, before serving.
        probe.unlink()
        if s.embedded_nats:  # Its JetStream store is kept with the state: a restart resumes.
            store = str(self.state_dir / "jetstream")
            self._embedded = await asyncio.to_thread(EmbeddedNats(store_dir=store).start)
        if not self.url:
            raise BrokerError(
                "no NATS: pass --nats-url URL (or ZEUS_PFO_NATS_URL), or --embedded-nats"
            )
        if s.status_port is not None:
            self._status_server = status_http.start(
                s.status_host, s.status_port, self.health,
                registry=metrics.make_registry(lambda: metrics.snapshot(self)))
        self.nc = await connect(self.url, "zeus-coordinator", timeout_s=s.connect_timeout_s,
                                on_disconnect=self._on_disconnect,
                                on_reconnect=self._on_reconnect, on_closed=self._on_closed,
                                inbox_prefix=subjects.inbox_prefix("coord", "", s.prefix),
                                **s.tls_options())
        self.bus_state = ("connected", time.time(), "connected to NATS")
        self.state = JetStreamState(self.nc, s.prefix, s.state_replicas,
                                    timeout_s=max(2.0, s.command_timeout_s), bucket=s.state_bucket)
        await self.state.open()
        await self._import_jobs_json()
        await self.state.follow(self._on_state_entry, self._on_owner_entry)
        from nats import micro

        self._service = await micro.add_service(
            self.nc, name="zeus-coordinator", version=__version__,
            description="Jobs, ranks and power-limit optimisation", queue_group="coord",
        )
        for subject, callback in (
            (subjects.all_job_events(s.prefix), self._on_events),
            (subjects.all_gpu_measurements(s.prefix), self._on_measurements),
            (subjects.all_gpu_errors(s.prefix), self._on_gpu_error),
            (subjects.all_agent_hellos(s.prefix), self._on_agent_hello),
        ):
            self._subs.append(await self.nc.subscribe(subject, cb=callback))
        endpoints: list[tuple[str, str, Handler]] = [
            ("register_job", subjects.all_coord_register_job(s.prefix), self.handle_register_job),
            ("register_rank", subjects.all_coord_register_rank(s.prefix),
             self.handle_register_rank),
            ("query", subjects.coord_job_query(s.prefix), self.handle_query),
            ("straggler", subjects.coord_job_straggler(s.prefix), self.handle_straggler),
        ]
        me = s.replica_name
        own: list[tuple[str, Handler]] = [("query", self.handle_query),
                                          ("straggler", self.handle_straggler)]
        for name, own_handler in own:
            # This replica's own subjects, where the others forward requests about its jobs.
            self._subs.append(await self.nc.subscribe(
                subjects.coord_replica(me, name, s.prefix), cb=self._own_endpoint(own_handler)))
        for name, subject, handler in endpoints:
            await self._service.add_endpoint(
                name=name, subject=subject, handler=self._endpoint(handler)
            )
        # Subscriptions are live before anyone hears we started.
        await confirm_subscriptions(self.nc)
        _tune_gc()
        LOG.info("coordinator ready on %s: replica %s, state in JetStream bucket %s, %d job(s)",
                 redact_url(self.url or ""), s.replica_name, self.state.bucket,
                 len(self.registry.jobs))
        if s.scheduler_note:  # A Zeus configuration naming only a plan runs PointSolution.
            LOG.info("pipeline jobs: %s", s.scheduler_note)

    async def _on_disconnect(self) -> None:
        self.bus_state = ("disconnected", time.time(), "the connection to NATS was lost")

    async def _on_reconnect(self) -> None:
        self.bus_state = ("connected", time.time(), "reconnected to NATS")
        # Agents may have restarted meanwhile: their announcements reconcile the GPUs.
        with contextlib.suppress(Exception):
            await self.nc.publish(subjects.agent_ping(self.settings.prefix), b"")

    async def _on_closed(self) -> None:
        """The server closed the connection and nats-py will not reconnect: exit non-zero."""
        last = getattr(self.nc, "last_error", None) if self.nc is not None else None
        reason = f"the NATS server closed the connection ({last or 'no reason given'})"
        self.bus_state = ("closed", time.time(), reason)
        LOG.error("%s; exiting with code %d so the supervisor starts a fresh coordinator",
                  reason, BUS_LOST)
        self.exit_code = BUS_LOST
        self.should_exit.set()

    def health(self) -> tuple[bool, dict[str, Any]]:
        """(healthy, detail) for `/healthz` (called on the status server's thread)."""
        state, since, reason = self.bus_state
        detail = {"nats": {"state": state, "since": since, "reason": reason},
                  "replica": self.settings.replica_name, "jobs": len(self.registry.jobs),
                  "owned": len(self.book.mine()), "dropped": dict(self.dropped),
                  "fenced_commands": self.fenced_commands}
        if state != "connected":
            return False, {"status": state, "reason": reason, **detail}
        if not self.started.is_set() or self.should_exit.is_set():
            return False, {"status": "stopping" if self.should_exit.is_set() else "starting",
                           **detail}
        return True, {"status": "ok", **detail}

    async def _stop_intake(self) -> None:
        """Stop taking requests and stream messages (first step of the shutdown)."""
        if self._service is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._service.stop(), 2)
            self._service = None
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()

    async def _finish_inflight(self) -> None:
        """Let in-flight requests finish within `shutdown_timeout_s`, then cancel them."""
        if not self._inflight:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.shutdown_timeout_s
        forced = asyncio.ensure_future(self.force_exit.wait())
        try:
            while self._inflight and not forced.done() and loop.time() < deadline:
                await asyncio.wait({*self._inflight, forced}, timeout=deadline - loop.time(),
                                   return_when=asyncio.FIRST_COMPLETED)
        finally:
            forced.cancel()
        pending = set(self._inflight)
        for t in pending:
            t.cancel(msg="coordinator shutting down")
        if pending:
            LOG.warning("cancelled %d request(s) still running at shutdown", len(pending))

    async def shutdown(self) -> None:
        """Stop intake, persist, drain NATS, stop the embedded server (idempotent)."""
        await self._stop_intake()
        await self._give_up_jobs()
        if self.state is not None:
            await self.state.close()
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.drain(), 5)
            self.nc = None
        if self._embedded is not None:
            await asyncio.to_thread(self._embedded.stop)
            self._embedded = None
        if self._status_server is not None:
            await asyncio.to_thread(self._status_server.close)
            self._status_server = None
        LOG.info("coordinator stopped")

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run `coro` as a task of the service's task group (inline before it exists)."""
        task = asyncio.ensure_future(coro) if self._tg is None else self._tg.create_task(coro)
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    # ------------------------------------------------------------------ durable state
    async def _import_jobs_json(self) -> None:
        """Import `state_dir/jobs.json` (the file store of earlier versions) once."""
        path = self.state_dir / "jobs.json"
        if not path.exists() or self.state is None:
            return
        try:
            data = json.loads(path.read_text())
            imported = JobRegistry.restore(data, self.clock())
            windows = {job_id: w for job_id, w in data.get("power_limit_windows", {}).items()}
        except (ValueError, KeyError, TypeError, AttributeError, OSError) as e:
            aside = path.with_suffix(f".corrupt-{int(time.time())}")
            os.replace(path, aside)
            LOG.error("could not import %s (%s); moved it to %s", path, e, aside)
            return
        for record in imported.jobs.values():
            if await self.state.create_job(record):
                for rank in record.ranks.values():
                    await self.state.create_rank(record.job_id, rank)
                if record.job_id in windows:
                    await self.state.put_progress(record.job_id, "windows",
                                                  windows[record.job_id])
        done = path.with_suffix(f".imported-{int(time.time())}")
        os.replace(path, done)
        LOG.info("imported %d job(s) from %s into JetStream (the file is now %s)",
                 len(imported.jobs), path, done.name)

    async def _on_state_entry(self, entry: Any) -> None:
        """Keep this replica's view in step with the state bucket (any replica's writes)."""
        deleted = entry.operation in ("DEL", "PURGE")
        if not deleted and entry.key.startswith("v.rank."):
            # Rank keys are only ever created: one this replica knows (it registered the rank
            # itself) is not decoded again, which halves the work of a big registration.
            _, _, job_hash, rank = entry.key.split(".", 3)
            known = self.registry.jobs.get(self._job_ids.get(job_hash, ""))
            held = known.ranks.get(int(rank)) if known is not None and rank.isdigit() else None
            if known is not None and held is not None:
                self._index_gpu(known.job_id, held.gpu)
                return
        try:
            change = records.decode(entry.key, entry.value, deleted, self.clock())
        except RecordError as e:
            self._drop("bad_state_entry", entry.key, e)
            return
        if change.kind == "job":
            if change.deleted:
                job_id = self._job_ids.pop(change.job_hash, None)
                if job_id is not None:
                    self._forget_job(job_id)
                return
            assert change.job is not None
            self._job_ids[change.job_hash] = change.job.job_id
            self._job_tokens[subjects.token(change.job.job_id)] = change.job.job_id
            self.registry.apply_job(change.job)
        elif change.kind == "rank" and change.deleted:  # A registration undone (a lost race).
            job_id = self._job_ids.get(change.job_hash)
            rank = entry.key.rsplit(".", 1)[-1]
            if job_id is not None and rank.isdigit():
                self.registry.unregister_rank(job_id, int(rank))
        elif change.kind == "rank" and change.rank is not None and change.job_id is not None:
            gpu = change.rank.gpu
            self._index_gpu(change.job_id, gpu)
            if change.limits is not None:  # The owner need not ask that GPU's agent again.
                self.gpu_limits.setdefault((gpu.node, gpu.gpu_index), change.limits)
            if self.registry.apply_rank(change.job_id, change.rank, self.clock()):
                record = self.registry.jobs[change.job_id]
                if record.complete and (change.job_id, change.rank.info.rank) not in (
                        self._registering):
                    self._maybe_start(record)
        elif (change.kind == "prog" and change.job_id is not None and change.progress
              and change.job_id not in self.optimisers):  # Our own writes change nothing here.
            self.progress[change.job_id] = change.progress

    async def _on_owner_entry(self, entry: Any) -> None:
        """Follow the ownership leases; a job another replica took is dropped here."""
        if entry.operation in ("DEL", "PURGE") or not entry.value:
            self.book.forget(entry.key)
            return
        lease = self.book.observe(entry.key, entry.value, entry.revision)
        if lease is not None and lease.owner != self.book.me:
            self._release_locally(lease.job_id, f"replica {lease.owner} took it over")

    def _release_locally(self, job_id: str, why: str) -> None:
        """Stop driving a job here (another replica owns it now): no commands, no leases."""
        if self.optimisers.pop(job_id, None) is not None:
            LOG.info("job %s: no longer driven by this replica (%s)", job_id, why)

    def _forget_job(self, job_id: str) -> None:
        """The job was removed (by its owner): forget it."""
        self._job_tokens.pop(subjects.token(job_id), None)
        for key in [k for k, j in self._bound.items() if j == job_id]:
            del self._bound[key]
        self.registry.drop_job(job_id)
        self._release_locally(job_id, "removed")
        self.progress.pop(job_id, None)
        self._locks.pop(job_id, None)
        self._unsaved.pop(job_id, None)
        self._unsaved_warned.discard(job_id)
        self._progress_locks.pop(job_id, None)
        self._late_renewals.pop(records.job_hash(job_id), None)
        for by_job in (self._installed_at, self._switch_steps, self._lapse_reapplies,
                       self._pending_lapses):
            for stale in [k for k in by_job if k[0] == job_id]:
                del by_job[stale]
        for said in [k for k in self._observe_only_said if k[0] == job_id]:
            del self._observe_only_said[said]

    def _state(self) -> JetStreamState:
        if self.state is None:
            raise StateUnavailableError("the coordinator is not connected to its state yet")
        return self.state

    def owns(self, job_id: str) -> bool:
        """Whether this replica drives the job now."""
        return self.book.owns(records.job_hash(job_id), time.time())

    def _maybe_start(self, record: JobRecord) -> None:
        """Start the job's optimiser if every rank is in and this replica owns the job."""
        job_id = record.job_id
        if (record.complete and job_id not in self.optimisers and job_id not in self._starting
                and self.owns(job_id)):
            self._starting.add(job_id)
            self._spawn(self._start_optimiser(record))

    async def _ownership(self) -> None:
        """Renew this replica's leases, take over jobs whose owner is gone."""
        if self.state is None or self.nc is None or not self.nc.is_connected:
            return
        now = time.time()
        due = now - self._renewed_at >= self.book.lease_s / 3
        if due:
            self._renewed_at = now
        for job_hash, lease in self.book.renewals() if due else []:
            await self._renew(job_hash, lease, now)
        known = {records.job_hash(j): j for j in self.registry.jobs}
        for job_hash, revision in self.book.claimable(list(known), time.time()):
            held = self.book.leases.get(job_hash)
            why = ("it had no owner" if held is None else
                   f"replica {held.owner} stopped and gave it up" if held.until == 0 else
                   "its lease ran out here before JetStream took the renewal"
                   if held.owner == self.book.me else
                   f"replica {held.owner} stopped renewing its lease (it died or lost NATS)")
            await self._take(known[job_hash], revision, why)
        for job_hash in self.book.mine():
            record = self.registry.jobs.get(known.get(job_hash, ""))
            if record is not None:
                self._maybe_start(record)
        await self._reapply_pending_lapses()
        await self._record_unsaved()

    async def _reapply_pending_lapses(self) -> None:
        """Set again the lapsed settings kept while this replica's own lease had lapsed."""
        for (job_id, rank) in list(self._pending_lapses):
            lease = self.book.leases.get(records.job_hash(job_id))
            job = self.optimisers.get(job_id)
            if lease is None or lease.owner != self.book.me or job is None:
                # Another replica drives it now, or it has no optimiser here any more.
                del self._pending_lapses[(job_id, rank)]
            elif self.owns(job_id):
                restored = sorted(self._pending_lapses.pop((job_id, rank)))
                # A task: the job's lock may be held for long (a plan), and this loop renews
                # every job's lease.
                self._spawn(self._reapply_locked(job_id, job, rank, restored))

    async def _reapply_locked(self, job_id: str, job: JobOptimizer, rank: int,
                              restored: list[str]) -> None:
        try:
            async with self._lock(job_id):
                if self.optimisers.get(job_id) is job:  # (Not one released meanwhile.)
                    await self._reapply_lapsed(job_id, job, rank, restored)
        except Exception:  # A task of the service: one job's failure must not stop it.
            LOG.exception("job %s: setting rank %d's lapsed settings again failed", job_id, rank)

    async def _renew(self, job_hash: str, lease: Lease, now: float) -> None:
        """Renew one of this replica's ownership leases (compare-and-set on its revision).

        A failed renewal drops the job only once another replica holds it: JetStream may just
        have been slow (an election), and a lease that ran out meanwhile is taken again by the
        ownership loop with the job still driven here, not restarted from its progress.
        """
        assert self.state is not None
        value = self.book.value(lease.job_id, now)
        revision = await self.state.take(job_hash, value, lease.revision)
        if revision is not None:
            self.book.observe(job_hash, value, revision)
            return
        await self._read_lease(job_hash)
        held = self.book.leases.get(job_hash)
        if held is not None and held.owner != self.book.me:
            self._release_locally(lease.job_id, f"replica {held.owner} took it over")

    async def _read_lease(self, job_hash: str) -> None:
        """After a compare-and-set failed: learn the lease's current revision from the bucket.

        The watch may lag or stall (its server restarting): waiting for it, a replica would
        try again and again on a stale revision and never take a job given up to it.
        """
        assert self.state is not None
        current = await self.state.read_lease(job_hash)
        if current is not None:
            self.book.observe(job_hash, *current)

    async def _owns_now(self, job_id: str) -> bool:
        """Whether this replica may act on the job, renewing its lease first if that is late.

        The ownership loop renews every lease on time unless the event loop was busy (a burst of
        huge iterations on a loaded host): a lease still held but inside its fence is renewed
        here rather than fencing the job's actions. One another replica holds is never taken.
        """
        if self.owns(job_id):
            return True
        job_hash = records.job_hash(job_id)
        lease = self.book.leases.get(job_hash)
        now = time.time()
        if (lease is None or lease.owner != self.book.me or now >= lease.until
                or self.state is None or self.nc is None or not self.nc.is_connected
                or now - self._late_renewals.get(job_hash, 0.0) < self.book.fence_s / 2):
            return False  # (At most one try per half fence: JetStream may be what is slow.)
        self._late_renewals[job_hash] = now
        try:  # Bounded: the job's lock is held, and JetStream may be slow (an election).
            await asyncio.wait_for(self._renew(job_hash, lease, now), self.book.fence_s / 2)
        except TimeoutError:
            return False
        return self.owns(job_id)

    async def _take(self, job_id: str, revision: int, why: str) -> bool:
        """Take a job's lease (compare-and-set on `revision`); True if this replica has it."""
        assert self.state is not None
        value = self.book.value(job_id, time.time())
        new = await self.state.take(records.job_hash(job_id), value, revision)
        if new is None:
            await self._read_lease(records.job_hash(job_id))
            return False
        self.book.observe(records.job_hash(job_id), value, new)
        self.registry.touch(job_id, self.clock())  # Its idle clock starts with its new owner.
        if revision:
            LOG.info("job %s: taken over by replica %s (%s)", job_id, self.book.me, why)
            await self.status(job_id, "taken_over",
                              f"coordinator replica {self.book.me} drives the job now ({why})")
        return True

    async def _give_up_jobs(self) -> None:
        """At shutdown: record what is unsaved, then give the leases up.

        Another replica then takes the jobs at once, from their latest progress.
        """
        if self.state is None or self.nc is None or not self.nc.is_connected:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._record_unsaved(stopping=True),
                                   self.settings.shutdown_timeout_s)
        state, gate = self.state, asyncio.Semaphore(RELEASES_IN_FLIGHT)

        async def release(job_hash: str, lease: Lease) -> None:
            value = self.book.value(lease.job_id, time.time(), release=True)
            async with gate:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(state.take(job_hash, value, lease.revision), 2)

        # Side by side and bounded: one at a time, thousands of jobs took minutes to give up
        # (a lease not given up in time simply runs out, and another replica takes it then).
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(*(release(h, lease) for h, lease in self.book.renewals())),
                self.settings.shutdown_timeout_s)

    async def _save_progress(self, job_id: str, job: JobOptimizer) -> None:
        """Record the optimiser's progress, so a replica taking the job over resumes it.

        The write runs beside the job, not in its way: callers hold the job's lock, and a
        write waits out a stream leader election (seconds) during which the job's windows
        must go on. Writes stay in order (`_write_progress`) and are flushed at shutdown.
        """
        state = job.persisted()
        if state is not None and self.state is not None:
            self._unsaved[job_id] = ("pipeline" if isinstance(job, PipelineJob) else "windows",
                                     state)
            self._spawn(self._write_progress(job_id))

    async def _record(self, job_id: str, kind: str, state: Any) -> None:
        """Write a job's progress, or keep it to write again later.

        Only the latest progress matters: it is what `_unsaved` holds until JetStream has it,
        written again on every ownership round if JetStream cannot take it now. Writes of one
        job are serialised and each writes the latest progress, so a slow write of older
        progress (retried through a leader election) never lands after a newer one.
        """
        if self.state is None:
            return
        self._unsaved[job_id] = (kind, state)
        await self._write_progress(job_id)

    async def _write_progress(self, job_id: str, stopping: bool = False) -> None:
        lock = self._progress_locks.setdefault(job_id, asyncio.Lock())
        async with lock:
            latest = self._unsaved.get(job_id)
            if latest is None or self.state is None:
                return  # A write that waited for the lock wrote it already.
            if not stopping and not self.owns(job_id):
                # Fenced (its lease could not be renewed): written once it is renewed, dropped
                # once another replica holds the job (`_record_unsaved`).
                return
            try:
                await self.state.put_progress(job_id, *latest)
            except StateUnavailableError as e:
                if job_id not in self._unsaved_warned:
                    self._unsaved_warned.add(job_id)
                    LOG.warning("job %s: progress not recorded yet (%s); writing it again until "
                                "JetStream takes it", job_id, e)
                return
            self.writes += 1
            self._unsaved_warned.discard(job_id)
            if self._unsaved.get(job_id) is latest:
                del self._unsaved[job_id]

    async def _record_unsaved(self, stopping: bool = False) -> None:
        """Write again the progress JetStream could not take (a stream leader election).

        `stopping`: before this replica gives its leases up, its latest progress is written
        even if it could not renew a lease meanwhile, as long as no other replica holds it.
        """
        for job_id in list(self._unsaved):
            holder = self.book.owner(records.job_hash(job_id), time.time())
            if holder is not None and holder != self.book.me:
                self._unsaved.pop(job_id, None)  # Not ours to write any more.
            elif stopping or self.owns(job_id):
                await self._write_progress(job_id, stopping)

    async def _known_job(self, job_id: str) -> None:
        """Make sure this replica knows a job registered through another (its view may lag)."""
        if job_id in self.registry.jobs or self.state is None:
            return
        with contextlib.suppress(StateUnavailableError, RecordError):
            record = await self.state.get_job(job_id)
            if record is not None:
                self._job_ids[records.job_hash(job_id)] = job_id
                self.registry.apply_job(record)

    def profile_path(self, record: JobRecord) -> Path:
        """The coordinator's own copy of a job's profile (a name it makes, in its state dir)."""
        return self.state_dir / "profiles" / f"{subjects.token(record.job_id)}.json"

    # ------------------------------------------------------------------ endpoints
    def _endpoint(self, handler: Handler) -> Callable[[Any], Awaitable[None]]:
        """Wrap a handler: one task per request; domain errors become coded replies.

        Nothing that goes wrong with one request leaves its task (a task of the service's task
        group: an exception there would stop the whole service): a failure while handling it
        is answered `internal`, one while answering it is logged.
        """

        async def answer(req: Any) -> None:
            try:
                reply = await handler(req.data, req.subject)
            except PayloadError as e:
                reply = Reply.failure("bad_request", str(e))
            except RegistryError as e:
                reply = Reply.failure(e.code, str(e))
            except Exception:  # noqa: BLE001 - never leak internals
                LOG.exception("request on %s failed", bounded(req.subject, 300))
                reply = INTERNAL_REPLY
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
                    self._drop("reply_not_an_inbox", req.subject, shown(inbox, 300))
                    return
                await answer(req)
            except Exception:  # noqa: BLE001 - the last guard of the service's task group
                LOG.exception("a request on %s failed outside its handler",
                              bounded(getattr(req, "subject", "?"), 300))

        async def wrapped(req: Any) -> None:
            self._spawn(handle(req))

        return wrapped

    def _own_endpoint(self, handler: Handler) -> Callable[[Any], Awaitable[None]]:
        """Wrap a handler for this replica's own subject (requests forwarded by replicas)."""
        endpoint = self._endpoint(handler)

        async def handle(msg: Any) -> None:
            await endpoint(_Forwarded(msg))

        return handle

    async def _forward(self, job_id: str, endpoint: str, data: bytes,
                       subject: str) -> Reply | None:
        """Ask the job's owning replica when it is another one (None: answer here).

        A request forwarded to this replica is answered here (never forwarded again).
        """
        owner = self.book.owner(records.job_hash(job_id), time.time())
        if (owner is None or owner == self.book.me or self.nc is None
                or subject.startswith(subjects.all_coord_replicas(self.settings.prefix)[:-1])):
            return None
        subject = subjects.coord_replica(owner, endpoint, self.settings.prefix)
        try:
            msg = await self.nc.request(subject, data, timeout=self.settings.command_timeout_s)
            return codec.decode(msg.data, Reply)
        except Exception as e:  # noqa: BLE001 - the owner died meanwhile: answer here
            LOG.warning("replica %s did not answer a %s about job %s: %s", owner, endpoint,
                        job_id, e)
            return None

    async def handle_register_job(self, data: bytes, subject: str = "") -> Reply:
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
        for _ in range(8):
            record = self.registry.register_job(request, self.clock(), node, datetime.now(),
                                                join_token=token)
            try:
                created = await self._state().create_job(record)
            except StateUnavailableError:
                self.registry.unregister_job(record.job_id)
                raise
            if created:
                break
            # Another replica registered a job with this id meanwhile: learn it, take the next.
            self.registry.unregister_job(record.job_id)
            await self._known_job(record.job_id)
        else:
            raise StateUnavailableError("could not give the job a unique id; retry")
        self.writes += 1
        self._job_ids[records.job_hash(record.job_id)] = record.job_id
        await self._take(record.job_id, 0, "registered here")
        what = "power-limit optimisation" if request.power_limit else request.scheduler
        await self.status(record.job_id, "registered",
                          f"job registered for {what}; "
                          f"waiting for {record.job.world_size} rank(s)")
        return Reply.success(job_id=record.job_id, join_token=token)

    async def handle_register_rank(self, data: bytes, subject: str = "") -> Reply:
        """Register a rank after checking its GPU with the agent that drives it.

        Only the agent of the GPU's node may register it: the subject names the node the
        request came through.
        """
        request = codec.decode(data, RegisterRank)
        gpu = request.gpu
        via = subjects.last_token(subject)
        await self._known_job(request.job_id)
        if via != subjects.token(gpu.node):
            return Reply.failure(
                "forbidden",
                f"a rank on node {gpu.node!r} must be registered through that node's agent, not "
                f"through {shown(via)}: run the trainer on the node of its GPU",
            )
        retry = self.registry.check_rank(request)  # Refuse bad requests before asking agents.
        info: GpuDescription | None = None
        if not retry:
            info = request.gpu_info  # Set by the agent that relayed it (only it may).
            if info is None or info.index != gpu.gpu_index:
                info = await self._gpu_info(gpu.node, gpu.gpu_index)
            else:
                self._know_gpu(gpu.node, info)
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
                held = self.registry.jobs.get(request.job_id)
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
        # The job may have gone or the rank been taken meanwhile (here, or through another
        # replica: the state bucket decides, once): this checks again.
        self.registry.check_rank(request)
        mine = (request.job_id, request.rank_info.rank)
        self._registering.add(mine)  # This handler, not the state watch, starts the job.
        try:
            limits = (info.min_power_limit_w, info.max_power_limit_w) if info else None
            new = await self._state().create_rank(
                request.job_id, RankRecord(info=request.rank_info, gpu=request.gpu), limits)
        finally:
            self._registering.discard(mine)
        record, _ = self.registry.register_rank(request, self.clock())
        n, world = len(record.ranks), record.job.world_size  # Before awaiting anything.
        if new:
            self.writes += 2
            # One event per rank is too many to follow for big jobs: then every 10 %.
            if world <= RANK_STATUS_EVERY_UP_TO or n * 10 // world != (n - 1) * 10 // world:
                await self.status(record.job_id, "rank_registered",
                                  f"rank {request.rank_info.rank} on {gpu.node}/gpu"
                                  f"{gpu.gpu_index} ({n}/{world} ranks registered)")
            if record.complete:
                self._maybe_start(record)
        return Reply.success(job_id=record.job_id, rank=request.rank_info.rank,
                             registered=n, world_size=world)

    async def handle_query(self, data: bytes, subject: str = "") -> Reply:
        """Describe one job, or list all jobs."""
        query = codec.decode(data, JobQuery)
        if query.job_id is None:
            ids = sorted(self.registry.jobs)
            end = query.offset + query.limit
            return Reply.success(jobs=ids[query.offset:end], total=len(ids),
                                 next_offset=end if end < len(ids) else None)
        await self._known_job(query.job_id)
        record = self.registry.get(query.job_id)
        forwarded = await self._forward(record.job_id, "query", data, subject)
        if forwarded is not None:
            return forwarded
        optimiser = self.optimisers.get(record.job_id)
        pipeline = optimiser.progress() if isinstance(optimiser, PipelineJob) else None
        job = optimiser if isinstance(optimiser, PowerLimitJob) else None
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
            power_limit=job.progress() if job else None,
            pipeline=pipeline,
            waiting_for=optimiser.waiting_for() if optimiser is not None else {},
        )

    async def handle_straggler(self, data: bytes, subject: str = "") -> Reply:
        """A straggler notice about one pipeline of a pipeline job (or its clearing)."""
        notice = codec.decode(data, StragglerNotice)
        await self._known_job(notice.job_id)
        record = self.registry.get(notice.job_id)
        forwarded = await self._forward(record.job_id, "straggler", data, subject)
        if forwarded is not None:
            return forwarded
        if record.power_limit is not None:
            return Reply.failure(
                "not_supported",
                f"job {record.job_id} is optimised by the power-limit optimizer: straggler "
                "notices are for pipeline jobs (pipeline frequency optimizer)")
        async with self._lock(record.job_id):
            job = self.optimisers.get(record.job_id)
            if not isinstance(job, PipelineJob):
                why = ("it refused to start: see the job's status" if record.complete else
                       f"{len(record.ranks)}/{record.job.world_size} ranks registered: send the "
                       "notice again later")
                return Reply.failure(
                    "unavailable", f"job {record.job_id}'s optimiser is not running ({why})")
            try:
                actions = job.set_straggler(notice.pipeline, None if notice.clear
                                            else notice.factor)
            except StragglerError as e:
                return Reply.failure(e.code, str(e))
            await self._execute(record, actions)
            await self._save_progress(record.job_id, job)
            progress = job.progress()
        message = next((a.message for a in reversed(actions) if isinstance(a, StatusUpdate)), "")
        return Reply.success(job_id=record.job_id, stragglers=progress["stragglers"],
                             slowed=progress["slowed"], schedule=progress["schedule"],
                             message=message)

    def _know_gpu(self, node: str, info: GpuDescription, now: float | None = None) -> None:
        """Remember a GPU's description (its power-limit range above all)."""
        key = (node, info.index)
        self._gpu_info_cache[key] = (self.clock() if now is None else now, info)
        self.gpu_limits[key] = (info.min_power_limit_w, info.max_power_limit_w)

    async def _gpu_info(self, node: str, index: int) -> GpuDescription | None:
        """The agent's description of a GPU (cached for `GPU_INFO_TTL_S`), None if no answer."""
        key = (node, index)
        cached = self._gpu_info_cache.get(key)
        now = self.clock()
        if cached is not None and now - cached[0] < GPU_INFO_TTL_S:
            return cached[1]
        subject = subjects.gpu_command(node, index, self.settings.prefix)
        try:
            raw = await self.nc.request(subject, INFO_COMMAND,
                                        timeout=self.settings.command_timeout_s)
            reply = codec.decode(raw.data, Reply)
            if not reply.ok:
                LOG.warning("agent on %s refused info: %s", subject, reply.error)
                return None
            info = codec.validate(GpuDescription, reply.result.get("gpu"))
        except Exception as e:  # noqa: BLE001 - timeout, no responders, bad reply
            LOG.warning("no usable info from %s: %s", subject, e)
            return None
        self._know_gpu(node, info, now)
        return info

    # ------------------------------------------------------------------ power-limit jobs
    async def _start_optimiser(self, record: JobRecord) -> None:
        try:
            async with self._lock(record.job_id):
                if record.job_id in self.optimisers or not self.owns(record.job_id):
                    return
                if self.registry.jobs.get(record.job_id) is not record:
                    return  # Collected meanwhile.
                if not await self._read_progress(record.job_id):
                    return  # Started again on a later ownership round.
                if record.power_limit is None:
                    await self._start_pipeline(record)
                else:
                    await self._start_power_limit(record)
        finally:
            self._starting.discard(record.job_id)
        self.progress.pop(record.job_id, None)  # Taken in by the optimiser (if it started).

    async def _read_progress(self, job_id: str) -> bool:
        """Read the job's recorded progress from JetStream itself before resuming it.

        The watched view can lag behind the bucket after a stream leader election; a replica
        that resumed from it would redo what the previous owner recorded, or worse, command
        the limits of an older step of the search. So a job is resumed only from what the
        bucket holds now: False if it cannot be read (the job is started on a later round).
        """
        if self.state is None:
            return True
        try:
            recorded = await self.state.get_progress(job_id)
        except StateUnavailableError as e:
            LOG.warning("job %s: not resumed yet, its progress cannot be read (%s)", job_id, e)
            return False
        except RecordError as e:
            LOG.warning("job %s: its recorded progress is unreadable (%s); starting afresh",
                        job_id, e)
            recorded = None
        if recorded:
            self.progress[job_id] = recorded
        else:
            self.progress.pop(job_id, None)
        return True

    async def _start_power_limit(self, record: JobRecord) -> None:
        """Start a power-limit job's optimiser (the lock is held)."""
        assert record.power_limit is not None
        gpus = record.gpus()
        missing = [g for g in gpus if (g.node, g.gpu_index) not in self.gpu_limits]
        await asyncio.gather(*(self._gpu_info(g.node, g.gpu_index) for g in missing))
        unreachable = [f"{g.node}/gpu{g.gpu_index}" for g in gpus
                       if (g.node, g.gpu_index) not in self.gpu_limits]
        if unreachable:
            await self.status(record.job_id, "error",
                              "cannot reach the agent of " + ", ".join(unreachable[:8])
                              + (" ..." if len(unreachable) > 8 else "")
                              + "; not optimising (restart the coordinator once they are up)")
            return
        limits = [self.gpu_limits[(g.node, g.gpu_index)] for g in gpus]
        lo = max(lim[0] for lim in limits)
        hi = min(lim[1] for lim in limits)
        measurements = record.power_limit.profile  # the trainer's own profile file, if any
        recorded = self.progress.get(record.job_id) or {}
        resume: list[WindowResult] | dict[str, Any] = []
        timeout = self.settings.mark_timeout_s
        try:
            if measurements is None and recorded.get("kind") == "profile":
                measurements = [PowerLimitMeasurement(**m) for m in recorded["state"]]
            elif recorded.get("kind") == "windows":  # measured before a takeover
                resume = recorded["state"]
            try:
                job = PowerLimitJob(record.job_id, record.power_limit, record.ranks, lo, hi,
                                    measurements, resume=resume, mark_timeout_s=timeout)
            except (PowerLimitError, ValueError, TypeError, KeyError) as e:
                if not resume:
                    raise
                await self.status(record.job_id, "profiling",
                                  f"cannot resume the profile measured before: {e}")
                job = PowerLimitJob(record.job_id, record.power_limit, record.ranks, lo, hi,
                                    measurements, mark_timeout_s=timeout)
        except (PowerLimitError, ValueError, OSError, TypeError, KeyError) as e:
            await self.status(record.job_id, "error",
                              f"power-limit optimiser refused to start: {e}")
            return
        await self._adopt(record, job)

    async def _start_pipeline(self, record: JobRecord) -> None:
        """Start a pipeline job's frequency optimiser (the lock is held)."""
        pfo = self.pfo

        def make_scheduler(job_info: JobInfo, ranks: list[RankInfo]) -> Any:
            return pfo.create_scheduler(job_info, ranks)

        first = await asyncio.to_thread(self._next_dump_number, record)
        recorded = self.progress.get(record.job_id) or {}
        resume = recorded.get("state") if recorded.get("kind") == "pipeline" else None

        def build(resume: dict[str, Any] | None) -> PipelineJob:
            s = self.settings
            return PipelineJob(
                record.job_id, record.job, [rr.info for rr in record.ranks.values()],
                make_scheduler, scheduler_name=pfo.scheduler,
                profiling_iterations=s.profiling_iterations,
                switch_lead_steps=s.switch_lead_steps, first_version=first,
                stall_after_s=s.stall_after_s, straggler_threshold=s.straggler_threshold,
                straggler_window=s.straggler_window, resume=resume,
                max_kept_bytes=s.max_pipeline_mb_per_job * MB, budget=self.pipeline_budget,
                nodes={r: rr.gpu.node for r, rr in record.ranks.items()})

        try:
            try:  # Replaying recorded rounds may plan a frontier: off the event loop.
                job = await asyncio.to_thread(build, resume)
            except ValueError as e:
                if resume is None:
                    raise
                await self.status(record.job_id, "discovering",
                                  f"cannot resume the recorded progress ({e}); starting over")
                job = build(None)
        except (SchedulerError, ValueError) as e:
            await self.status(record.job_id, "error", f"pipeline optimiser refused to start: {e}")
            return
        await self._adopt(record, job)

    async def _adopt(self, record: JobRecord, job: JobOptimizer) -> None:
        """Drive the job with `job` from now on (the lock is held): index its GPUs, start."""
        self.optimisers[record.job_id] = job
        for g in record.gpus():  # (The state watch may not have indexed them yet.)
            self._index_gpu(record.job_id, g)
        await self._execute(record, job.start())

    def _index_gpu(self, job_id: str, gpu: GpuBinding) -> None:
        """Note that a rank of `job_id` drives `gpu` (its stream messages name it by tokens)."""
        self._bound[subjects.token(gpu.node), subjects.token(gpu.gpu_index)] = job_id

    def _next_dump_number(self, record: JobRecord) -> int:
        """After the schedules already dumped for this job (by a coordinator before a restart)."""
        numbers = [int(p.name.split(".", 1)[0]) for p in self.dump_dir(record).glob("*.sched.json")
                   if p.name.split(".", 1)[0].isdigit()]
        return max(numbers, default=-1) + 1

    def _lock(self, job_id: str) -> asyncio.Lock:
        return self._locks.setdefault(job_id, asyncio.Lock())

    def _drop(self, reason: str, subject: str, detail: object) -> None:
        """Count a dropped stream message; log the first of each reason and then every 1000th."""
        self.dropped[reason] += 1
        n = self.dropped[reason]
        if n == 1 or n % 1000 == 0:
            LOG.warning("dropped a message on %s (%s, %d so far): %s", bounded(subject, 300),
                        reason, n, bounded(detail, 500))

    def _decode_stream(self, msg: Any, model: type[M]) -> M | None:
        """A stream message as `model`, or None (dropped and counted as malformed)."""
        try:
            return codec.decode(msg.data, model)
        except PayloadError as e:
            self._drop("malformed", msg.subject, e)
            return None

    def _bound_here(self, record: JobRecord | None, rank: int, node: str, gpu: int | None) -> bool:
        """Whether `rank` of the job is bound to a GPU of `node` (and to GPU `gpu` if given)."""
        if record is None:
            return False
        rr = record.ranks.get(rank)
        if rr is None or subjects.token(rr.gpu.node) != node:
            return False
        return gpu is None or rr.gpu.gpu_index == gpu

    def _without_token(self, record: JobRecord | None, batch: Any, subject: str) -> bool:
        """Drop (and count) events or marks whose trainer's HELLO lacked the job's join token.

        The agent sends the digest of what the HELLO presented. Returns True if dropped.
        """
        if record is None or record.admits(batch.join_digest):
            return False
        self._drop("no_join_token", subject,
                   f"rank {batch.rank} of {batch.job_id}: its trainer's HELLO did not present "
                   "the job's join token")
        return True

    def _other_replicas_job(self, job_id: str | None) -> bool:
        """Whether a stream message is about a job this replica knows another one drives."""
        return job_id is not None and job_id not in self.optimisers and not self.owns(job_id)

    async def _on_events(self, msg: Any) -> None:
        # <p...>.job.<job token>.ev.<rank>.<node>: another replica's job is not decoded.
        if self._other_replicas_job(self._job_tokens.get(msg.subject.split(".")[-4])):
            return
        batch = self._decode_stream(msg, TrainerEventBatch)
        if batch is None:
            return
        record = self.registry.jobs.get(batch.job_id)
        via = subjects.last_token(msg.subject)
        if record is None:
            self._drop("unknown_job", msg.subject, batch.job_id)
            return
        # The rank's own GPU, not just its node, and a trainer that presented the job's token:
        # an agent binds a GPU to (job, rank) on a trainer's HELLO, so any process of the node
        # that knows the job id could otherwise speak for the rank.
        if (via != subjects.token(batch.node)
                or not self._bound_here(record, batch.rank, via, batch.gpu)):
            self._drop("wrong_node", msg.subject,
                       f"rank {batch.rank} of {batch.job_id} is not bound to "
                       f"{shown(via)}/gpu{batch.gpu}")
            return
        if self._without_token(record, batch, msg.subject):
            return
        now = self.clock()
        lapsed = record is not None and now - record.last_active_s > self.settings.lease_idle_s
        self.registry.touch(batch.job_id, now)
        job = self.optimisers.get(batch.job_id)
        if job is None:
            return
        async with self._lock(batch.job_id):
            if lapsed and record is not None:
                # Renewals stopped while the job was quiet, so the agents have restored their
                # defaults: the job is back, so are its settings.
                await self._reapply(record, job, "events again after a quiet spell")
            for i, event in enumerate(batch.events, 1):
                await self._act(batch.job_id, lambda r, e: job.on_event(r, e, now), batch.rank,
                                event)
                if i % EVENTS_PER_YIELD == 0:
                    await asyncio.sleep(0)  # A huge batch lets the lease loops run meanwhile.

    async def _on_measurements(self, msg: Any) -> None:
        parts = msg.subject.split(".")  # <p...>.gpu.<node>.<gpu>.meas
        if self._other_replicas_job(self._bound.get((parts[-3], parts[-2]))):
            return
        batch = self._decode_stream(msg, MeasurementBatch)
        if batch is None:
            return
        job = self.optimisers.get(batch.job_id)
        if job is None:
            if batch.job_id not in self.registry.jobs:
                self._drop("unknown_job", msg.subject, batch.job_id)
            return
        if not batch.marks and not batch.measurements:
            return
        parts = msg.subject.split(".")  # <p...>.gpu.<node>.<gpu>.meas
        node, gpu = parts[-3], parts[-2]
        if (node != subjects.token(batch.node) or gpu != str(batch.gpu)
                or not self._bound_here(self.registry.jobs.get(batch.job_id), batch.rank, node,
                                        batch.gpu)):
            self._drop("wrong_node", msg.subject,
                       f"rank {batch.rank} of {batch.job_id} is not bound to {node}/gpu{gpu}")
            return
        if self._without_token(self.registry.jobs.get(batch.job_id), batch, msg.subject):
            return
        now = self.clock()
        async with self._lock(batch.job_id):
            for mark in batch.marks:
                await self._act(batch.job_id, job.on_mark, batch.rank, mark)
            if isinstance(job, PipelineJob) and any(m.kind == "step" for m in batch.measurements):
                # A step may close a profiling window, and the scheduler may then plan a
                # frontier for seconds: off the event loop (leases keep being renewed). The
                # job's lock keeps its inputs in order meanwhile.
                record = self.registry.jobs.get(batch.job_id)
                actions = await asyncio.to_thread(
                    lambda: [a for m in batch.measurements
                             for a in job.on_measurement(batch.rank, m, now)])
                if record is not None:
                    await self._execute(record, actions)
                    if any(isinstance(a, KeepFile | InstallSchedules) for a in actions):
                        await self._save_progress(batch.job_id, job)  # A round observed.
                return
            for m in batch.measurements:
                await self._act(batch.job_id, lambda r, x: job.on_measurement(r, x, now),
                                batch.rank, m)

    async def _on_gpu_error(self, msg: Any) -> None:
        """An agent's error event about the rank bound to one of its GPUs (a trainer gone...)."""
        event = self._decode_stream(msg, ErrorEvent)
        if event is None:
            return
        if event.job_id is None or event.rank is None:
            return
        job = self.optimisers.get(event.job_id)
        if job is None:
            return
        parts = msg.subject.split(".")  # <p...>.gpu.<node>.<gpu>.error
        # ASCII digits only: "²" is a digit to `isdigit` but not to `int`.
        gpu = int(parts[-2]) if parts[-2].isascii() and parts[-2].isdigit() else -1
        if not self._bound_here(self.registry.jobs.get(event.job_id), event.rank, parts[-3],
                                gpu):
            self._drop("wrong_node", msg.subject,
                       f"rank {event.rank} of {event.job_id} is not bound to {parts[-3]}/gpu"
                       f"{parts[-2]}")
            return
        now = self.clock()
        async with self._lock(event.job_id):
            if event.code == "lease_expired":
                restored = event.detail.get("restored")
                await self._reapply_lapsed(event.job_id, job, event.rank,
                                           restored if isinstance(restored, list) else [])
            await self._act(event.job_id,
                            lambda r, e: job.on_agent_error(r, e.code, e.message, now),
                            event.rank, event)

    def _recent_reapplies(self, job_id: str, rank: int) -> list[float]:
        """When the rank's lapsed settings were set again within the last window."""
        now, window = self.clock(), REAPPLY_WINDOW_LEASES * self.settings.lease_s
        return [t for t in self._lapse_reapplies.get((job_id, rank), []) if now - t < window]

    async def _reapply_lapsed(
        self, job_id: str, job: JobOptimizer, rank: int, restored: list[Any]
    ) -> None:
        """An agent restored settings of an active job whose lease lapsed: set them again.

        The renewals were late (a stalled replica, a slow bus) while the trainer kept going;
        without this the GPU would stay at its default until the job next went quiet. A quiet
        job's leases lapse on purpose and stay lapsed.
        """
        record = self.registry.jobs.get(job_id)
        if (record is None or rank not in record.ranks
                or self.clock() - record.last_active_s > self.settings.lease_idle_s):
            return
        if not await self._owns_now(job_id):
            lease = self.book.leases.get(records.job_hash(job_id))
            if lease is not None and lease.owner == self.book.me:
                # This replica's own lease lapsed too (the same stall that made the renewals
                # late): the agent says so only once, so keep it for when the lease is back.
                self._pending_lapses.setdefault((job_id, rank), set()).update(
                    r for r in restored if r in ("power_limit", "schedule"))
                LOG.info("job %s: rank %d's settings lapsed while this replica's lease on the "
                         "job had lapsed too; setting them again once it is taken back",
                         job_id, rank)
            return
        binding = record.ranks[rank].gpu
        where = f"{binding.node}/gpu{binding.gpu_index}"
        # Leases that lapse again and again mean renewals never reach the agent (its
        # permissions, a one-way partition): setting them again each time would only flap the
        # GPU and flood commands (the agent's events are its own to send).
        now, window = self.clock(), REAPPLY_WINDOW_LEASES * self.settings.lease_s
        recent = self._recent_reapplies(job_id, rank)
        if len(recent) >= REAPPLY_LIMIT:
            if len(recent) == REAPPLY_LIMIT:
                await self.status(job_id, "error",
                                  f"the leases on {where} lapsed {REAPPLY_LIMIT} times in "
                                  f"{window:g} s while the job was active: renewals do not reach "
                                  f"its agent (check that it may subscribe to "
                                  f"{subjects.all_lease_renewals(self.settings.prefix)}); its "
                                  "settings stay at the defaults until its agent restarts or the "
                                  "job comes back from a quiet spell")
                recent.append(now)  # Said once per window.
            self._lapse_reapplies[(job_id, rank)] = recent
            return
        self._lapse_reapplies[(job_id, rank)] = [*recent, now]
        desired = job.desired_power_limit
        if "power_limit" in restored and desired is not None:
            await self.status(job_id, "reconciled",
                              f"the lease on {where} lapsed while the job was active (late "
                              f"renewals): setting {desired} W again")
            await self.apply_power_limit(record, desired, [binding])
        wanted = job.desired_schedule(rank)
        if "schedule" in restored and wanted is not None:
            await self.status(job_id, "reconciled",
                              f"the lease on {where} lapsed while the job was active (late "
                              f"renewals): installing schedule {wanted[1]} again")
            await self.install_again(record, (wanted[0],), wanted[1])

    async def _on_agent_hello(self, msg: Any) -> None:
        """Reconcile: a GPU still driven by an optimised job's rank gets the job's limit back.

        Only a GPU whose agent says the job's trainer is bound to it (it said HELLO, again after
        an agent restart): a GPU whose trainer left stays at its default.
        """
        hello = self._decode_stream(msg, AgentHello)
        if hello is None:
            return
        node = subjects.token(hello.node)
        if node != msg.subject.split(".")[-2]:
            self._drop("wrong_node", msg.subject, f"hello names node {shown(hello.node)}")
            return
        previous = self._agent_ids.get(node)
        self._agent_ids[node] = hello.agent_id
        restarted = previous is not None and previous != hello.agent_id
        if restarted:
            LOG.info("the agent of node %s restarted (%s -> %s)", hello.node, previous,
                     hello.agent_id)
            # Its ranks' lapse throttle ends (as the error status says), whatever this first
            # announcement shows: a restarted agent has no trainers bound yet.
            for key in list(self._lapse_reapplies):
                held = self.registry.jobs.get(key[0])
                if (held is not None and key[1] in held.ranks
                        and subjects.token(held.ranks[key[1]].gpu.node) == node):
                    del self._lapse_reapplies[key]
        for gpu in hello.gpus:
            job_id = self._bound.get((node, subjects.token(gpu.index)))
            if job_id is None or gpu.job_id != job_id:
                continue
            record = self.registry.jobs.get(job_id)
            rank = record.gpu_ranks.get((hello.node, gpu.index)) if record is not None else None
            if record is None or rank is None or rank not in record.ranks:
                continue
            job = self.optimisers.get(job_id)
            if job is None or not self.owns(job_id):
                continue  # (Fenced: a replica whose lease lapsed may be being taken over.)
            if not gpu.controllable:
                # Its agent lost the privilege (or restarted observe-only): said once.
                if (job_id, node, gpu.index) not in self._observe_only_said:
                    self._observe_only_said[(job_id, node, gpu.index)] = None
                    await self.status(job_id, "error",
                                      f"{hello.node}/gpu{gpu.index} (rank {rank}) is observe-only "
                                      "now: its agent cannot change its settings, so the job's "
                                      "settings are not applied there; restart that agent "
                                      "without --observe-only, as root or with CAP_SYS_ADMIN")
                continue
            if self.clock() - record.last_active_s > self.settings.lease_idle_s:
                continue  # A quiet job: its leases lapsed on purpose.
            if len(self._recent_reapplies(job_id, rank)) >= REAPPLY_LIMIT:
                continue  # Renewals do not reach this agent (said): no flapping per heartbeat.
            binding = record.ranks[rank].gpu
            desired = job.desired_power_limit
            if desired is not None and gpu.power_limit_w != desired:
                await self.status(record.job_id, "reconciled",
                                  f"{binding.node}/gpu{gpu.index} is at {gpu.power_limit_w} W, not "
                                  f"{desired} W (its agent restarted?): setting {desired} W again")
                await self.apply_power_limit(record, desired, [binding])
            # A heartbeat may predate a recent install: only a schedule installed a while ago
            # and missing now was lost (the agent restarted).
            installed_at = self._installed_at.get((job_id, rank), 0.0)
            settled = self.clock() - installed_at > max(2.0, self.settings.command_timeout_s)
            wanted = job.desired_schedule(rank) if settled else None
            if wanted is not None and gpu.schedule_version != wanted[1]:
                await self.status(record.job_id, "reconciled",
                                  f"{binding.node}/gpu{gpu.index} has schedule "
                                  f"{gpu.schedule_version}, not {wanted[1]} (its agent "
                                  "restarted?): installing it again")
                await self.install_again(record, (wanted[0],), wanted[1])

    async def _tick_jobs(self) -> None:
        now = self.clock()
        for job_id, job in list(self.optimisers.items()):
            if job.done:
                continue
            async with self._lock(job_id):
                await self._act(job_id, _ticker(job), 0, now)

    async def _act(
        self, job_id: str, step: Callable[[int, Any], list[Action]], rank: int, item: Any
    ) -> None:
        record = self.registry.jobs.get(job_id)
        if record is None:
            return
        job = self.optimisers.get(job_id)
        plj = job if isinstance(job, PowerLimitJob) else None
        recorded = len(plj.machine.window_results) if plj else 0
        try:
            actions = step(rank, item)
        except PowerLimitError as e:
            await self.status(job_id, "error", f"power-limit optimiser: {e}")
            return
        await self._execute(record, actions)
        if job is not None and (
            (plj is not None and len(plj.machine.window_results) > recorded)
            or (plj is None and any(isinstance(a, KeepFile | InstallSchedules) for a in actions))
        ):
            await self._save_progress(job_id, job)  # A measured window survives a takeover.

    async def _execute(self, record: JobRecord, actions: list[Action]) -> None:
        if actions and not await self._owns_now(record.job_id):
            # Fenced: this replica's lease on the job is about to lapse (it could not renew
            # it), so another replica may take over: it sends no more commands.
            LOG.warning("job %s: %d action(s) not carried out: this replica's lease on the job "
                        "is lapsing", record.job_id, len(actions))
            return
        for action in actions:
            if isinstance(action, ApplyPowerLimit):
                await self.apply_power_limit(record, action.watts)
            elif isinstance(action, SaveProfile):
                path = self.profile_path(record)
                try:
                    await asyncio.to_thread(path.parent.mkdir, parents=True, exist_ok=True)
                    await asyncio.to_thread(save_profile, path, list(action.measurements))
                    where = "kept by the coordinator"
                except OSError as e:
                    where = f"not kept by the coordinator ({e.strerror or e})"
                # A replica taking the job over serves it at once.
                await self._record(record.job_id, "profile",
                                   [m.model_dump() for m in action.measurements])
                await self.status(
                    record.job_id, "profile_saved",
                    f"profile measured ({where}); the trainer's drop-in writes its profile_path",
                    {"optimal_power_limit_w": action.optimal_power_limit,
                     "measurements": [m.model_dump() for m in action.measurements]})
            elif isinstance(action, InstallSchedules):
                await self.install_schedules(record, action)
            elif isinstance(action, ClearSchedules):
                await self.clear_schedules(record)
            elif isinstance(action, KeepFile):
                await self.keep_file(record, action)
            elif isinstance(action, StatusUpdate):
                await self.status(record.job_id, action.state, action.message, action.progress)

    async def apply_power_limit(
        self, record: JobRecord, watts: int, gpus: list[GpuBinding] | None = None
    ) -> None:
        """Command every GPU of the job (or only `gpus`) to `watts`, under the job's lease."""
        cmd = codec.encode(CommandEnvelope(cmd=SetPowerLimitCmd(
            power_limit_w=watts, holder=record.job_id, lease_s=self.settings.lease_s)))
        gpus = record.gpus() if gpus is None else gpus
        replies = await self._command(record, f"setting {watts} W", [
            (subjects.gpu_command(g.node, g.gpu_index, self.settings.prefix), cmd) for g in gpus])
        if replies is not None:
            await self._report_failures(record, f"setting {watts} W", gpus, replies)

    async def _reapply(self, record: JobRecord, job: JobOptimizer, why: str) -> None:
        """Apply the job's desired settings again on all its GPUs."""
        limit = job.desired_power_limit
        if limit is not None:
            await self.status(record.job_id, "resumed", f"{why}; re-applying {limit} W")
            await self.apply_power_limit(record, limit)
        wanted = [w for r in sorted(record.ranks) if (w := job.desired_schedule(r)) is not None]
        if wanted:
            await self.status(record.job_id, "resumed",
                              f"{why}; installing schedule {wanted[0][1]} again")
            await self.install_again(record, tuple(s for s, _ in wanted), wanted[0][1])

    async def install_again(
        self, record: JobRecord, schedules: tuple[FrequencySchedule, ...], version: int
    ) -> None:
        """Install schedules of `version` again (an agent restarted, a lease lapsed).

        They switch at the step they were first sent for: a rank past it switches at its next
        iteration, one not there yet still waits for the other ranks (after a takeover that
        step is not known: at once).
        """
        from_step = self._switch_steps.get((record.job_id, version))
        await self.install_schedules(record, InstallSchedules(schedules, version, from_step))

    async def install_schedules(self, record: JobRecord, action: InstallSchedules) -> None:
        """Install each rank's schedule on the agent of its GPU, under the job's lease."""
        self._switch_steps[(record.job_id, action.version)] = action.from_step
        requests, targets = [], []
        limit = int(getattr(self.nc, "max_payload", 0) or 1 << 20)
        now = self.clock()
        for schedule in action.schedules:
            rr = record.ranks.get(schedule.rank)
            if rr is None:
                continue
            cmd = InstallScheduleCmd(job_id=record.job_id, schedule=schedule,
                                     holder=record.job_id, lease_s=self.settings.lease_s,
                                     version=action.version, from_step=action.from_step)
            payload = codec.encode(CommandEnvelope(cmd=cmd))
            if len(payload) > limit:
                job = self.optimisers.get(record.job_id)
                why = (f"the schedule of rank {schedule.rank} is {len(payload)} bytes, more than "
                       f"one NATS message carries ({limit}): too many instructions per "
                       "iteration, or names too long")
                if isinstance(job, PipelineJob):
                    await self._execute(record, job.abort(why))
                else:
                    await self.status(record.job_id, "error", why)
                return
            self._installed_at[(record.job_id, schedule.rank)] = now
            requests.append((subjects.gpu_command(rr.gpu.node, rr.gpu.gpu_index,
                                                  self.settings.prefix), payload))
            targets.append(rr.gpu)
        # Not the job's error: an agent that did not answer gets it back when it announces
        # itself again (reconciliation).
        what = f"installing schedule {action.version}"
        replies = await self._command(record, what, requests)
        if replies is not None:
            await self._report_failures(record, what, targets, replies, state="install_failed")

    async def clear_schedules(self, record: JobRecord) -> None:
        """Remove the job's schedules from its GPUs (clocks back to default)."""
        cmd = codec.encode(CommandEnvelope(cmd=ClearScheduleCmd()))
        gpus = record.gpus()
        replies = await self._command(record, "clearing the schedules", [
            (subjects.gpu_command(g.node, g.gpu_index, self.settings.prefix), cmd) for g in gpus])
        if replies is not None:
            await self._report_failures(record, "clearing the schedules", gpus, replies)

    async def _command(self, record: JobRecord, what: str,
                       requests: list[tuple[str, bytes]]) -> list[Reply | str] | None:
        """Send a job's commands to its GPUs if this replica drives the job now (else None).

        The one way a job's GPUs are commanded: ownership is checked just before the send, so
        a replica that was paused (SIGSTOP, a stalled event loop) while another took its job
        over never sets a GPU again, whatever path led here (events after a quiet spell, a
        heartbeat, a lapse, a plan that finished meanwhile).
        """
        if not requests:
            return []
        if not await self._owns_now(record.job_id):
            self.fenced_commands += len(requests)
            LOG.warning("job %s: %s not sent to %d GPU(s): this replica no longer drives the job",
                        record.job_id, what, len(requests))
            return None
        return await self.request_all(requests)

    async def _report_failures(self, record: JobRecord, what: str, gpus: list[GpuBinding],
                               replies: list[Reply | str], state: str = "error") -> None:
        """Say which GPUs did not take a command.

        A GPU whose trainer left (`trainer_left`) is no failure of the job: a command may cross
        the trainer's goodbye, and a trainer that died is reported by its agent (`trainer_gone`).
        """
        errors = [
            f"{g.node}/gpu{g.gpu_index}: {r if isinstance(r, str) else r.error}"
            for g, r in zip(gpus, replies, strict=True)
            if isinstance(r, str) or not (r.ok or r.code == "trainer_left")
        ]
        if errors:
            more = f"; ... ({len(errors)} in all)" if len(errors) > 8 else ""
            await self.status(record.job_id, state,
                              f"{what} failed on " + "; ".join(errors[:8]) + more)

    def dump_dir(self, record: JobRecord) -> Path:
        """The job's dump directory: `<dump_dir>/<job id>` (a token if the id is unsafe)."""
        return Path(self.pfo.dump_dir) / job_dir_name(record.job_id)

    async def keep_file(self, record: JobRecord, action: KeepFile) -> None:
        """Write a dump file of the job when dumping is on (`ZEUS_PFO_DUMP_DATA`)."""
        if not self.pfo.dump_data:
            return
        path = self.dump_dir(record) / action.name
        try:
            written = await asyncio.to_thread(keep_dump, path, action.content)
        except OSError as e:
            LOG.warning("job %s: could not write %s: %s", record.job_id, path, e)
            return
        if written is not None and written != path:
            LOG.info("job %s: %s holds other data (dumped before a restart, its progress not "
                     "recorded yet): kept, the new dump is %s", record.job_id, path.name,
                     written.name)

    async def request_all(self, requests: list[tuple[str, bytes]]) -> list[Reply | str]:
        """Send many requests at once over one reply inbox, within `command_timeout_s`.

        Cheaper than one `nc.request` per GPU (no future, timer and task each), which matters
        when a job has thousands of GPUs.

        Returns:
            Per request, in order: the `Reply`, or a text saying why there is none.
        """
        if not requests:
            return []
        inbox = self.nc.new_inbox()
        results: list[Reply | str | None] = [None] * len(requests)
        left = len(requests)
        all_in = asyncio.Event()

        async def on_reply(msg: Any) -> None:
            nonlocal left
            try:
                i = int(msg.subject.rsplit(".", 1)[1])
                if results[i] is not None:
                    return
            except (ValueError, IndexError):
                return
            if not msg.data and msg.headers and msg.headers.get("Status") == "503":
                results[i] = "no agent answers (is zeus-agent running there?)"
            else:
                try:
                    results[i] = codec.decode(msg.data, Reply)
                except PayloadError as e:
                    results[i] = f"bad reply: {e}"
            left -= 1
            if left == 0:
                all_in.set()

        sub = await self.nc.subscribe(f"{inbox}.*", cb=on_reply)
        try:
            for i, (subject, payload) in enumerate(requests):
                await self.nc.publish(subject, payload, reply=f"{inbox}.{i}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(all_in.wait(), self.settings.command_timeout_s)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        timeout = f"no reply within {self.settings.command_timeout_s:g} s"
        return [timeout if r is None else r for r in results]

    async def status(
        self, job_id: str, state: str, message: str, progress: dict[str, Any] | None = None
    ) -> None:
        """Publish a job status event (and log it)."""
        message = bounded(message)  # It often names what a peer sent.
        LOG.info("job %s: %s: %s", job_id, state, message)
        try:
            event = JobStatus(job_id=job_id, state=state, message=message,
                              progress=progress or {})
            await self.nc.publish(subjects.job_status(job_id, self.settings.prefix),
                                  codec.encode(event))
        except Exception as e:  # noqa: BLE001 - a status that cannot go out stops nothing
            LOG.warning("job %s: status %s not published: %s", job_id, state, bounded(e, 300))

    # ------------------------------------------------------------------ loops
    async def _renew_leases(self) -> None:
        now = self.clock()
        for record in list(self.registry.jobs.values()):
            if now - record.last_active_s > self.settings.lease_idle_s or not self.owns(
                    record.job_id):
                continue
            renewal = LeaseRenewal(holder=record.job_id, lease_s=self.settings.lease_s)
            await self.nc.publish(subjects.lease_renewal(record.job_id, self.settings.prefix),
                                  codec.encode(renewal))

    async def _collect_idle(self) -> None:
        """Remove the owned jobs idle for longer than `max_job_idle_time`."""
        now, limit = self.clock(), self.settings.max_job_idle_time
        idle = [j for j, r in list(self.registry.jobs.items())
                if now - r.last_active_s > limit and self.owns(j)]
        for job_id in idle:
            if self.state is not None:
                try:
                    await self.state.delete_job(job_id)
                except StateUnavailableError as e:
                    LOG.warning("job %s: not removed (%s); trying again later", job_id, e)
                    continue
            self._forget_job(job_id)
            await self.status(job_id, "removed",
                              f"job removed after {self.settings.max_job_idle_time} s without "
                              "events or registrations (max_job_idle_time)")


INTERNAL_REPLY = Reply.failure("internal", "internal error in the coordinator; see its log")
"""The answer to a request whose handling failed in a way the coordinator did not expect."""
RELEASES_IN_FLIGHT = 64
"""Job leases given up at once at shutdown (JetStream KV updates in flight)."""
REAPPLY_LIMIT = 3
"""Most times one rank's lapsed settings are set again within `REAPPLY_WINDOW_LEASES` leases."""
REAPPLY_WINDOW_LEASES = 10


def _ticker(job: JobOptimizer) -> Callable[[int, Any], list[Action]]:
    """`job.tick` in the shape `_act` feeds (rank, item): the item is the time."""
    return lambda _rank, now_s: job.tick(now_s)


class _Forwarded:
    """A plain NATS message in the shape of a `nats.micro` request (what `_endpoint` reads)."""

    def __init__(self, msg: Any) -> None:
        self._msg = msg
        self.subject = msg.subject
        self.data = msg.data

    async def respond(self, data: bytes) -> None:
        await self._msg.respond(data)


def _tune_gc() -> None:
    """Once per process, after start-up: fewer garbage collections.

    What start-up made lives as long as the process (frozen: out of the collector's way), and
    a registration burst makes many short-lived objects: with Python's default thresholds a
    replica spent ~25 % of its CPU collecting (bench/register_ranks.py).
    """
    global _gc_tuned
    if not _gc_tuned:
        _gc_tuned = True
        gc.freeze()
        gc.set_threshold(GC_THRESHOLD, 20, 20)
