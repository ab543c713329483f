"""`Streams`: the bus streams the coordinator follows, fed to the jobs' optimisers.

* trainer events `<p>.job.<job>.ev.*.<node>` (rank 0 paces the power-limit machine), as rows
  (`TrainerEventBatch`) or columns (`TrainerEventColumns`, fed as `EventRow` tuples), and
* the nodes' marks and measurements `<p>.job.<job>.meas.<node>` (window energies, step and
  instruction times), one batch per job per node and flush, a part per GPU, as rows
  (`NodeMeasurementBatch`) or columns (`NodeColumnBatch`, fed as tuples): both of the jobs
  this replica drives only (`job_subscriptions`, `coordinator.service.owned`);
* the agents' error events `<p>.gpu.*.*.error` (a trainer gone, a lease that lapsed);
* agent announcements `<p>.agent.*.hello`, on which GPUs are reconciled: one whose limit or
  schedule is not its job's (its agent restarted) gets it again.

Every message (each GPU's part of a node's batch) is accepted only from the GPU its rank is
bound to (as its node's agent names it) and from a trainer that presented the job's join token;
anything else is dropped and counted (`CoordinatorService.dropped`), the other parts of a batch
still count. Messages about a job another replica drives are not decoded (the job is in their
subject).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel

from coordinator.config import CoordinatorSettings
from coordinator.jobs import JobRecord
from coordinator.optimizer import Action, JobOptimizer
from coordinator.service.actions import ActionExecutor
from coordinator.service.driver import JobDriver
from coordinator.service.failures import JobFailures
from coordinator.service.leases import Leases
from coordinator.service.link import Link
from coordinator.service.table import JobTable
from zeus_agent.errors import PayloadError
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.event_columns import decode_events, event_rows
from zeus_agent.wire.messages import AgentHello, ErrorEvent
from zeus_agent.wire.node_batch import GpuMeasurements
from zeus_agent.wire.node_columns import (
    GpuRows,
    MeasurementLike,
    NodeColumnBatch,
    decode_measurements,
)
from zeus_agent.wire.text import shown

__all__ = ["Streams"]

LOG = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
Part = GpuMeasurements | GpuRows
"""A GPU's part of a node's batch: rows (`NodeMeasurementBatch`) or columns' rows."""

EVENTS_PER_YIELD = 256
"""Trainer events handled between two yields to the event loop (a 1 MB batch holds ~50,000)."""
REAPPLY_LIMIT = 3
"""Most times one rank's lapsed settings are set again within `REAPPLY_WINDOW_LEASES` leases."""
REAPPLY_WINDOW_LEASES = 10


def _fed(_rank: int, item: tuple[Callable[[int, Any], list[Action]], int, Any]) -> list[Action]:
    """One input of `Streams._take_parts`: (the optimiser's step, the rank, what is fed)."""
    step, rank, fed = item
    return step(rank, fed)


