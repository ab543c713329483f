"""The local datagram protocol between trainers (`zeus_agent.emit`) and their node's agent.

Trainers send msgpack arrays on a Unix datagram socket; the agent answers requests by sending
to the trainer's own (autobound) socket address. Arrays, not maps, keep the hot path at about
a microsecond.

The `pid` field of events and requests is kept for compatibility and ignored by the agent: it
reads each sender's pid and uid from the kernel (`SO_PASSCRED`/`SCM_CREDENTIALS`).

* Event  (trainer -> agent, fire and forget): `[1, kind, pid, t_ns, a, b, name]`
  * `EPOCH_BEGIN`/`EPOCH_END`: a = epoch, b = 0
  * `STEP_BEGIN`/`STEP_END`: a = step (running count of the rank's steps), b = epoch
  * `INSTRUCTION_BEGIN`/`INSTRUCTION_END`: a = instruction index (running), b = step; name
* Request (trainer -> agent): `[1, kind, pid, request_id, payload]`, payload a map:
  * `HELLO`: `TrainerHello` (binds the pid to a job rank and GPU; replied)
  * `REGISTER_JOB`: a `RegisterJob` message, relayed to the coordinator
  * `REGISTER_RANK`: a `RegisterRank` message, relayed to the coordinator
  * `WINDOW`: `WindowRequest`, energy of GPUs between two stamps, answered from ring buffers
    (at once; with `exact`, once a counter read brackets the window's end); with `cpus`, also
    the CPU packages' and their DRAM's energy (RAPL)
  * `BYE`: the trainer is done; its GPUs' rank settings are released
  * `QUERY_JOB`: a `JobQuery` message, relayed to the coordinator (e.g. for the measured
    profile, which the trainer's drop-in writes to its own `profile_path`)
* Reply (agent -> trainer): `[1, REPLY, request_id, reply]` with reply a `Reply` map.
* Schedule notice (agent -> trainer, unsolicited): `[1, SCHEDULE, 0, notice]`, a
  `ScheduleNotice` map: the frequency schedule installed for the trainer's rank and the step
  from which it applies, so the trainer's drop-in can check instruction names locally.
* Select notice (agent -> rank 0's trainer, unsolicited): `[1, SELECT, 0, request]`, a
  `SelectRequest` map: the measured profile, for the user's own optimum selector; the trainer
  answers with a `SELECTED` request (`SelectionAnswer`), which the agent forwards to the
  coordinator as the rank's `selection` event.

`encode_event` is the hot path; everything else validates with pydantic.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field

from zeus_agent.errors import PayloadError
from zeus_agent.models import (
    MAX_ID_CHARS,
    MAX_NAME_CHARS,
    MAX_POWER_W,
    MAX_RANK,
    PowerLimitMeasurement,
)
from zeus_agent.wire.codec import unpack, validate
from zeus_agent.wire.messages import MAX_COUNTER, MAX_NS, AddedFields, JoinToken, Reply
from zeus_agent.wire.text import shown

PROTOCOL_VERSION = 1
DEFAULT_SOCKET_PATH = "/run/zeus-agent/agent.sock"
MAX_DATAGRAM_BYTES = 65_000


class Kind(enum.IntEnum):
    """Datagram kinds."""

    EPOCH_BEGIN = 1
    EPOCH_END = 2
    STEP_BEGIN = 3
    STEP_END = 4
    INSTRUCTION_BEGIN = 5
    INSTRUCTION_END = 6
    HELLO = 20
    REGISTER_JOB = 21
    REGISTER_RANK = 22
    WINDOW = 23
    BYE = 24
    QUERY_JOB = 25
    SELECTED = 26
    REPLY = 30
    SCHEDULE = 31
    SELECT = 32


EVENT_KINDS = frozenset(
    {
        Kind.EPOCH_BEGIN,
        Kind.EPOCH_END,
        Kind.STEP_BEGIN,
        Kind.STEP_END,
        Kind.INSTRUCTION_BEGIN,
        Kind.INSTRUCTION_END,
    }
)
REQUEST_KINDS = frozenset(
    {Kind.HELLO, Kind.REGISTER_JOB, Kind.REGISTER_RANK, Kind.WINDOW, Kind.BYE, Kind.QUERY_JOB,
     Kind.SELECTED}
)


MAX_WINDOW_GPUS = 1024
"""Most GPUs one WINDOW request may name."""
MAX_WINDOW_CPUS = 1024
"""Most CPU packages one WINDOW request may name."""


class TrainerHello(BaseModel):
    """A trainer process introduces itself: which job rank it is and which GPU it drives.

    The agent binds the GPU to the process the kernel names as the sender (never a pid in the
    payload). Strings are bounded: a job id has 1 to `MAX_ID_CHARS` characters.
    """

    model_config = ConfigDict(extra="forbid")

    job_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    rank: int = Field(ge=0, le=MAX_RANK)
    dp_rank: int = Field(default=0, ge=0, le=MAX_RANK)
    pp_rank: int = Field(default=0, ge=0, le=MAX_RANK)
    tp_rank: int = Field(default=0, ge=0, le=MAX_RANK)
    gpu_index: int = Field(ge=0, le=MAX_RANK)
    join_token: JoinToken | None = None
    """The job's join token (as in `RegisterRank`): an agent that relayed a rank of the job
    with it refuses a HELLO for the job without it, so a process that knows only the job id
    cannot speak as one of its ranks (e.g. a rank whose process has gone)."""


class WindowRequest(AddedFields):
    """Energy of each listed GPU between two host-local monotonic stamps."""

    model_config = ConfigDict(extra="forbid")
    ADDED: ClassVar[tuple[str, ...]] = ("exact", "cpus")

    t0_ns: int
    t1_ns: int
    gpus: list[int] = Field(max_length=MAX_WINDOW_GPUS)
    exact: bool = False
    """Answer once a counter read brackets `t1_ns` (~60 ms later, ~200 ms at most on an H200)
    instead of at once (past the newest read: the last update period's power). Added after
    protocol 1 shipped: sent only when True, so agents that predate it keep answering every
    other window; one that predates it refuses an exact window (bad_request), and
    `zeus_agent.emit` then asks again without it."""
    cpus: list[Annotated[int, Field(ge=0, le=MAX_RANK)]] | Literal["all"] | None = Field(
        default=None, max_length=MAX_WINDOW_CPUS)
    """CPU packages (Zeus's CPU indices: RAPL's `intel-rapl:<index>`) whose energy the reply
    adds, "all" for every package of the node, None for none. The reply then carries `cpus`
    (the packages answered), `cpu_energy_j` and `dram_energy_j` (J each, in that order; a DRAM
    energy is None where the package has no DRAM domain) and, when a package asked for is
    missing (no RAPL on the node, not readable, not there), `cpu_error` saying why. Added after
    protocol 1 shipped, like `exact`: sent only when set; an agent that predates it refuses it
    (bad_request), and `zeus_agent.emit` then asks again without it."""


class ScheduleNotice(BaseModel):
    """A rank's frequency schedule, pushed by the agent when the coordinator installs it.

    It applies from the iteration whose `step_begin` carries a step counter >= `from_step`.
    """

    job_id: str = Field(max_length=MAX_ID_CHARS)
    rank: int = Field(ge=0, le=MAX_RANK)
    version: int = Field(ge=0)
    from_step: int = Field(ge=0)
    frequencies: list[tuple[str, int]]


class SelectRequest(BaseModel):
    """The coordinator asks rank 0's trainer to choose the optimal power limit (agent -> trainer).

    Pushed unsolicited (`[1, SELECT, 0, request]`); the trainer answers with a `SELECTED`
    request carrying a `SelectionAnswer`.
    """

    model_config = ConfigDict(extra="forbid")

    job_id: str = Field(max_length=MAX_ID_CHARS)
    request: int = Field(ge=0)
    measurements: list[PowerLimitMeasurement] = Field(min_length=1, max_length=256)


class SelectionAnswer(BaseModel):
    """Rank 0's answer to a `SelectRequest`: the chosen limit (W), or why there is none."""

    model_config = ConfigDict(extra="forbid")

    job_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    request: int = Field(ge=0, le=MAX_COUNTER)
    power_limit_w: int | None = Field(default=None, ge=1, le=MAX_POWER_W)
    error: str = Field(default="", max_length=MAX_NAME_CHARS)


@dataclass(frozen=True, slots=True)
class EventDatagram:
    """A decoded trainer event."""

    kind: Kind
    pid: int
    t_ns: int
    a: int
    b: int
    name: str


@dataclass(frozen=True, slots=True)
class RequestDatagram:
    """A decoded trainer request; `payload` is still to be validated for its kind."""

    kind: Kind
    pid: int
    request_id: int
    payload: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ReplyDatagram:
    """A decoded agent reply."""

    request_id: int
    reply: Reply


_packer = msgpack.Packer(use_bin_type=True)


def encode_event(kind: int, pid: int, t_ns: int, a: int, b: int, name: str) -> bytes:
    """Pack an event datagram (hot path: no validation)."""
    return _packer.pack([PROTOCOL_VERSION, kind, pid, t_ns, a, b, name])


def encode_request(kind: Kind, pid: int, request_id: int, payload: BaseModel | dict) -> bytes:
    """Pack a request datagram."""
    if isinstance(payload, BaseModel):
        payload = payload.model_dump(mode="python")
    return _packer.pack([PROTOCOL_VERSION, int(kind), pid, request_id, payload])


def encode_reply(request_id: int, reply: Reply) -> bytes:
    """Pack a reply datagram."""
    return _packer.pack(
        [PROTOCOL_VERSION, int(Kind.REPLY), request_id, reply.model_dump(mode="python")]
    )


def encode_notice(notice: ScheduleNotice | SelectRequest) -> bytes:
    """Pack a notice datagram (agent -> trainer): a schedule, or a question to rank 0."""
    kind = Kind.SELECT if isinstance(notice, SelectRequest) else Kind.SCHEDULE
    return _packer.pack([PROTOCOL_VERSION, int(kind), 0, notice.model_dump(mode="python")])


def _int(value: Any, what: str) -> int:
    if type(value) is not int:
        raise PayloadError(f"datagram field '{what}' must be an integer, got {shown(value)}", what)
    return value


def _bounded(value: Any, what: str, most: int) -> int:
    """An event's stamp or counter: an integer in [0, most] (the coordinator refuses others)."""
    if type(value) is not int or not 0 <= value <= most:
        raise PayloadError(f"datagram field '{what}' must be an integer in [0, {most}], got "
                           f"{shown(value)}", what)
    return value


def decode_datagram(
    data: bytes,
) -> EventDatagram | RequestDatagram | ReplyDatagram | ScheduleNotice | SelectRequest:
    """Decode and check one datagram.

    Raises:
        PayloadError: Not msgpack, not an array of the right shape, an unknown kind or
            protocol version, or a field of the wrong type; the message says which.
    """
    obj = unpack(data)
    if not isinstance(obj, list) or len(obj) < 4:
        raise PayloadError("datagram must be a msgpack array of at least 4 items")
    if obj[0] != PROTOCOL_VERSION:
        raise PayloadError(
            f"datagram protocol version {shown(obj[0])} is not supported (agent speaks "
            f"{PROTOCOL_VERSION}); use a zeus_agent.emit of the agent's version",
            "v",
        )
    try:
        kind = Kind(_int(obj[1], "kind"))
    except ValueError:
        raise PayloadError(f"unknown datagram kind {shown(obj[1])}", "kind") from None
    if kind in EVENT_KINDS:
        if len(obj) != 7:
            raise PayloadError(f"{kind.name} datagram must have 7 items, got {len(obj)}")
        name = obj[6]
        if not isinstance(name, str):
            raise PayloadError(f"datagram field 'name' must be a string, got {shown(name)}", "name")
        if len(name) > MAX_NAME_CHARS:
            raise PayloadError(
                f"datagram field 'name' has {len(name)} characters; at most {MAX_NAME_CHARS}",
                "name",
            )
        if name and not name.isprintable():
            raise PayloadError(
                f"datagram field 'name' {shown(name)} has control characters", "name"
            )
        # Counters beyond the contract's (a trainer's bug) still reach the agent's measuring,
        # which refuses to forward or measure them and tells the coordinator which rank it is.
        return EventDatagram(
            kind, _int(obj[2], "pid"), _bounded(obj[3], "t_ns", MAX_NS), _int(obj[4], "a"),
            _int(obj[5], "b"), name,
        )  # fmt: skip
    if kind is Kind.REPLY:
        return ReplyDatagram(_int(obj[2], "request_id"), validate(Reply, obj[3]))
    if kind is Kind.SCHEDULE:
        return validate(ScheduleNotice, obj[3])
    if kind is Kind.SELECT:
        return validate(SelectRequest, obj[3])
    if len(obj) != 5 or not isinstance(obj[4], dict):
        raise PayloadError(f"{kind.name} datagram must be [v, kind, pid, request_id, map]")
    return RequestDatagram(kind, _int(obj[2], "pid"), _int(obj[3], "request_id"), obj[4])
