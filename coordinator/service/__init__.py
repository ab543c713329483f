"""`CoordinatorService`: the coordinator's NATS shell (config in, `serve()` runs it).

The shell is lifecycle plus thin adapters, each in its own module:

* `endpoints`: the request handlers (register jobs and ranks, queries, straggler notices);
* `streams`: the streams it follows (trainer events, GPU marks and measurements, agents' error
  events and announcements, on which GPUs are reconciled);
* `actions`: carries out what the optimisers return;
* `commands`: the one way GPUs are commanded (fenced by the leases);
* `leases`: this replica's ownership leases (`owns`, and `owns_now`, the fence every action
  passes); `replicas`: the ownership loop that takes and renews them, GPU lease renewals, idle
  jobs;
* `durable`: the view of the JetStream state bucket; `progress`: the jobs' progress writes, and
  their reading before a takeover;
* `starter`: builds a job's optimiser once every rank is in; `failures`: a job that fails ends
  there, quarantined;
* `table`: `JobTable`, the jobs this replica knows, each one `JobDriver` (`driver`: its record
  and everything this replica holds about it) found by id, state key, subject token or GPU;
  forgetting a job is one call there; `gpus`: the GPUs' descriptions;
* `link`: the NATS connection and state bucket as the helpers reach them, status events and
  drop counts.

Each helper receives the collaborators it uses (the table, the link, the clock, the settings,
the helpers it calls), never the service; `CoordinatorService` builds them in dependency order
and runs their loops.

The optimisers (`coordinator.optimizer`) say everything through actions: the shell never
checks which optimiser drives a job nor reads its internals.

Shutdown (aiohttp's order): intake stops first (endpoints and subscriptions), in-flight
requests get `shutdown_timeout_s` to finish, the loops are cancelled; then everything start-up
acquired is released in the reverse order (`zeus_agent.aio.Releases`, each pushed where it is
acquired): the jobs' unsaved progress is recorded and their leases given up (another replica
takes them at once), the state buckets are no longer followed, NATS is drained, the status
server closed, the embedded nats-server stopped last. One release failing skips no other.

Never deaf: if the NATS server closes the connection for good, the coordinator exits with
`BUS_LOST` (4) so its supervisor starts a fresh one; `/healthz` (`status_port`, beside the
Prometheus `/metrics` of `coordinator.metrics`) answers 503 while it is disconnected or closed.
After a reconnection it pings the agents, whose announcements reconcile every GPU's settings.
The coordinator never opens a path a client names (its copies of profiles live in
`state_dir/profiles/` under names it makes).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import secrets
import sys
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from coordinator import metrics
from coordinator.budget.budgets import Cluster as BudgetCluster
from coordinator.budget.job_caps import cap_profiling_jobs
from coordinator.budget.job_views import job_views
from coordinator.budget.loop import PERIOD_S as BUDGET_PERIOD_S
from coordinator.budget.loop import BudgetLoop
from coordinator.budget.points import reprofile_jobs, serve_points
from coordinator.budget.remote import FRONTIER_PREFIX, POINT_PREFIX, TIMING_PREFIX
from coordinator.budget.service import BudgetService
from coordinator.budget.store import LIFTED_PREFIX, BudgetView
from coordinator.budget.store import PREFIX as BUDGET_PREFIX
from coordinator.config import CoordinatorSettings
from coordinator.jobs import JobRegistry
from coordinator.optimizer import JobOptimizer
from coordinator.service.actions import ActionExecutor
from coordinator.service.commands import GpuCommands
from coordinator.service.durable import DurableState
from coordinator.service.endpoints import Endpoints
from coordinator.service.failures import JobFailures
from coordinator.service.gpus import GpuDirectory
from coordinator.service.leases import Leases
from coordinator.service.link import Link
from coordinator.service.owned import OwnedStreams
from coordinator.service.progress import ProgressWriter
from coordinator.service.replicas import Replicas
from coordinator.service.starter import OptimiserStarter
from coordinator.service.streams import Streams
from coordinator.service.table import JobTable
from coordinator.state import OwnershipBook, records
from coordinator.state.jetstream import JetStreamState
from zeus_agent import __version__, status_http
from zeus_agent.aio import ExitSignals, Releases, every
from zeus_agent.broker import EmbeddedNats, confirm_subscriptions, connect, redact_url
from zeus_agent.bus import BusHealth
from zeus_agent.history import History
from zeus_agent.wire import subjects

__all__ = ["CoordinatorService"]

LOG = logging.getLogger(__name__)

TICK_S = 1.0
"""How often the jobs' timers (overdue windows) are checked (s)."""
OWNERSHIP_POLL_S = 0.5
"""How often leases are checked for jobs to take over (renewals: every lease / 3)."""
GC_THRESHOLD = 20_000
"""Allocations between young-generation collections (Python's default: 700)."""
GC_THRESHOLD_1 = 200
"""Young collections between middle-generation ones (Python's default: 10). A registration
burst keeps thousands of requests in flight for seconds: each young collection moves them to the
middle generation, where a collection every 20 young ones walked them all again before they
finished (0.12-0.14 CPU-s of a replica's ~2.5 for 16,384 ranks); at 200 they are gone first."""
GC_THRESHOLD_2 = 2
"""Middle-generation collections between full ones: a full one after about 600 young ones (440
before: Python collects a generation once its count exceeds the threshold), so old cyclic
garbage is collected about as often as it was (Python's 25 % rule applies too)."""
_gc_tuned = False


