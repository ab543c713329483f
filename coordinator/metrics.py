"""Prometheus metrics of a coordinator replica, served on its status port beside `/healthz`.

A custom collector builds a `CoordinatorSnapshot` from what the service already keeps (its job
registry, its optimisers, the counters of `/healthz`) at scrape time, on the status server's
thread: the event loop does no metrics work. `snapshot` reads; `families` turns a snapshot into
metric families (pure, unit-tested); `make_registry` wires the two for `status_http.start`.

Each replica exports the jobs it drives (those with an optimiser here) and the jobs still
registering (every replica knows those); a dashboard takes `max by (job_id)` over replicas.

| metric | type | meaning |
|---|---|---|
| `zeus_coordinator_info{replica,version}` | gauge | 1 |
| `zeus_coordinator_nats_connected` | gauge | 1 while connected to NATS, else 0 |
| `zeus_coordinator_jobs` | gauge | jobs known to this replica |
| `zeus_coordinator_jobs_owned` | gauge | jobs this replica drives: its ownership lease is live |
| `zeus_coordinator_messages_dropped_total{reason}` | counter | stream messages dropped |
| `zeus_coordinator_commands_fenced_total` | counter | GPU commands not sent (fenced) |
| `zeus_coordinator_jobs_quarantined` | gauge | jobs set aside: a record unreadable, or failed |
| `zeus_coordinator_jobs_failed_total` | counter | jobs this replica ended on a failure |
| `zeus_job_phase{job_id,kind,phase}` | gauge | 1 for the job's current phase |
| `zeus_job_power_limit_watts{job_id}` | gauge | the limit the job's GPUs are set to now |
| `zeus_job_optimal_power_limit_watts{job_id}` | gauge | the chosen limit, once known |
| `zeus_job_power_limits_measured{job_id}` | gauge | limits profiled so far |
| `zeus_job_power_limit_candidates{job_id}` | gauge | limits in the search range |
| `zeus_job_schedule_version{job_id}` | gauge | number of the schedules installed last |
| `zeus_job_plan_index{job_id}` | gauge | chosen frontier point (0: the fastest) |
| `zeus_job_plan_frontier_points{job_id}` | gauge | points on the planned frontier |
| `zeus_job_plan_iteration_seconds{job_id}` | gauge | planned iteration time of the chosen point |
| `zeus_job_plan_iteration_energy_joules{job_id}` | gauge | its planned iteration energy |
| `zeus_job_energy_saving_ratio{job_id,kind}` | gauge | 1 - energy(chosen) / energy(reference) |
| `zeus_job_slowdown_ratio{job_id,kind}` | gauge | time(chosen) / time(reference) - 1 |
| `zeus_budget_cap_watts{budget_id}` | gauge | a governing budget's cap |
| `zeus_budget_room_watts{budget_id}` | gauge | the room its allocation had (less backoff) |
| `zeus_budget_measured_watts{budget_id}` | gauge | its GPUs' draw in their last samples |
| `zeus_budget_expected_watts{budget_id}` | gauge | the allocation's expected draw |
| `zeus_budget_job_limit_watts{budget_id,job_id}` | gauge | the cap of the job's GPUs |
| `zeus_budget_job_expected_watts{budget_id,job_id}` | gauge | the job's expected draw |
| `zeus_budget_job_slowdown_ratio{budget_id,job_id}` | gauge | expected slowdown (0: optimum) |

Only the replica applying the budgets (the holder of the `budgets` lease) exports `zeus_budget_*`.

`kind` is `power_limit` or `pipeline`. The saving and slowdown of a power-limit job compare the
profiling windows (same number of steps) of the chosen limit and of the highest limit measured
(the maximum, unless the search skipped it); those of a pipeline job compare the planned
iteration of the chosen frontier point with the frontier's fastest point (all clocks high).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from coordinator.jobs import JobRecord
from coordinator.optimizer import JobOptimizer, JobSnapshot
from zeus_agent import __version__
from zeus_agent.wire.budget import BudgetStatus

SNAPSHOT_ATTEMPTS = 3
"""Reads of the service's dicts retried when the event loop changed one mid-read."""


@dataclass(frozen=True)
class CoordinatorSnapshot:
    """One replica's state as its metrics show it."""

    replica: str
    nats_state: str
    jobs: int
    owned: int
    dropped: Mapping[str, int] = field(default_factory=dict)
    fenced_commands: int = 0
    quarantined: int = 0
    failed: int = 0
    job_list: Sequence[JobSnapshot] = ()
    budgets: Sequence[BudgetStatus] = ()
    version: str = __version__


class _Settings(Protocol):
    @property
    def replica_name(self) -> str: ...


class _Jobs(Protocol):
    def records(self) -> list[JobRecord]: ...
    def optimisers(self) -> dict[str, JobOptimizer]: ...


class _Book(Protocol):
    def mine(self, now: float) -> list[str]: ...


class _Failures(Protocol):
    @property
    def quarantined(self) -> Mapping[str, object]: ...
    @property
    def failed(self) -> int: ...


