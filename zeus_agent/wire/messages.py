"""Payload models of the wire contract (pydantic v2, schema version `v`, unknown fields refused).

Announcements and telemetry (agent -> bus):
    `GpuDescription`, `AgentHello`, `Sample`, `SampleBatch`, `Mark`, `Measurement`,
    `ErrorEvent`; `MeasurementBatch`: one GPU's part of a `node_batch.NodeMeasurementBatch`.
Commands to one GPU (request/reply on `gpu_command`), a union discriminated by `op`:
    `InfoCmd`, `SetPowerLimitCmd`, `ResetPowerLimitCmd`, `LockClocksCmd`, `ResetClocksCmd`,
    `InstallScheduleCmd`, `ClearScheduleCmd`, `BindRankCmd`, `UnbindRankCmd`, `EnergyCmd`,
    `RenewLeasesCmd`, `SelectCmd`, `NodeCapCmd` (`node_cap.py`); parse with `GPU_COMMAND`.
    Every reply is a `Reply`.
Coordinator requests (request/reply): `RegisterJob`, `RegisterRank`, `JobQuery`,
    `StragglerNotice`;
    `PowerLimitOptions` configures a job's power-limit optimizer.
Job streams: `TrainerEvent`, `TrainerEventBatch`, `JobStatus`, `LeaseRenewal`.

Every top-level message derives from `Message` (fields `v`, extra fields forbidden).
Units are in the field names: `_w`, `_j`, `_s`, `_ns` (monotonic, host-local), `_mhz`.

Every string a client supplies is bounded (`Id`, `Name`, `Text`; `MAX_*_CHARS`), floats are
finite, and leases lie in (0, `MAX_LEASE_S`], so a payload can neither make a subject too long
for the server nor park a GPU setting forever.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    field_validator,
    model_serializer,
    model_validator,
)

from zeus_agent.gpu.base import GPUInfo
from zeus_agent.models import (
    MAX_CLOCKS,
    MAX_ID_CHARS,
    MAX_NAME_CHARS,
    MAX_POWER_W,
    MAX_RANK,
    NO_CONTROL_CHARS,
    ClockMhz,
    FrequencySchedule,
    JobInfo,
    PowerLimitMeasurement,
    PowerW,
    RankInfo,
)
from zeus_agent.wire.node_cap import NodeCapCmd
from zeus_agent.wire.text import MAX_TEXT_CHARS, bounded

MAX_LEASE_S = 3600.0
"""Longest lease an agent grants (s): a setting nobody renews comes back within this time."""
MAX_STEPS = 100_000
"""Most steps in a power-limit phase (wait, warm-up, profile)."""
MAX_PROFILE_ROWS = 256
"""Most power limits in a profile sent with a job."""
MAX_COUNTER = 2**53
"""Largest epoch, step or instruction counter in a measurement (beyond: not a real count)."""
MAX_STRAGGLER_FACTOR = 100.0
"""Largest slowdown a straggler notice may give."""
MAX_NS = 2**63 - 1
"""Largest monotonic timestamp (ns): what fits NVML's and the kernel's signed 64 bits."""
MAX_GPUS_PER_NODE = 1024
"""Most GPUs one agent may announce (a node holds 8 to 72)."""
MAX_HEARTBEAT_S = 3600.0
"""Longest heartbeat an agent may announce (s)."""
MAX_ENERGY_PERIOD_MS = 60_000.0
"""Longest energy-counter update period an agent may announce (ms)."""
MAX_SCHEDULE_VERSION = 2**31 - 1
"""Largest schedule number in a job."""

Id = Annotated[str, StringConstraints(max_length=MAX_ID_CHARS, pattern=NO_CONTROL_CHARS)]
"""A job id, lease holder or agent id."""
Name = Annotated[str, StringConstraints(max_length=MAX_NAME_CHARS, pattern=NO_CONTROL_CHARS)]
"""A node name, GPU uuid or name, scheduler or instruction name."""
Text = Annotated[str, StringConstraints(max_length=MAX_TEXT_CHARS)]
"""Free text for people."""
Rank = Annotated[int, Field(ge=0, le=MAX_RANK)]
GpuIndex = Annotated[int, Field(ge=0, le=MAX_RANK)]
Nanos = Annotated[int, Field(ge=0, le=MAX_NS)]
"""A host-local monotonic timestamp (ns)."""
Counter = Annotated[int, Field(ge=0, le=MAX_COUNTER)]
"""An epoch, step or instruction counter."""
ScheduleVersion = Annotated[int, Field(ge=0, le=MAX_SCHEDULE_VERSION)]
Clocks = Annotated[list[ClockMhz], Field(max_length=MAX_CLOCKS)]
"""A GPU's supported clocks (MHz)."""
JoinToken = Annotated[
    str, StringConstraints(min_length=16, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
]
"""A job's join token: URL-safe base64, as `secrets.token_urlsafe` makes it."""


JoinDigest = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
"""A join token's digest (`join_token_digest`)."""


def join_token_digest(token: str) -> str:
    """What is kept of a join token to check it later (SHA-256, hex), never the token itself."""
    return hashlib.sha256(token.encode()).hexdigest()
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


class Message(BaseModel):
    """Base of every top-level payload: a schema version and no unknown fields."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    v: Literal[1] = 1


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class AddedFields(BaseModel):
    """Base of payloads that gained fields after their schema shipped (`ADDED`).

    Such a field is sent only when it differs from its default, so a peer that predates it
    keeps decoding every payload that does not need it (its `extra="forbid"` would refuse the
    field), and a peer that knows it reads the default when it is absent.
    """

    ADDED: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_added_defaults(self, handler: Any) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        fields = type(self).model_fields
        for name in self.ADDED:
            if name in data and data[name] == fields[name].default:
                del data[name]
        return data


# ---------------------------------------------------------------------------- announcements
class GpuDescription(_Part, AddedFields):
    """What an agent announces about one GPU (see `zeus_agent.gpu.base.GPUInfo`)."""

    ADDED: ClassVar[tuple[str, ...]] = ("controllable", "energy_period_ms")

    index: int = Field(ge=0, le=MAX_RANK)
    uuid: Name
    name: Name
    architecture: Name
    min_power_limit_w: PowerW
    max_power_limit_w: PowerW
    default_power_limit_w: PowerW
    supported_memory_clocks_mhz: Clocks
    supported_graphics_clocks_mhz: Clocks
    has_energy_counter: bool
    power_limit_w: PowerW
    job_id: Id | None = None
    """The job whose rank is bound to the GPU (a trainer said HELLO), or None."""
    schedule_version: ScheduleVersion | None = None
    """Version of the frequency schedule installed or waiting for its step (None: none)."""
    controllable: bool = True
    """Whether the agent may change this GPU's settings: False when it runs `--observe-only` or
    lacks the privilege (NVML: NO_PERMISSION). Added after schema 1 shipped: sent only when
    False, so coordinators that predate it keep accepting controllable GPUs' announcements
    (one that predates it refuses an observe-only GPU's announcement: it could not drive it)."""
    energy_period_ms: float | None = Field(default=None, ge=0, le=MAX_ENERGY_PERIOD_MS)
    """How often the GPU's energy counter changes, as the agent's reads learned it (ms): NVML's
    ~100 ms; 0 when it changed at every read (continuous, or power integrated); None when not
    known (the agent's first ~2 s of learning). Marks interpolate between its updates, so a
    power-limit window must span several periods (`coordinator.power_limit.window_length`).
    Added after schema 1 shipped: sent only when known; a coordinator that predates it refuses
    the description."""

    @model_validator(mode="after")
    def _limits_ordered(self) -> GpuDescription:
        # Every power limit the coordinator may command lies in [min, max]: a range upside
        # down, or a default outside it, is no GPU's.
        if self.min_power_limit_w > self.max_power_limit_w:
            raise ValueError(f"min_power_limit_w ({self.min_power_limit_w}) exceeds "
                             f"max_power_limit_w ({self.max_power_limit_w})")
        if not self.min_power_limit_w <= self.default_power_limit_w <= self.max_power_limit_w:
            raise ValueError(f"default_power_limit_w ({self.default_power_limit_w}) is outside "
                             f"[{self.min_power_limit_w}, {self.max_power_limit_w}]")
        return self

    @classmethod
    def from_info(
        cls, info: GPUInfo, power_limit_w: int, job_id: str | None = None,
        energy_period_ms: float | None = None,
    ) -> GpuDescription:
        """Build from a backend's `GPUInfo`, the limit, the bound job, the counter's period."""
        return cls(
            index=info.index,
            uuid=info.uuid,
            name=info.name,
            architecture=info.architecture,
            min_power_limit_w=info.min_power_limit_w,
            max_power_limit_w=info.max_power_limit_w,
            default_power_limit_w=info.default_power_limit_w,
            supported_memory_clocks_mhz=list(info.supported_memory_clocks_mhz),
            supported_graphics_clocks_mhz=list(info.supported_graphics_clocks_mhz),
            has_energy_counter=info.has_energy_counter,
            power_limit_w=power_limit_w,
            job_id=job_id,
            energy_period_ms=energy_period_ms,
        )


class AgentHello(Message, AddedFields):
    """An agent's announcement of its node and GPUs; repeated as the heartbeat."""

    ADDED: ClassVar[tuple[str, ...]] = ("labels",)

    node: Name
    agent_id: Id
    backend: Name
    heartbeat_s: float = Field(gt=0, le=MAX_HEARTBEAT_S)
    socket_path: Text
    gpus: list[GpuDescription] = Field(max_length=MAX_GPUS_PER_NODE)
    labels: dict[Name, Name] = Field(default={}, max_length=64)
    """The node's labels (`zeus-agent run --labels rack=a7`): what budgets select nodes by."""


class Sample(_Part):
    """One reading of a GPU. `energy_j` is the cumulative counter (or integrated power)."""

    t_ns: Nanos
    energy_j: float = Field(ge=0)
    power_w: float = Field(ge=0, le=MAX_POWER_W)
    power_limit_w: PowerW
    sm_clock_mhz: ClockMhz
    memory_clock_mhz: ClockMhz


class SampleBatch(Message):
    """Samples of one GPU, oldest first."""

    node: Name
    gpu: GpuIndex
    uuid: Name
    samples: list[Sample] = Field(fail_fast=True)


class Mark(_Part):
    """The time and energy counter of a GPU at a trainer event (for windows over steps).

    Counters, not timestamps, identify the event across hosts: `t_ns` is only comparable with
    other marks of the same GPU.
    """

    kind: Literal["step_begin", "step_end", "epoch_begin", "epoch_end"]
    epoch: Counter
    step: Counter
    t_ns: Nanos
    energy_j: float = Field(ge=0)
    power_limit_w: PowerW | None = None
    """The GPU's power limit when the mark was taken (None: not known)."""


class Measurement(_Part):
    """Time and energy of one step or instruction of the rank bound to a GPU."""

    kind: Literal["step", "instruction"]
    name: Name
    epoch: Counter
    step: Counter
    index: Counter
    t0_ns: Nanos
    t1_ns: Nanos
    time_s: float = Field(ge=0)
    energy_j: float = Field(ge=0)
    schedule: ScheduleVersion | None = None
    """The version of the frequency schedule the step or instruction ran under (None: none)."""

    @model_validator(mode="after")
    def _ordered(self) -> Measurement:
        if self.t1_ns < self.t0_ns:
            raise ValueError(f"t1_ns ({self.t1_ns}) precedes t0_ns ({self.t0_ns})")
        return self


class MeasurementBatch(Message):
    """One GPU's marks and measurements, as `NodeMeasurementBatch.per_gpu` shows them."""

    node: Name
    gpu: GpuIndex
    job_id: Id
    rank: Rank
    marks: list[Mark] = Field(default=[], fail_fast=True)
    measurements: list[Measurement] = Field(default=[], fail_fast=True)
    join_digest: JoinDigest | None = Field(
        default=None,
        description="Digest of the join token the bound trainer presented in its HELLO (None: "
        "none): the coordinator counts a job's marks only from a trainer that had its token",
    )


class ErrorEvent(Message):
    """Something went wrong that nobody asked about: a bad datagram, a schedule mismatch."""

    source: Text
    code: Name
    message: Text
    job_id: Id | None = None
    rank: Rank | None = None
    detail: dict[str, Any] = {}


# ---------------------------------------------------------------------------- GPU commands
class _Leased(_Part):
    holder: Id = Field(default="", description="Who holds the setting (a job id); '' = nobody")
    lease_s: float | None = Field(
        default=None,
        gt=0,
        le=MAX_LEASE_S,
        description="Restore defaults unless renewed within this time (s); None: the agent's "
        "default lease",
    )


class InfoCmd(_Part):
    """Describe the GPU, its current settings, leases and bound rank."""

    op: Literal["info"] = "info"


class SetPowerLimitCmd(_Leased):
    """Set the power limit (W)."""

    op: Literal["set_power_limit"] = "set_power_limit"
    power_limit_w: PowerW


class ResetPowerLimitCmd(_Part):
    """Restore the default power limit."""

    op: Literal["reset_power_limit"] = "reset_power_limit"


class LockClocksCmd(_Leased):
    """Lock the SM clock into [min_mhz, max_mhz]."""

    op: Literal["lock_clocks"] = "lock_clocks"
    min_mhz: ClockMhz
    max_mhz: ClockMhz


class ResetClocksCmd(_Part):
    """Unlock the SM clock."""

    op: Literal["reset_clocks"] = "reset_clocks"


class InstallScheduleCmd(_Leased):
    """Install a rank's frequency schedule, applied on each `instruction_begin`."""

    op: Literal["install_schedule"] = "install_schedule"
    job_id: Id
    schedule: FrequencySchedule
    version: int = Field(default=0, ge=0, le=MAX_SCHEDULE_VERSION, description="The "
                         "schedule's number in its job (measurements made under it carry it)")
    from_step: int | None = Field(
        default=None,
        ge=0,
        le=MAX_COUNTER,
        description="Switch to it at the rank's first step_begin whose step counter is >= this "
        "(so every rank switches at the same iteration boundary); None: at once",
    )


class ClearScheduleCmd(_Part):
    """Remove the installed schedule and unlock clocks."""

    op: Literal["clear_schedule"] = "clear_schedule"


class BindRankCmd(_Part):
    """Bind a job's rank to this GPU, so its events are measured here."""

    op: Literal["bind"] = "bind"
    job_id: Id
    rank: Rank
    join_digest: JoinDigest | None = None
    """The job's join token digest, as a trainer's HELLO with the token would bind it."""


class UnbindRankCmd(_Part):
    """Forget the bound rank."""

    op: Literal["unbind"] = "unbind"


class EnergyCmd(_Part):
    """Energy and time between two host-local monotonic timestamps of this agent's host."""

    op: Literal["energy"] = "energy"
    t0_ns: Nanos
    t1_ns: Nanos


class SelectCmd(_Part):
    """Ask the trainer bound to this GPU (a job's rank 0) to choose the optimal power limit.

    The agent pushes the measurements to the trainer (`zeus_agent.wire.trainer.SelectRequest`);
    the trainer's drop-in runs the user's own `OptimumSelector` and answers with a `selection`
    event of the rank, which reaches the coordinator with the rank's other events. Replies at
    once: `trainer_left` when no trainer of `job_id` is bound here.
    """

    op: Literal["select"] = "select"
    job_id: Id
    request: int = Field(ge=0, le=MAX_COUNTER, description="Numbers the question: the answer "
                         "names it")
    measurements: list[PowerLimitMeasurement] = Field(min_length=1, max_length=MAX_PROFILE_ROWS)


class RenewLeasesCmd(_Part):
    """Renew every lease of `holder` on this GPU."""

    op: Literal["renew"] = "renew"
    holder: Id
    lease_s: float = Field(gt=0, le=MAX_LEASE_S)


GpuCommand = Annotated[
    InfoCmd
    | SetPowerLimitCmd
    | ResetPowerLimitCmd
    | LockClocksCmd
    | ResetClocksCmd
    | InstallScheduleCmd
    | ClearScheduleCmd
    | BindRankCmd
    | UnbindRankCmd
    | EnergyCmd
    | RenewLeasesCmd
    | SelectCmd
    | NodeCapCmd,
    Field(discriminator="op"),
]


class CommandEnvelope(Message):
    """A GPU command on the bus: `{"v": 1, "cmd": {"op": ..., ...}}`."""

    cmd: GpuCommand


REPLY_CODES: dict[str, str] = {
    "bad_request": "the payload does not decode or validate (a field, the version, the size)",
    "out_of_range": "a limit, clock or lease outside what the GPU or the contract allows",
    "not_supported": "the GPU cannot do it (no such clock, no energy counter, ...)",
    "permission": "NVML refused the call: the agent lacks the privilege",
    "read_only": "the GPU is observed only (--observe-only, or NVML said NO_PERMISSION)",
    "forbidden": "the sender may not ask it (another node's GPU, another user's job, a token)",
    "quota": "too many jobs in all or on this node (--max-jobs, --max-jobs-per-node)",
    "too_large": "what a job keeps would pass its memory cap (--max-pipeline-mb-per-*)",
    "unavailable": "a dependency is down (JetStream, the GPU, the owner replica): retry",
    "unknown_job": "no such job (never registered, or deleted after being idle)",
    "unknown_rank": "no such rank in the job",
    "duplicate": "already registered",
    "conflict": "another running trainer process drives this GPU",
    "trainer_left": "the job's trainer left this GPU: its settings are not applied again",
    "stale_lease": "the sender's ownership lease (Zeus-Lease header) has ended, or a newer "
                   "owner commands the GPU: the command is fenced off",
    "timeout": "the work did not finish in time",
    "internal": "a bug: the service logged it and keeps serving",
}
"""Every stable `Reply.code`, with what it means (the reference documentation lists these)."""


class Reply(Message):
    """The answer to every request. `ok` False carries a stable `code` and a message.

    Codes: the keys of `REPLY_CODES`.
    """

    ok: bool
    code: Name = ""
    error: Text = ""
    result: dict[str, Any] = {}

    @classmethod
    def success(cls, **result: Any) -> Reply:
        """A successful reply carrying `result`."""
        return cls(ok=True, result=result)

    @classmethod
    def failure(cls, code: str, error: str) -> Reply:
        """A failed reply with a stable code and a message for people, cut to fit.

        (Messages often echo what the asker sent.)
        """
        return cls(ok=False, code=code, error=bounded(error))


# ---------------------------------------------------------------------------- coordinator
SelectorName = Literal["Energy", "Time", "ZeusCost", "MaxSlowdownConstraint", "Custom"]
"""The built-in selectors, run by the coordinator; "Custom": the user's own `OptimumSelector`,
run in rank 0's process when profiling ends (`SelectCmd`)."""


class PowerLimitOptions(_Part, AddedFields):
    """How the coordinator optimises a data-parallel job's power limit (Zeus's arguments)."""

    ADDED: ClassVar[tuple[str, ...]] = ("custom_selector", "selector_timeout_s", "priority")

    selector: SelectorName = "ZeusCost"
    custom_selector: Text = Field(
        default="", description="With selector 'Custom': the selector as its trainer shows it "
        "(its repr), for statuses")
    selector_timeout_s: float = Field(
        default=600.0, gt=0, le=MAX_LEASE_S, description="With selector 'Custom': how long "
        "rank 0's process has to answer (it answers at its next step or epoch end); then "
        "the built-in ZeusCost chooses")
    eta_knob: float = Field(default=0.5, ge=0.0, le=1.0)
    world_size: int | None = Field(
        default=None, ge=1, description="ZeusCost's world_size; None: the job's GPU count"
    )
    max_slowdown: float = Field(default=1.1, ge=1.0)
    wait_steps: int = Field(default=1, ge=0, le=MAX_STEPS)
    warmup_steps: int = Field(default=10, ge=0, le=MAX_STEPS)
    profile_steps: int = Field(default=40, ge=1, le=MAX_STEPS)
    pl_step_w: int = Field(default=25, ge=1, le=10_000)
    search: Literal["exhaustive", "adaptive"] = "exhaustive"
    profile: list[PowerLimitMeasurement] | None = Field(
        default=None,
        max_length=MAX_PROFILE_ROWS,
        description="A profile the trainer read from its own `profile_path` (Zeus JSON "
        "measurements): profiling is skipped and the optimum is chosen from it",
    )
    priority: float = Field(
        default=1.0, gt=0, le=1000, description="How much this job's slowdown counts when a "
        "power budget is shared among jobs (2: twice as much as a job of priority 1, so it is "
        "slowed less)",
    )
    save_profile: bool = Field(
        default=False,
        description="The trainer wants the measured profile back (to write its `profile_path`)",
    )


class RegisterJob(Message):
    """Register a job. `power_limit` set: the coordinator runs the power-limit optimizer."""

    job: JobInfo
    uid: int | None = Field(
        default=None,
        ge=0,
        le=2**32 - 1,
        description="The registering trainer's user id, as its agent saw it on the socket "
        "(set by the agent, never by the trainer)",
    )
    scheduler: Annotated[
        str, StringConstraints(max_length=64, pattern=NO_CONTROL_CHARS)
    ] = "PowerLimitOptimizer"
    power_limit: PowerLimitOptions | None = None


class GpuBinding(_Part):
    """The GPU a rank drives: node name and GPU index (and uuid when known)."""

    node: Name
    gpu_index: int = Field(ge=0, le=MAX_RANK)
    gpu_uuid: Name = ""


class RegisterRank(Message):
    """Register one rank of a job, with the GPU it drives."""

    job_id: Id
    rank_info: RankInfo
    gpu: GpuBinding
    uid: int | None = Field(
        default=None,
        ge=0,
        le=2**32 - 1,
        description="The trainer's user id, as its agent saw it (set by the agent): a job's "
        "ranks must come from the user who registered it",
    )
    join_token: JoinToken | None = Field(
        default=None,
        description="The secret the coordinator returned with the job id when rank 0 "
        "registered the job; every rank presents it (rank 0 passes it to the other ranks with "
        "the id), so knowing a job's id is not enough to take one of its ranks",
    )
    gpu_info: GpuDescription | None = Field(
        default=None,
        description="The GPU as its agent describes it (set by the agent, which relays the "
        "registration): the coordinator then need not ask the agent (`info`) before it accepts "
        "the rank; None: the coordinator asks",
    )


MAX_JOBS_PER_PAGE = 1000
"""Most job ids in one answer to a listing `JobQuery` (keeps it far below NATS's 1 MB)."""


class JobQuery(Message):
    """Ask the coordinator for a job's state, or (`job_id` None) a page of the job ids.

    A listing answers `jobs` (sorted ids from `offset`, at most `limit`), `total` and
    `next_offset` (None on the last page).
    """

    job_id: Id | None = None
    offset: int = Field(default=0, ge=0)
    limit: int = Field(default=MAX_JOBS_PER_PAGE, ge=1, le=MAX_JOBS_PER_PAGE)


class StragglerNotice(Message):
    """Pipeline `pipeline` (a data-parallel rank) of pipeline job `job_id` is a straggler.

    `factor`: it runs that many times slower than planned (1.3: 30% slower), e.g. a node known
    to throttle; the coordinator slows the job's other pipelines down to save energy, never
    below the straggler's pace. `clear`: it is not (any more); what the coordinator measures
    counts again. Exactly one of the two.
    """

    job_id: Id
    pipeline: int = Field(ge=0, le=MAX_RANK)
    factor: float | None = Field(default=None, ge=1.0, le=MAX_STRAGGLER_FACTOR)
    clear: bool = False

    @model_validator(mode="after")
    def _factor_or_clear(self) -> StragglerNotice:
        if (self.factor is None) != self.clear:
            raise ValueError("give either a factor (>= 1) or clear=true, not both nor neither")
        return self


class TrainerEvent(_Part):
    """A trainer event with the rank's running counters (stamp is host-local)."""

    kind: Literal[
        "epoch_begin",
        "epoch_end",
        "step_begin",
        "step_end",
        "instruction_begin",
        "instruction_end",
        "selection",
    ]
    """... or `selection`: rank 0's answer to a `SelectCmd`: `index` the request, the chosen
    `power_limit_w` (None: the selector failed, `name` says why)."""
    t_ns: Nanos
    epoch: Counter = 0
    step: Counter = 0
    index: Counter = 0
    name: Name = ""
    power_limit_w: PowerW | None = None
    """The GPU's power limit when the event happened, as its agent knows it (None: unknown).

    The coordinator paces profiling windows with these events: after a broker outage they come
    late and at once, and this says which of them ran before the window's limit was set.
    """


class TrainerEventBatch(Message):
    """Events of one rank, oldest first, as forwarded by its node's agent."""

    job_id: Id
    rank: Rank
    node: Name
    gpu: GpuIndex
    events: list[TrainerEvent] = Field(fail_fast=True)
    join_digest: JoinDigest | None = Field(
        default=None,
        description="Digest of the join token the bound trainer presented in its HELLO (None: "
        "none): the coordinator counts a job's events only from a trainer that had its token",
    )


class JobStatus(Message):
    """A job's state change or progress, for people and dashboards."""

    job_id: Id
    state: Name
    message: Text
    progress: dict[str, Any] = {}


class LeaseRenewal(Message):
    """Renew every lease `holder` has on any agent for `lease_s` seconds."""

    holder: Id
    lease_s: float = Field(gt=0, le=MAX_LEASE_S)

    @field_validator("holder")
    @classmethod
    def _non_empty(cls, holder: str) -> str:
        if not holder:
            raise ValueError("holder must not be empty")
        return holder


GPU_COMMAND: TypeAdapter[GpuCommand] = TypeAdapter(GpuCommand)