class Streams:
    """The stream handlers; what they take in goes to the jobs' optimisers through `actions`."""

    def __init__(self, *, settings: CoordinatorSettings, clock: Callable[[], float],
                 jobs: JobTable, link: Link, leases: Leases, actions: ActionExecutor,
                 failures: JobFailures) -> None:
        self.settings = settings
        self.clock = clock
        self.jobs = jobs
        self.link = link
        self.leases = leases
        self.actions = actions
        self.failures = failures
        self.agent_ids: dict[str, str] = {}
        """Node token -> the id of the agent that last announced itself there."""

    def subscriptions(self) -> list[tuple[str, Any]]:
        """(subject, callback) of every stream followed whichever jobs this replica drives."""
        p = self.settings.prefix
        return [
            (subjects.all_gpu_errors(p), self.on_gpu_error),
            (subjects.all_agent_hellos(p), self.on_agent_hello),
        ]

    def job_subscriptions(self, job_id: str) -> list[tuple[str, Any]]:
        """(subject, callback) of the streams of one job, followed by its owner only."""
        p = self.settings.prefix
        return [(subjects.all_events_of_job(job_id, p), self.on_events),
                (subjects.all_measurements_of_job(job_id, p), self.on_measurements)]

    # ------------------------------------------------------------------ checks
    def _decode(self, msg: Any, model: type[M]) -> M | None:
        """A stream message as `model`, or None (dropped and counted as malformed)."""
        try:
            return codec.decode(msg.data, model)
        except PayloadError as e:
            self.link.drop("malformed", msg.subject, e)
            return None

    def _without_token(self, record: JobRecord | None, job_id: str, rank: int,
                       digest: str | None, subject: str) -> bool:
        """Drop (and count) events or marks whose trainer's HELLO lacked the job's join token.

        The agent sends the digest of what the HELLO presented. Returns True if dropped.
        """
        if record is None or record.admits(digest):
            return False
        self.link.drop("no_join_token", subject,
                       f"rank {rank} of {job_id}: its trainer's HELLO did not present the job's "
                       "join token")
        return True

    def _other_replicas_job(self, driver: JobDriver | None) -> bool:
        """Whether a stream message is about a job this replica knows another one drives."""
        return driver is not None and driver.optimiser is None and not (
            self.leases.owns(driver.job_id))

    def _to_decode(self, job_token: str, subject: str) -> bool:
        """Whether a message on a job's subject is decoded here.

        Not for a job another replica drives, nor (dropped and counted) for one unknown here.
        """
        named = self.jobs.by_token(job_token)
        if self._other_replicas_job(named):
            return False
        if named is None:  # No job known here: nothing to decode it for.
            self.link.drop("unknown_job", subject, job_token)
            return False
        return True

    # ------------------------------------------------------------------ streams
    async def on_events(self, msg: Any) -> None:
        """A batch of a rank's trainer events."""
        where = subjects.parse_job_events(msg.subject)
        if where is None or not self._to_decode(where.job, msg.subject):
            return
        try:
            batch = decode_events(msg.data)
        except PayloadError as e:
            self.link.drop("malformed", msg.subject, e)
            return
        driver = self.jobs.get(batch.job_id)
        record = driver.record if driver is not None else None
        if driver is None or record is None or driver.token != where.job:
            self.link.drop("unknown_job" if record is None else "wrong_job", msg.subject,
                           batch.job_id)
            return
        # The rank's own GPU, not just its node, and a trainer that presented the job's token:
        # an agent binds a GPU to (job, rank) on a trainer's HELLO, so any process of the node
        # that knows the job id could otherwise speak for the rank.
        if (where.node != subjects.token(batch.node)
                or not driver.bound_here(batch.rank, where.node, batch.gpu)):
            self.link.drop("wrong_node", msg.subject,
                           f"rank {batch.rank} of {batch.job_id} is not bound to "
                           f"{shown(where.node)}/gpu{batch.gpu}")
            return
        if self._without_token(record, batch.job_id, batch.rank, batch.join_digest, msg.subject):
            return
        now = self.clock()
        lapsed = driver.quiet(now, self.settings.lease_idle_s)
        self.jobs.registry.touch(batch.job_id, now)
        job = driver.optimiser
        if job is None:
            return
        async with driver.lock:
            if lapsed:
                # Renewals stopped while the job was quiet, so the agents have restored their
                # defaults: the job is back, so are its settings.
                await self.actions.reapply(record, job, "events again after a quiet spell")
            events = event_rows(batch)
            for first in range(0, len(events), EVENTS_PER_YIELD):
                # One input per chunk: a late batch sends only the limit its last event needs,
                # never one for a window already past.
                chunk = events[first:first + EVENTS_PER_YIELD]
                await self.actions.act(batch.job_id, lambda r, c: job.on_events(r, c, now),
                                       batch.rank, chunk)
                if first + EVENTS_PER_YIELD < len(events):
                    await asyncio.sleep(0)  # A huge batch lets the lease loops run meanwhile.

    async def on_measurements(self, msg: Any) -> None:
        """A node's batch of one job's GPU marks and step or instruction measurements.

        Each GPU's part is checked on its own (its rank bound to that GPU of the subject's node,
        the job's join token): a part that fails is dropped and counted, the others count.
        """
        where = subjects.parse_job_measurements(msg.subject)
        if where is None or not self._to_decode(where.job, msg.subject):
            return
        try:
            batch = decode_measurements(msg.data)
        except PayloadError as e:
            self.link.drop("malformed", msg.subject, e)
            return
        driver = self.jobs.get(batch.job_id)
        record = driver.record if driver is not None else None
        if driver is None or record is None or driver.token != where.job:
            self.link.drop("unknown_job" if record is None else "wrong_job", msg.subject,
                           batch.job_id)
            return
        if where.node != subjects.token(batch.node):
            self.link.drop("wrong_node", msg.subject, f"the batch names node {shown(batch.node)}")
            return
        if (job := driver.optimiser) is None:
            return
        gpus = batch.parts() if isinstance(batch, NodeColumnBatch) else batch.gpus
        parts = [part for part in gpus
                 if self._admitted(driver, record, where.node, part, msg.subject)]
        if not parts:
            return
        now = self.clock()
        async with driver.lock:
            if any(job.plans_on(m) for part in parts for m in part.measurements):
                for part in parts:
                    await self._take_part(driver, record, job, part, now)
                return
            await self._take_parts(driver, job, parts, now)

    async def _take_parts(self, driver: JobDriver, job: JobOptimizer,
                          parts: list[Part], now: float) -> None:
        """`_take_part` for each of `parts` none of whose measurements plans: in one go.

        In order (each part's marks, then its measurements), in one containment: what a node's
        batch costs is then the optimiser's work, not two containments per GPU.
        """
        def on_measurement(rank: int, m: MeasurementLike) -> list[Action]:
            return job.on_measurement(rank, m, now)

        inputs: list[tuple[Callable[[int, Any], list[Action]], int, Any]] = []
        for part in parts:
            inputs += [(job.on_mark, part.rank, mark) for mark in part.marks]
            inputs += [(on_measurement, part.rank, m) for m in part.measurements]
        await self.actions.act_all(driver.job_id, _fed, 0, inputs, EVENTS_PER_YIELD)

    def _admitted(self, driver: JobDriver, record: JobRecord, node: str, part: Part,
                  subject: str) -> bool:
        """Whether a GPU's part counts: from the GPU its rank is bound to, with the job's token.

        An empty part is skipped; a part that fails a check is dropped and counted.
        """
        if not part.marks and not part.measurements:
            return False
        if not driver.bound_here(part.rank, node, part.gpu):
            self.link.drop("wrong_node", subject, f"rank {part.rank} of {driver.job_id} is not "
                           f"bound to {node}/gpu{part.gpu}")
            return False
        return not self._without_token(record, driver.job_id, part.rank, part.join_digest,
                                       subject)

    async def _take_part(self, driver: JobDriver, record: JobRecord, job: JobOptimizer,
                         part: Part, now: float) -> None:
        """Feed one GPU's marks, then its measurements, to the job (under the job's lock)."""
        await self.actions.act_all(driver.job_id, job.on_mark, part.rank, part.marks,
                                   EVENTS_PER_YIELD)
        if any(job.plans_on(m) for m in part.measurements):
            # A step may close a profiling window, and the scheduler may then plan a frontier
            # for seconds: off the event loop (leases keep being renewed). The job's lock keeps
            # its inputs in order meanwhile.
            async with self.failures.contained(driver.job_id, "planning the job"):
                actions = await asyncio.to_thread(
                    lambda: [a for m in part.measurements
                             for a in job.on_measurement(part.rank, m, now)])
                await self.actions.execute(record, actions)
            return
        await self.actions.act_all(driver.job_id, lambda r, x: job.on_measurement(r, x, now),
                                   part.rank, part.measurements, EVENTS_PER_YIELD)

    async def on_gpu_error(self, msg: Any) -> None:
        """An agent's error event about the rank bound to one of its GPUs (a trainer gone...)."""
        event = self._decode(msg, ErrorEvent)
        if event is None or event.job_id is None or event.rank is None:
            return
        driver = self.jobs.get(event.job_id)
        if driver is None or (job := driver.optimiser) is None:
            return
        where = subjects.parse_gpu_subject(msg.subject)
        gpu = where.gpu_index if where is not None else None
        if where is None or not driver.bound_here(event.rank, where.node,
                                                  -1 if gpu is None else gpu):
            node, token = (where.node, where.gpu) if where is not None else ("?", "?")
            self.link.drop("wrong_node", msg.subject,
                           f"rank {event.rank} of {event.job_id} is not bound to {node}/gpu{token}")
            return
        now = self.clock()
        async with driver.lock:
            if event.code == "lease_expired":
                restored = event.detail.get("restored")
                await self.reapply_lapsed(driver, job, event.rank,
                                          restored if isinstance(restored, list) else [])
            await self.actions.act(event.job_id,
                                   lambda r, e: job.on_agent_error(r, e.code, e.message, now),
                                   event.rank, event)

    # ------------------------------------------------------------------ lapsed settings
    def _recent_reapplies(self, driver: JobDriver, rank: int) -> list[float]:
        """When the rank's lapsed settings were set again within the last window."""
        window = REAPPLY_WINDOW_LEASES * self.settings.lease_s
        return driver.recent_reapplies(rank, self.clock(), window)

    async def reapply_locked(self, driver: JobDriver, job: JobOptimizer, rank: int,
                             restored: list[str]) -> None:
        """`reapply_lapsed` under the job's lock (a task of the ownership loop)."""
        try:
            async with driver.lock:
                if driver.optimiser is job:  # (Not one released meanwhile.)
                    await self.reapply_lapsed(driver, job, rank, restored)
        except Exception:  # A task of the service: one job's failure must not stop it.
            LOG.exception("job %s: setting rank %d's lapsed settings again failed",
                          driver.job_id, rank)

    async def reapply_lapsed(
        self, driver: JobDriver, job: JobOptimizer, rank: int, restored: list[Any]
    ) -> None:
        """An agent restored settings of an active job whose lease lapsed: set them again.

        The renewals were late (a stalled replica, a slow bus) while the trainer kept going;
        without this the GPU would stay at its default until the job next went quiet. A quiet
        job's leases lapse on purpose and stay lapsed.
        """
        job_id, record = driver.job_id, driver.record
        if (record is None or rank not in record.ranks
                or driver.quiet(self.clock(), self.settings.lease_idle_s)):
            return
        if not await self.leases.owns_now(job_id):
            lease = self.leases.book.leases.get(driver.hash)
            if lease is not None and lease.owner == self.leases.book.me:
                # This replica's own lease lapsed too (the same stall that made the renewals
                # late): the agent says so only once, so keep it for when the lease is back.
                driver.keep_lapsed(rank, (r for r in restored if r in ("power_limit", "schedule")))
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
        recent = self._recent_reapplies(driver, rank)
        if len(recent) >= REAPPLY_LIMIT:
            if len(recent) == REAPPLY_LIMIT:
                renewals = subjects.all_lease_renewals(self.settings.prefix)
                await self.link.status(job_id, "error",
                                       f"the leases on {where} lapsed {REAPPLY_LIMIT} times in "
                                       f"{window:g} s while the job was active: renewals do not "
                                       f"reach its agent (check that it may subscribe to "
                                       f"{renewals}); its settings stay at the defaults until "
                                       "its agent restarts or the job comes back from a quiet "
                                       "spell")
                recent.append(now)  # Said once per window.
            driver.throttled(rank, recent)
            return
        driver.reapplied(rank, recent, now)
        desired = job.desired_power_limit
        if "power_limit" in restored and desired is not None:
            await self.link.status(job_id, "reconciled",
                                   f"the lease on {where} lapsed while the job was active (late "
                                   f"renewals): setting {desired} W again")
            await self.actions.apply_power_limit(record, desired, [binding])
        wanted = job.desired_schedule(rank)
        if "schedule" in restored and wanted is not None:
            await self.link.status(job_id, "reconciled",
                                   f"the lease on {where} lapsed while the job was active (late "
                                   f"renewals): installing schedule {wanted.version} again")
            await self.actions.install_again(record, [wanted])

    # ------------------------------------------------------------------ reconciliation
    async def on_agent_hello(self, msg: Any) -> None:
        """Reconcile: a GPU still driven by an optimised job's rank gets the job's limit back.

        Only a GPU whose agent says the job's trainer is bound to it (it said HELLO, again after
        an agent restart): a GPU whose trainer left stays at its default.
        """
        hello = self._decode(msg, AgentHello)
        if hello is None:
            return
        node = subjects.token(hello.node)
        if node != subjects.parse_agent_hello(msg.subject):
            self.link.drop("wrong_node", msg.subject, f"hello names node {shown(hello.node)}")
            return
        previous = self.agent_ids.get(node)
        self.agent_ids[node] = hello.agent_id
        if previous is not None and previous != hello.agent_id:
            LOG.info("the agent of node %s restarted (%s -> %s)", hello.node, previous,
                     hello.agent_id)
            # Its ranks' lapse throttle ends (as the error status says), whatever this first
            # announcement shows: a restarted agent has no trainers bound yet.
            for throttled in self.jobs.drivers():
                throttled.forget_lapses_on(node)
        for gpu in hello.gpus:
            driver = self.jobs.on_gpu(node, subjects.token(gpu.index))
            if driver is None or gpu.job_id != driver.job_id:
                continue
            record, job = driver.record, driver.optimiser
            rank = record.gpu_ranks.get((hello.node, gpu.index)) if record is not None else None
            if record is None or rank is None or rank not in record.ranks:
                continue
            if job is None or not self.leases.owns(driver.job_id):
                continue  # (Fenced: a replica whose lease lapsed may be being taken over.)
            await self._reconcile(hello, gpu, record, driver, job, rank)

    async def _reconcile(self, hello: AgentHello, gpu: Any, record: JobRecord,
                         driver: JobDriver, job: JobOptimizer, rank: int) -> None:
        """Set again what one announced GPU of a driven job lacks (its agent restarted?)."""
        node = subjects.token(hello.node)
        if not gpu.controllable:
            # Its agent lost the privilege (or restarted observe-only): said once.
            if driver.first_observe_only(node, gpu.index):
                await self.link.status(record.job_id, "error",
                                       f"{hello.node}/gpu{gpu.index} (rank {rank}) is observe-only "
                                       "now: its agent cannot change its settings, so the job's "
                                       "settings are not applied there; restart that agent "
                                       "without --observe-only, as root or with CAP_SYS_ADMIN")
            return
        if driver.quiet(self.clock(), self.settings.lease_idle_s):
            return  # A quiet job: its leases lapsed on purpose.
        if len(self._recent_reapplies(driver, rank)) >= REAPPLY_LIMIT:
            return  # Renewals do not reach this agent (said): no flapping per heartbeat.
        binding = record.ranks[rank].gpu
        desired = job.desired_power_limit
        if desired is not None and gpu.power_limit_w != desired:
            await self.link.status(record.job_id, "reconciled",
                                   f"{binding.node}/gpu{gpu.index} is at {gpu.power_limit_w} W, "
                                   f"not {desired} W (its agent restarted?): setting {desired} W "
                                   "again")
            await self.actions.apply_power_limit(record, desired, [binding])
        # A heartbeat may predate a recent install: only a schedule installed a while ago
        # and missing now was lost (the agent restarted).
        installed_at = driver.installed_at.get(rank, 0.0)
        settled = self.clock() - installed_at > max(2.0, self.settings.command_timeout_s)
        wanted = job.desired_schedule(rank) if settled else None
        if wanted is not None and gpu.schedule_version != wanted.version:
            await self.link.status(record.job_id, "reconciled",
                                   f"{binding.node}/gpu{gpu.index} has schedule "
                                   f"{gpu.schedule_version}, not {wanted.version} (its agent "
                                   "restarted?): installing it again")
            await self.actions.install_again(record, [wanted])