class _Service(Protocol):
    """What `snapshot` reads of a `CoordinatorService`."""

    @property
    def failures(self) -> _Failures: ...

    @property
    def settings(self) -> _Settings: ...
    @property
    def jobs(self) -> _Jobs: ...
    @property
    def dropped(self) -> Mapping[str, int]: ...
    @property
    def fenced_commands(self) -> int: ...
    @property
    def bus_state(self) -> tuple[str, float, str]: ...
    @property
    def book(self) -> _Book: ...
    @property
    def budget_loop(self) -> _BudgetLoop: ...


# ---------------------------------------------------------------------------------- snapshots
class _BudgetLoop(Protocol):
    @property
    def statuses(self) -> Mapping[str, BudgetStatus]: ...


def registering_job(record: JobRecord) -> JobSnapshot:
    """A job whose ranks are not all registered yet."""
    kind = "power_limit" if record.power_limit is not None else "pipeline"
    return JobSnapshot(job_id=record.job_id, kind=kind, phase="registering")


def snapshot(service: _Service) -> CoordinatorSnapshot:
    """Read `service` (from any thread: a dict changed mid-read is read again)."""
    for attempt in range(SNAPSHOT_ATTEMPTS):
        try:
            return _snapshot(service)
        except RuntimeError:  # "dictionary changed size during iteration"
            if attempt == SNAPSHOT_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def _snapshot(service: _Service) -> CoordinatorSnapshot:
    records = {r.job_id: r for r in service.jobs.records()}
    optimisers = service.jobs.optimisers()
    jobs: list[JobSnapshot] = []
    for _, optimiser in sorted(optimisers.items()):
        jobs.append(optimiser.snapshot())  # What each optimiser shows of itself.
    jobs += [
        registering_job(r)
        for j, r in sorted(records.items())
        if j not in optimisers and not r.complete
    ]
    return CoordinatorSnapshot(
        replica=service.settings.replica_name,
        nats_state=service.bus_state[0],
        jobs=len(records),
        owned=len(service.book.mine(time.time())),  # Live leases only (not past the fence).
        dropped=dict(service.dropped),
        fenced_commands=service.fenced_commands,
        quarantined=len(service.failures.quarantined),
        failed=service.failures.failed,
        job_list=jobs,
        budgets=[status for _, status in sorted(dict(service.budget_loop.statuses).items())],
    )


# ---------------------------------------------------------------------------------- families
_JOB_GAUGES: tuple[tuple[str, str, str], ...] = (
    (
        "power_limit_w",
        "zeus_job_power_limit_watts",
        "Power limit the job's GPUs are set to now (W)",
    ),
    (
        "optimal_power_limit_w",
        "zeus_job_optimal_power_limit_watts",
        "Power limit chosen by the job's optimiser (W)",
    ),
    ("measured", "zeus_job_power_limits_measured", "Power limits profiled so far"),
    ("candidates", "zeus_job_power_limit_candidates",
     "Power limits in the search range (an adaptive search profiles fewer)"),
    (
        "schedule_version",
        "zeus_job_schedule_version",
        "Number of the frequency schedules installed last",
    ),
    (
        "plan_index",
        "zeus_job_plan_index",
        "Index of the chosen point on the time-energy frontier (0: the fastest)",
    ),
    ("plan_points", "zeus_job_plan_frontier_points", "Points on the planned frontier"),
    (
        "plan_time_s",
        "zeus_job_plan_iteration_seconds",
        "Planned iteration time of the chosen frontier point (s)",
    ),
    (
        "plan_energy_j",
        "zeus_job_plan_iteration_energy_joules",
        "Planned iteration energy of the chosen frontier point (J)",
    ),
)

_BUDGET_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("zeus_budget_cap_watts", "A governing power budget's cap (W)", "cap_w"),
    ("zeus_budget_room_watts", "The room the budget's allocation had (W)", "room_w"),
    ("zeus_budget_measured_watts", "The budget's GPUs' draw in their last samples (W)",
     "measured_w"),
    ("zeus_budget_expected_watts", "The allocation's expected draw (W)", "expected_w"),
)
_SHARE_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("zeus_budget_job_limit_watts", "The power limit a budget caps the job's GPUs to (W)",
     "limit_w"),
    ("zeus_budget_job_expected_watts", "The job's expected draw under the budget (W)",
     "expected_w"),
    ("zeus_budget_job_slowdown_ratio",
     "The job's expected time per step under the budget / at its optimum - 1", "slowdown"),
)

METRIC_NAMES: tuple[str, ...] = (
    "zeus_coordinator_info",
    "zeus_coordinator_nats_connected",
    "zeus_coordinator_jobs",
    "zeus_coordinator_jobs_owned",
    "zeus_coordinator_messages_dropped_total",
    "zeus_coordinator_commands_fenced_total",
    "zeus_coordinator_jobs_quarantined",
    "zeus_coordinator_jobs_failed_total",
    "zeus_job_phase",
    *(name for _, name, _ in _JOB_GAUGES),
    "zeus_job_energy_saving_ratio",
    "zeus_job_slowdown_ratio",
    *(name for name, _, _ in _BUDGET_GAUGES),
    *(name for name, _, _ in _SHARE_GAUGES),
)
"""Every metric name `families` yields (as exposed: counters with `_total`)."""


