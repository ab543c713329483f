"""`CoordinatorSettings`: every knob of `zeus-coordinator run`, defined once.

Environment variables use Zeus's `ZEUS_PFO_` prefix (`ZEUS_PFO_LOG_LEVEL`, `ZEUS_PFO_SCHEDULER`,
`ZEUS_PFO_MAX_JOB_IDLE_TIME`, ...), so a Zeus pipeline-frequency-optimizer deployment keeps its
settings; flags (`--log-level`, ...) override them. Construction does no I/O.

The NATS connection's fields (URL, credentials, TLS files, connect timeout, embedded server,
prefix) come from `zeus_agent.bus.NatsSettings`, shared with the agent's settings.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import TYPE_CHECKING, Any

from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from zeus_agent.bus import NatsSettings

if TYPE_CHECKING:
    from coordinator.pipeline.schedulers.settings import PFOServerSettings

MIN_OWNERSHIP_LEASE_S = 0.9
"""The shortest ownership lease (s): its fence (a third) stays above the agents' default
clock-skew allowance (0.1 s) plus a command's transit on a loaded host."""


class CoordinatorSettings(NatsSettings):
    """Configuration of the coordinator (Zeus's `PFOServerSettings` fields plus the bus).

    Every flag is also an environment variable with Zeus's prefix: ZEUS_PFO_ and the flag's name
    in capitals with underscores (--log-level: ZEUS_PFO_LOG_LEVEL). Flags win.
    """

    model_config = SettingsConfigDict(
        env_prefix="ZEUS_PFO_", cli_kebab_case=True, cli_implicit_flags=True, extra="ignore"
    )

    # Zeus PFOServerSettings fields (same names, same defaults where they apply).
    scheduler: str = Field(
        default="InstructionProfiler",
        description="Frequency scheduler for pipeline jobs (Zeus names accepted). Unset: "
        "PointSolution when scheduler_args hold a solution_path (Zeus 0.16's default), else "
        "InstructionProfiler, which profiles the instructions online (PointSolution needs a plan)",
    )
    scheduler_args: dict[str, Any] = Field(
        default_factory=dict, description="Extra arguments of the scheduler (JSON)"
    )
    log_level: str = Field(
        default="INFO",
        description="Log level: a name Python's logging knows (DEBUG, INFO, WARN(ING), ERROR, "
        "CRITICAL, FATAL, NOTSET), any case",
    )
    dump_data: bool = Field(default=True, description="Dump scheduler state for inspection")
    dump_dir: str = Field(default="./dump", description="Directory for dumped state")
    max_job_idle_time: int = Field(
        default=60 * 60 * 24 * 7,
        gt=0,
        description="Seconds a job may be idle before it is deleted",
    )
    profiling_iterations: int = Field(
        default=5,
        ge=1,
        le=1000,
        description="Pipeline jobs: iterations per rank that make one profiling result",
    )
    switch_lead_steps: int = Field(
        default=2,
        ge=1,
        le=1000,
        description="Pipeline jobs: a new schedule starts this many steps after the latest seen",
    )
    stall_after_s: float = Field(
        default=30.0,
        gt=0,
        le=86_400,
        description="Pipeline jobs: a rank silent this long while profiling gets a status",
    )
    straggler_threshold: float = Field(
        default=0.05,
        gt=0,
        le=10,
        description="Pipeline jobs: a data-parallel pipeline this fraction slower than the "
        "others (its own iteration time, against its plan) may be a straggler",
    )
    straggler_window: int = Field(
        default=5,
        ge=1,
        le=10_000,
        description="Pipeline jobs: consecutive iterations a pipeline must be that slower to "
        "be a straggler (or within the threshold to have recovered)",
    )
    max_pipeline_mb_per_job: int = Field(
        default=1024,
        ge=1,
        description="Pipeline jobs: most MB of its ranks' measurements one job may keep in the "
        "coordinator (an estimate); beyond, the job stops with code too_large",
    )
    max_pipeline_mb_per_node: int = Field(
        default=256,
        ge=1,
        description="Pipeline jobs: most MB of measurements the jobs' ranks on one node may "
        "keep in the coordinator together; beyond, the job adding to it stops (too_large)",
    )
    # The service (the bus: `NatsSettings`).
    state_dir: str = Field(
        default="./zeus-coordinator-state",
        description="Files the coordinator keeps for people (measured profiles; with "
        "--embedded-nats also its JetStream store); jobs live in JetStream",
    )
    state_replicas: int = Field(
        default=1,
        ge=1,
        le=5,
        description="JetStream replicas of the state buckets (3 on a 3-server NATS cluster)",
    )
    state_bucket: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_-]{1,64}$",
        description="JetStream KV bucket of the jobs (default zeus-state-<prefix>; leases in "
        "<bucket>-owners); the NATS permissions of nats-auth cover the default only",
    )
    replica_name: str = Field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
        min_length=1,
        max_length=128,
        description="Name of this coordinator replica (host-pid by default); unique per replica",
    )
    ownership_lease_s: float = Field(
        default=10.0,
        ge=MIN_OWNERSHIP_LEASE_S,
        le=600,
        description="A replica's lease on the jobs it drives; another replica takes a job over "
        "this long after its owner stopped renewing (capped at lease_s / 2, but never under "
        "0.9 s: a replica stops acting a third of it before the end, and "
        "that must exceed the agents' clock-skew allowance (zeus-agent --fence-skew-s, 0.1 s) "
        "plus a command's transit, or agents refuse its commands as stale_lease)",
    )
    handover_after_s: float = Field(
        default=30.0,
        ge=0,
        le=86_400,
        description="The replicas share the jobs out by rendezvous hashing over those live: a "
        "replica that joins (or comes back) is handed the running jobs it is preferred for once "
        "it has been live this long without a gap (at least ownership_lease_s; 0: never, so "
        "running jobs move only when their owner stops, and only new jobs spread)",
    )
    budget_margin_pct: float = Field(
        default=0.0,
        ge=0,
        le=10,
        description="Percent of a power budget's room kept unused under its cap: the "
        "allocation and the measured draw's target sit this far under it, for draws noisier "
        "over half a second than from one budget round to the next",
    )
    lease_s: float = Field(
        default=30.0,
        ge=0.3,
        le=3600,
        description="Lease of GPU settings; renewed every lease_s/3 while jobs live",
    )
    history: str | None = Field(
        default=None,
        description="Append every write JetStream acknowledged (registrations, progress) and "
        "every ownership lease taken to this file, one JSON object a line: what the chaos "
        "checker reads (zeus_demo.chaos)",
    )
    status_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="Serve /healthz and /metrics on this port (0: any free port); none when unset",
    )
    status_host: str = Field(
        default="127.0.0.1", description="Address of the /healthz and /metrics server"
    )
    mark_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="A profiling window whose GPU marks have not all arrived this long after it "
        "closed is profiled again; the last resort: a window whose marks later ones show lost "
        "(an agent restarted, the bus was down) is profiled again at the next step",
    )
    max_jobs: int = Field(
        default=10_000, ge=1, description="Most jobs registered at once (quota error beyond)"
    )
    max_jobs_per_node: int = Field(
        default=256,
        ge=1,
        description="Most jobs registered at once through one node's agent (quota error beyond)",
    )
    max_ranks_per_node: int = Field(
        default=2048,
        ge=1,
        description="Most ranks registered at once on one node's GPUs, over all jobs (quota "
        "error beyond): what one node's agent can make every replica keep is bounded",
    )
    lease_idle_s: float = Field(
        default=900.0,
        gt=0,
        description="Stop renewing a job's leases after this long without events",
    )
    command_timeout_s: float = Field(
        default=2.0, gt=0, description="Timeout of a command to an agent (s)"
    )
    shutdown_timeout_s: float = Field(
        default=5.0, gt=0, description="On exit, how long in-flight requests may take (s)"
    )

    _scheduler_note: str | None = PrivateAttr(default=None)

    @field_validator("log_level")
    @classmethod
    def _upper(cls, value: str) -> str:
        """Upper-cased, as Zeus does; any name Python's logging takes (WARN, FATAL, NOTSET too)."""
        level = value.strip().upper()
        names = logging.getLevelNamesMapping()
        if level not in names:
            raise ValueError(
                f"log_level must be one of {', '.join(names)} (any case), got {value[:40]!r}")
        return level

    @model_validator(mode="after")
    def _check_scheduler(self) -> CoordinatorSettings:
        """The scheduler and its arguments must be usable (checked at start, not per job).

        A Zeus configuration that names only a plan (`solution_path`, no scheduler) runs
        Zeus's default `PointSolution`, as Zeus does; `scheduler_note` says so for the log.
        """
        if "scheduler" not in self.model_fields_set and "solution_path" in self.scheduler_args:
            self.scheduler = "PointSolution"
            self._scheduler_note = (
                "no scheduler named and scheduler_args hold a solution_path: running "
                "PointSolution (Zeus 0.16's default) on that plan")
        self.pfo_settings()
        return self

    @property
    def scheduler_note(self) -> str | None:
        """Why the scheduler is not the one named or the default (None: it is)."""
        return self._scheduler_note

    @property
    def effective_ownership_lease_s(self) -> float:
        """The ownership lease in force, `ownership_lease_s` within bounds.

        Capped at `lease_s / 2` (a new owner renews the GPUs' leases before they lapse), never
        under `MIN_OWNERSHIP_LEASE_S` (GPU leases that short lapse during a takeover).
        """
        return max(MIN_OWNERSHIP_LEASE_S, min(self.ownership_lease_s, self.lease_s / 2))

    def pfo_settings(self) -> PFOServerSettings:
        """The pipeline frequency optimizer's settings (Zeus 0.16's `PFOServerSettings`).

        Raises:
            ValueError: An unknown scheduler, or arguments its constructor does not take.
        """
        from coordinator.pipeline.schedulers.settings import PFOServerSettings

        try:
            return PFOServerSettings(
                scheduler=self.scheduler,
                scheduler_args=self.scheduler_args,
                log_level=self.log_level,
                dump_data=self.dump_data,
                dump_dir=self.dump_dir,
                max_job_idle_time=self.max_job_idle_time,
                profiling_iterations=self.profiling_iterations,
            )
        except ValidationError as e:
            raise ValueError("; ".join(str(err["msg"]) for err in e.errors())) from None