class CoordinatorService(ExitSignals):
    """The coordinator. `await serve()` runs until `should_exit` is set.

    Attributes:
        jobs: Every job this replica knows (`JobTable`: one `JobDriver` each).
        registry: The jobs' records, ranks and quotas (the table adds and removes its jobs).
        link: The NATS connection and state bucket as the helpers reach them.
        book: The ownership leases this replica knows of (`leases` takes and renews them).
    """

    def __init__(
        self, settings: CoordinatorSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.state_dir = Path(settings.state_dir)
        self.registry = JobRegistry(settings.max_jobs, settings.max_jobs_per_node,
                                    settings.max_ranks_per_node)
        self.pfo = settings.pfo_settings()
        # This process's incarnation: in every lease it writes (`OwnershipBook`).
        self.book = OwnershipBook(settings.replica_name, settings.effective_ownership_lease_s,
                                  secrets.token_hex(8))
        self.jobs = JobTable(self.registry)
        self.link = Link(settings.prefix)
        self._build_helpers()
        super().__init__()
        self.started = asyncio.Event()
        self._embedded: EmbeddedNats | None = None
        self._service: Any = None
        self._subs: list[Any] = []
        self._tg: asyncio.TaskGroup | None = None
        self._inflight: set[asyncio.Task[Any]] = set()
        self.bus = BusHealth("coordinator", self, on_reconnect=self._reconnected)
        """The NATS connection's state (`/healthz`); the exit when the server closed it."""
        self._releases = Releases(LOG)
        """What start-up acquired, released in the reverse order at shutdown."""
        self._status_server: status_http.StatusServer | None = None

    def _build_helpers(self) -> None:
        """The helpers, each given what it uses, in dependency order."""
        s, pfo, clock, jobs, link, spawn = (self.settings, self.pfo, self.clock, self.jobs,
                                            self.link, self.spawn)
        self.gpus = GpuDirectory(s, clock, link)
        self.leases = Leases(self.book, jobs, link, clock, self.state_dir, s.handover_after_s)
        self.commands = GpuCommands(s, link, self.leases)
        self.progress = ProgressWriter(jobs, link, self.leases, spawn)
        self.failures = JobFailures(settings=s, jobs=jobs, link=link, commands=self.commands,
                                    spawn=spawn)
        self.actions = ActionExecutor(settings=s, pfo=pfo, clock=clock, jobs=jobs, link=link,
                                      leases=self.leases, commands=self.commands,
                                      failures=self.failures, progress=self.progress)
        self.starter = OptimiserStarter(settings=s, pfo=pfo, clock=clock, jobs=jobs, link=link,
                                        leases=self.leases, gpus=self.gpus,
                                        progress=self.progress, failures=self.failures,
                                        actions=self.actions, spawn=spawn)
        self.durable = DurableState(state_dir=self.state_dir, clock=clock, jobs=jobs, link=link,
                                    book=self.book, gpus=self.gpus, failures=self.failures,
                                    starter=self.starter, spawn=spawn)
        self.streams = Streams(settings=s, clock=clock, jobs=jobs, link=link, leases=self.leases,
                               actions=self.actions, failures=self.failures)
        self.owned = OwnedStreams(link, self.streams.job_subscriptions)
        self.leases.on_taken = self.owned.follow
        self.durable.on_new_job = self._claim_new_job
        self.replicas = Replicas(settings=s, clock=clock, jobs=jobs, link=link,
                                 leases=self.leases, starter=self.starter, streams=self.streams,
                                 owned=self.owned, progress=self.progress,
                                 failures=self.failures, spawn=spawn)
        cluster = BudgetCluster()  # What the budget service learns, what the loop plans on.
        self.budget_view = BudgetView()
        self.budget_loop = BudgetLoop(link=link, book=self.book, cluster=cluster,
                                      jobs=lambda: job_views(jobs.drivers(),
                                                             self.budget_view.remote),
                                      cap_lease_s=max(10.0, 3 * self.book.lease_s),
                                      view=self.budget_view, serve=lambda points: serve_points(
                                          jobs.drivers(), self.actions.execute, points),
                                      cap_jobs=lambda caps, governed: cap_profiling_jobs(
                                          jobs.drivers(), self.actions.execute, caps, governed),
                                      margin_pct=s.budget_margin_pct,
                                      reprofile=lambda ids: reprofile_jobs(
                                          jobs.drivers(), self.actions.execute, ids))
        self.budgets = BudgetService(s.prefix, link, cluster, on_lift=self.budget_loop.lift)
        self.endpoints = Endpoints(settings=s, pfo=pfo, clock=clock, jobs=jobs, link=link,
                                   leases=self.leases, gpus=self.gpus, durable=self.durable,
                                   starter=self.starter, failures=self.failures,
                                   actions=self.actions, spawn=spawn)

    # ------------------------------------------------------------------ the link's state
    @property
    def nc(self) -> Any:
        """The NATS connection (None before start-up and once drained)."""
        return self.link.nc

    @property
    def dropped(self) -> Counter[str]:
        """Stream messages dropped, by reason (spoofed node, unknown rank...)."""
        return self.link.dropped

    # ------------------------------------------------------------------ jobs
    @property
    def optimisers(self) -> dict[str, JobOptimizer]:
        """The optimisers driven by this replica, by job id (readable from any thread)."""
        return self.jobs.optimisers()

    @property
    def pipeline_jobs(self) -> dict[str, Any]:
        """The pipeline frequency optimisers driven here, by job id (the demo reads their plans)."""
        return {j: o for j, o in self.optimisers.items() if o.kind == "pipeline"}

    @property
    def fenced_commands(self) -> int:
        """GPU commands not sent: the job was no longer this replica's."""
        return self.commands.fenced

    def owns(self, job_id: str) -> bool:
        """Whether this replica drives the job now."""
        return self.leases.owns(job_id)

    def _claim_new_job(self, job_id: str) -> None:
        """A job another replica registered: take it at once if this replica should drive it."""
        job_hash = records.job_hash(job_id)
        if (self.book.leases.get(job_hash) is None
                and self.leases.prefer(job_hash) == self.book.me and self.link.state is not None):
            self.spawn(self.leases.take(job_id, 0, "this replica is preferred for it"))

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run `coro` as a task of the service's task group (inline before it exists).

        An exception it raises is logged, never raised into the task group, which would stop
        the whole replica (a job's own failures are handled before: `JobFailures`).
        """
        guarded = _guarded(coro)
        task = (asyncio.ensure_future(guarded) if self._tg is None
                else self._tg.create_task(guarded))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str | None:
        """The NATS URL in use (the embedded server's when there is one)."""
        return self._embedded.url if self._embedded else self.settings.nats_url

    async def serve(self) -> None:
        """Start, serve until asked to exit, shut down (always).

        Raises:
            BrokerError: NATS could not be reached (nothing was served).
        """
        try:
            await self.startup()
            s = self.settings
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                loops = [tg.create_task(every(period, loop, name, first_now=first_now,
                                              wake=wake))
                         for period, loop, name, first_now, wake in (
                    (s.lease_s / 3, self.replicas.renew_gpu_leases, "lease renewal", False,
                     None),
                    (TICK_S, self.actions.tick_jobs, "job timers", False, None),
                    (self.leases.period_s, self.leases.announce, "replica announcements",
                     True, None),
                    (min(OWNERSHIP_POLL_S, self.book.lease_s / 3), self.replicas.ownership,
                     "job ownership", True, None),
                    (min(60.0, s.max_job_idle_time / 10), self.replicas.collect_idle,
                     "idle job collection", False, None),
                    (BUDGET_PERIOD_S, self.budget_loop.tick, "power budgets", False,
                     self.budget_view.changed),
                )]
                self.started.set()
                await self.should_exit.wait()
                # The last release, run now: no new request while those in flight finish.
                await self._stop_intake()
                cancelled = await self.finish(self._inflight, s.shutdown_timeout_s,
                                              "coordinator shutting down")
                if cancelled:
                    LOG.warning("cancelled %d request(s) still running at shutdown", cancelled)
                for t in loops:
                    t.cancel()
        finally:
            self._tg = None
            await self.shutdown()

    @property
    def exit_code(self) -> int:
        """What the process should exit with: 0, or `BUS_LOST` (the server closed NATS)."""
        return self.bus.exit_code

    @property
    def bus_state(self) -> tuple[str, float, str]:
        """(state, since (Unix time), reason) of the NATS connection (`BusHealth.state`)."""
        return self.bus.state

    async def startup(self) -> None:
        """Restore state, connect, serve endpoints and follow job streams.

        Each resource is pushed on `_releases` as it is acquired: `shutdown` releases what a
        start-up that failed half-way acquired, in the reverse order.
        """
        s, release = self.settings, self._releases.push
        self.state_dir.mkdir(parents=True, exist_ok=True)
        probe = self.state_dir / f".write-probe-{os.getpid()}"
        probe.write_text("")  # An unwritable state directory fails here, before serving.
        probe.unlink()
        if s.embedded_nats:  # Its JetStream store is kept with the state: a restart resumes.
            store = str(self.state_dir / "jetstream")
            self._embedded = await asyncio.to_thread(EmbeddedNats(store_dir=store).start)
            release("the embedded nats-server", self._stop_embedded)
        url = s.bus_url(self.url)
        if s.status_port is not None:
            self._status_server = status_http.start(
                s.status_host, s.status_port, self.health,
                registry=metrics.make_registry(lambda: metrics.snapshot(self)))
            release("the status server", self._close_status_server)
        nc = await connect(url, "zeus-coordinator", timeout_s=s.connect_timeout_s,
                           on_disconnect=self.bus.on_disconnect,
                           on_reconnect=self.bus.on_reconnect, on_closed=self.bus.on_closed,
                           inbox_prefix=subjects.inbox_prefix("coord", "", s.prefix),
                           **s.nats_options())
        self.link.attach(nc)
        release("the NATS connection", self.link.drain)
        self.bus.connected(nc)
        history = History(s.history, f"coordinator:{s.replica_name}") if s.history else None
        state = JetStreamState(nc, s.prefix, s.state_replicas,
                               timeout_s=max(2.0, s.command_timeout_s), bucket=s.state_bucket,
                               history=history)
        self.link.use_state(state)
        release("the state buckets", state.close)
        # The jobs this replica comes to drive: their progress recorded, their leases given up.
        release("the jobs' leases", lambda: self.replicas.give_up_jobs())
        await state.open()
        await self.durable.import_jobs_json()
        await state.follow(self.durable.on_entry, self.durable.on_owner_entry)
        await state.watch(f"{BUDGET_PREFIX}>", self.budget_view.on_entry)
        await state.watch(f"{LIFTED_PREFIX}>", self.budget_view.on_lifted)
        await state.watch(f"{FRONTIER_PREFIX}>", self.budget_view.remote.on_frontier)
        await state.watch(f"{POINT_PREFIX}>", self.budget_view.remote.on_point)
        await state.watch(f"{TIMING_PREFIX}>", self.budget_view.remote.on_timing)
        release("the endpoints and subscriptions", self._stop_intake)
        await self._serve()
        # Subscriptions are live before anyone hears we started.
        await confirm_subscriptions(self.nc)
        _tune_gc()
        LOG.info("coordinator ready on %s: replica %s, state in JetStream bucket %s, %d job(s)",
                 redact_url(url), s.replica_name, state.bucket, len(self.jobs))
        if s.scheduler_note:  # A Zeus configuration naming only a plan runs PointSolution.
            LOG.info("pipeline jobs: %s", s.scheduler_note)

    async def _serve(self) -> None:
        """Serve the endpoints, this replica's own subjects, and follow the streams."""
        from nats import micro

        s = self.settings
        self._service = await micro.add_service(
            self.nc, name="zeus-coordinator", version=__version__,
            description="Jobs, ranks and power-limit optimisation", queue_group="coord",
        )
        for subject, callback in self.streams.subscriptions():
            self._subs.append(await self.nc.subscribe(subject, cb=callback))
        self._subs.append(await self.nc.subscribe(subjects.all_replica_alive(s.prefix),
                                                  cb=self.leases.on_alive))
        for name, handler in self.endpoints.forwardable():
            # This replica's own subjects, where the others forward requests about its jobs.
            self._subs.append(await self.nc.subscribe(
                subjects.coord_replica(s.replica_name, name, s.prefix),
                cb=self.endpoints.wrap_own(handler)))
        for name, subject, handler in self.endpoints.table():
            await self._service.add_endpoint(
                name=name, subject=subject, handler=self.endpoints.wrap(handler))
        for subject, callback in self.budgets.subscriptions():
            self._subs.append(await self.nc.subscribe(subject, cb=callback))
        await self._service.add_endpoint(name="budget", subject=subjects.coord_budget(s.prefix),
                                         handler=self.endpoints.wrap(self.budgets.handle))

    async def _reconnected(self) -> None:
        """After a reconnection: listen afresh to the other replicas, ask the agents again."""
        self.leases.rewarm()
        with contextlib.suppress(Exception):
            await self.leases.announce()
        await self._ping_agents()

    async def _ping_agents(self) -> None:
        """Ask the agents to announce themselves (their announcements reconcile the GPUs).

        After a reconnection: an agent may have restarted meanwhile.
        """
        with contextlib.suppress(Exception):
            await self.nc.publish(subjects.agent_ping(self.settings.prefix), b"")

    def health(self) -> tuple[bool, dict[str, Any]]:
        """(healthy, detail) for `/healthz` (called on the status server's thread)."""
        detail = {"nats": self.bus.report(),
                  "replica": self.settings.replica_name, "jobs": len(self.jobs),
                  "owned": len(self.book.mine(time.time())), "dropped": dict(self.dropped),
                  "replicas_live": self.leases.live(), "roster_warm": self.leases.warm(),
                  "quarantined": len(self.failures.quarantined),
                  "fenced_commands": self.fenced_commands,
                  # (Falls back when jobs are removed; the RSS does not: the C allocator keeps
                  # the freed pages for reuse.)
                  "python_blocks": sys.getallocatedblocks()}
        problem = self.bus.problem()
        if problem is not None:
            return False, {"status": problem[0], "reason": problem[1], **detail}
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
        await self.owned.close()

    async def shutdown(self) -> None:
        """Release what start-up acquired, in the reverse order (see the module docstring).

        Idempotent: a second call releases nothing more.
        """
        await self._releases.aclose()
        LOG.info("coordinator stopped")

    async def _close_status_server(self) -> None:
        if self._status_server is not None:
            server, self._status_server = self._status_server, None
            await asyncio.to_thread(server.close)

    async def _stop_embedded(self) -> None:
        if self._embedded is not None:
            embedded, self._embedded = self._embedded, None
            await asyncio.to_thread(embedded.stop)


async def _guarded(coro: Coroutine[Any, Any, Any]) -> Any:
    try:
        return await coro
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - the last guard of the service's task group
        LOG.exception("a background task of the coordinator failed; the coordinator keeps "
                      "serving")
        return None


def _tune_gc() -> None:
    """Fewer young-generation collections: a registration burst allocates millions of objects."""
    global _gc_tuned
    if not _gc_tuned:
        _gc_tuned = True
        gc.freeze()
        gc.set_threshold(GC_THRESHOLD, GC_THRESHOLD_1, GC_THRESHOLD_2)