def families(snap: CoordinatorSnapshot) -> list[Metric]:
    """The metric families of a snapshot (each present, with or without samples)."""
    info = GaugeMetricFamily(
        "zeus_coordinator_info", "Coordinator replica and version", labels=["replica", "version"]
    )
    info.add_metric([snap.replica, snap.version], 1)
    connected = GaugeMetricFamily(
        "zeus_coordinator_nats_connected",
        "1 while the coordinator is connected to NATS",
        value=1 if snap.nats_state == "connected" else 0,
    )
    jobs = GaugeMetricFamily("zeus_coordinator_jobs", "Jobs known to this replica", value=snap.jobs)
    owned = GaugeMetricFamily(
        "zeus_coordinator_jobs_owned",
        "Jobs this replica drives: its ownership lease is live (not fenced) on its clock",
        value=snap.owned,
    )
    dropped = CounterMetricFamily(
        "zeus_coordinator_messages_dropped",
        "Stream messages the coordinator dropped (spoofed node, unknown rank, malformed...)",
        labels=["reason"],
    )
    for reason, count in sorted(snap.dropped.items()):
        dropped.add_metric([reason], count)
    fenced = CounterMetricFamily(
        "zeus_coordinator_commands_fenced",
        "GPU commands not sent: the job was no longer this replica's",
        value=snap.fenced_commands,
    )
    quarantined = GaugeMetricFamily(
        "zeus_coordinator_jobs_quarantined",
        "Jobs set aside: a record of theirs cannot be loaded, or their optimiser failed "
        "(zeus-coordinator quarantine list)",
        value=snap.quarantined,
    )
    failed = CounterMetricFamily(
        "zeus_coordinator_jobs_failed",
        "Jobs this replica ended because their optimiser failed",
        value=snap.failed,
    )
    phase = GaugeMetricFamily(
        "zeus_job_phase", "1 for the job's current phase", labels=["job_id", "kind", "phase"]
    )
    gauges = [GaugeMetricFamily(name, text, labels=["job_id"]) for _, name, text in _JOB_GAUGES]
    saving = GaugeMetricFamily(
        "zeus_job_energy_saving_ratio",
        "1 - energy of the chosen limit or plan / energy at the highest limit or fastest plan",
        labels=["job_id", "kind"],
    )
    slowdown = GaugeMetricFamily(
        "zeus_job_slowdown_ratio",
        "Time of the chosen limit or plan / time at the highest limit or fastest plan - 1",
        labels=["job_id", "kind"],
    )
    for job in snap.job_list:
        phase.add_metric([job.job_id, job.kind, job.phase], 1)
        for (attr, _, _), family in zip(_JOB_GAUGES, gauges, strict=True):
            value = getattr(job, attr)
            if value is not None:
                family.add_metric([job.job_id], float(value))
        if job.energy_saving is not None and math.isfinite(job.energy_saving):
            saving.add_metric([job.job_id, job.kind], job.energy_saving)
        if job.slowdown is not None and math.isfinite(job.slowdown):
            slowdown.add_metric([job.job_id, job.kind], job.slowdown)
    return [info, connected, jobs, owned, dropped, fenced, quarantined, failed, phase, *gauges,
            saving, slowdown, *budget_families(snap.budgets)]


def budget_families(budgets: Sequence[BudgetStatus]) -> list[Metric]:
    """The governing budgets' gauges and their jobs' shares."""
    out = [GaugeMetricFamily(n, text, labels=["budget_id"]) for n, text, _ in _BUDGET_GAUGES]
    shares = [GaugeMetricFamily(n, text, labels=["budget_id", "job_id"])
              for n, text, _ in _SHARE_GAUGES]
    for b in budgets:
        for (_, _, attr), family in zip(_BUDGET_GAUGES, out, strict=True):
            value = getattr(b, attr)
            if value is not None:
                family.add_metric([b.budget_id], float(value))
        for share in b.shares:
            for (_, _, attr), family in zip(_SHARE_GAUGES, shares, strict=True):
                value = getattr(share, attr)
                if value is not None:
                    family.add_metric([b.budget_id, share.job_id], float(value))
    return [*out, *shares]


class CoordinatorCollector(Collector):
    """Yields `families(read())` at each scrape."""

    def __init__(self, read: Callable[[], CoordinatorSnapshot]) -> None:
        self.read = read

    def collect(self) -> Iterable[Metric]:  # noqa: D102
        yield from families(self.read())


def make_registry(read: Callable[[], CoordinatorSnapshot]) -> CollectorRegistry:
    """A registry holding only the coordinator's metrics (`read` is called at each scrape)."""
    registry = CollectorRegistry()
    registry.register(CoordinatorCollector(read))
    return registry
