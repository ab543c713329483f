"""Long and nested values in every field of every message, on every subject a credential may
publish to (issue 26, "One request must not stop a coordinator": the rest of the surface).

For each request subject (the coordinator's `jobs.register.<node>`, `ranks.register.<node>`,
`jobs.query`, `jobs.straggler` and its replica's own `coord.replica.<me>.{query,straggler}`;
the agent's `gpu.<node>.<i>.cmd` for every command), each stream subject the services follow
(job events, GPU measurements, GPU errors, agent hellos: the coordinator; lease renewals and
pings: the agent) and the trainers' datagram socket, a VALID message of that kind has one field
at a time (nested ones too: list items, map values, nested models; and the whole message)
replaced with:

* long strings: 5 KB (ASCII, 2-byte characters, control characters), 100 KB, and one filling
  the payload up to near NATS's `max_payload` (a datagram: near `MAX_DATAGRAM_BYTES`),
  100 KB of bytes, a list of fifty 5 KB strings;
* nested lists and maps 50, 500, 960 and 1,020 deep (Python's `repr` gives up near 1,000; the
  msgpack unpacker near 1,024) and 100,000 deep (refused by the unpacker);
* huge numbers: 2**64-1, 2**63, -2**63 (2**64 and -2**63-1 have no msgpack encoding: no
  sender can put them on the wire), nan, inf, -inf, 1e308;
* maps with a 5 KB key, 10,000 keys, 100,000 keys, and a 100,000-item list;
* a list field kept valid but long: its first item repeated (up to 10,000 times);

and the top-level map gets a 5 KB key (str and bytes), 65 keys, 100,000 keys. Subject tokens
a credential chooses (a node, a GPU, a job, a holder) are fuzzed too: 3,000 characters, non-ASCII
digits ("²", "٣"), the "~" of shortened tokens.

What must hold for every case (besides `Bus.check_healthy` after every field: no internal error
logged, both services answer, GPUs safe, nothing answered a stream message):
* a request gets a `Reply`: "bad_request" when the payload does not decode as its model,
  otherwise ok or a stable code; never "internal", never no answer;
* a stream message that does not decode is dropped and counted ("malformed" on the
  coordinator, `bad_lease_renewal` on the agent), one that does is handled;
* a datagram is counted; a request datagram gets a coded reply; the gateway's `internal_error`
  stays 0;
* the log stays small: no record longer than `LOG_RECORD_MAX` characters, no more than
  `LOG_CASE_MAX` characters logged while one message is handled (long values echoed into
  WARNING lines would be a log-flood vector).

At `ZEUS_FUZZ_SCALE` 1 every field gets the core values (a 5 KB string, a list and a map 960
deep, 2**64-1, -2**63, nan, inf, a map with a 5 KB key) and, in turn, one other cheap value and
one costly one (100 KB, near the payload limit, 100,000 keys or items or levels): ~3,300 cases,
about 40 s; at 2 or more, every value on every field (~8,300 cases, ~3 minutes).

Regressions at the end of the module (each failed before its fix): a datagram item nested
~1,000 deep or 60 KB long (`decode_datagram` echoed it with `!r`), a command whose `op` is
nested ~1,000 deep (an unraisable RecursionError in pydantic), a GPU error on a GPU token of
non-ASCII digits (the coordinator's `int()` raised out of its callback), bad lease renewals
(a 3 KB WARNING line each, unthrottled).
"""

from __future__ import annotations

import copy
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest

from tests.fuzz.fuzz_kit import (
    I64,
    OK,
    SCALE,
    STABLE_CODES,
    U64,
    Bus,
    drops,
    publish_with_barrier,
    resolve,
)
from zeus_agent.errors import PayloadError
from zeus_agent.wire import codec, subjects
from zeus_agent.wire import trainer as dg
from zeus_agent.wire.messages import (
    AgentHello,
    CommandEnvelope,
    ErrorEvent,
    JobQuery,
    LeaseRenewal,
    RegisterJob,
    RegisterRank,
    Reply,
    StragglerNotice,
    TrainerEventBatch,
    join_token_digest,
)
from zeus_agent.wire.node_batch import NodeMeasurementBatch
from zeus_demo.cluster import wait_for

pytestmark = pytest.mark.timeout(600)

ALL = SCALE >= 2
"""Every costly value on every field (else one in turn per field)."""
LOG_RECORD_MAX = 2_000
"""Longest log record (message and traceback, characters) one bad message may cause."""
LOG_CASE_MAX = 4_000
"""Most characters logged in all while one message is handled."""
MARGIN = 512
"""Bytes kept free below a payload limit (headers, the subject's share)."""
K = dg.Kind


# ---------------------------------------------------------------------------- values
@dataclass(frozen=True)
class Value:
    """A replacement value, as msgpack bytes; `room` is what the payload has left.

    `core`: given to every field; the others in turn (all of them with `ALL`).
    """

    name: str
    pack: Callable[[int], bytes]
    core: bool = False
    costly: bool = False


def _packed(obj: Any) -> Callable[[int], bytes]:
    data = msgpack.packb(obj, use_bin_type=True)
    return lambda _room: data


def _nest(depth: int, as_map: bool = False) -> Callable[[int], bytes]:
    # Built as bytes: msgpack's packer refuses more than 511 levels.
    data = (b"\x81\xa1k" if as_map else b"\x91") * depth + b"\xc0"
    return lambda _room: data


def _fill(room: int) -> bytes:
    return msgpack.packb("z" * max(0, room - 8), use_bin_type=True)


VALUES: tuple[Value, ...] = (
    Value("5 KB str", _packed("z" * 5_000), core=True),
    Value("list 960 deep", _nest(960), core=True),
    Value("map 960 deep", _nest(960, as_map=True), core=True),
    Value("2**64-1", _packed(U64), core=True),
    Value("-2**63", _packed(I64), core=True),
    Value("nan", _packed(float("nan")), core=True),
    Value("inf", _packed(float("inf")), core=True),
    Value("map with a 5 KB key", _packed({"k" * 5_000: 1}), core=True),
    Value("5,000 'é'", _packed("é" * 5_000)),
    Value("5 KB control chars", _packed("\x00\x1b[2J\r\n" * 800)),
    Value("50 x 5 KB strs", _packed(["z" * 5_000] * 50)),
    Value("list 50 deep", _nest(50)),
    Value("list 500 deep", _nest(500)),
    Value("list 1,020 deep", _nest(1_020)),
    Value("map 50 deep", _nest(50, as_map=True)),
    Value("map 500 deep", _nest(500, as_map=True)),
    Value("2**63", _packed(2**63)),
    Value("-inf", _packed(float("-inf"))),
    Value("1e308", _packed(1e308)),
    Value("map of 10,000 keys", _packed({f"k{i}": i for i in range(10_000)})),
    Value("100 KB str", _packed("z" * 100_000), costly=True),
    Value("str up to the payload limit", _fill, costly=True),
    Value("100 KB bytes", _packed(b"\xff" * 100_000), costly=True),
    Value("list 100,000 deep", _nest(100_000), costly=True),
    Value("map of 100,000 int keys", _packed(dict.fromkeys(range(100_000), 0)), costly=True),
    Value("list of 100,000 ints", _packed([7] * 100_000), costly=True),
)
CORE = tuple(v for v in VALUES if v.core)
CHEAP = tuple(v for v in VALUES if not v.core and not v.costly)
COSTLY = tuple(v for v in VALUES if v.costly)

EXTRAS: tuple[tuple[str, dict[Any, Any], bool], ...] = (
    ("a 5 KB key", {"k" * 5_000: 1}, False),
    ("a 5 KB bytes key", {b"\xfe" * 5_000: 1}, False),
    ("65 more keys", {f"x{i}": i for i in range(65)}, False),
    ("100,000 more keys", {f"x{i}": 0 for i in range(100_000)}, True),
)
"""What is added to a message's top-level map (name, keys, costly)."""

MARKER = "\x00zeus-long-values-marker\x00"
MARKER_BYTES = msgpack.packb(MARKER, use_bin_type=True)


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every field of a message: map keys and the first item of lists (the top-level list of
    a datagram: every item), nested ones too (depth first)."""
    if isinstance(obj, dict):
        items: Any = obj.items()
    elif isinstance(obj, list) and not prefix:
        items = enumerate(obj)
    elif isinstance(obj, list):
        items = [(0, obj[0])] if obj else []
    else:
        return
    for key, value in items:
        yield (*prefix, key)
        yield from _paths(value, (*prefix, key))


def _replaced(obj: Any, path: tuple[Any, ...], value: Value, limit: int) -> bytes:
    """`obj` packed with the field at `path` (() : the whole message) replaced by `value`."""
    if not path:
        return value.pack(limit - MARGIN)
    obj = copy.deepcopy(obj)
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = MARKER
    rest = msgpack.packb(obj, use_bin_type=True)
    assert rest.count(MARKER_BYTES) == 1
    return rest.replace(MARKER_BYTES, value.pack(limit - len(rest) - MARGIN))


REPEAT = 10_000
"""Most items of a valid list made long."""
NOTHING = Value("nil", _packed(None))


def _at(obj: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def _with_extra(obj: Any, extra: dict[Any, Any]) -> bytes:
    obj = copy.deepcopy(obj)
    if isinstance(obj, list):  # A request datagram: its payload map.
        obj[4].update(extra)
    else:
        obj.update(extra)
    return msgpack.packb(obj, use_bin_type=True)


@dataclass(frozen=True)
class Mutation:
    what: str
    data: bytes


def mutations(obj: Any, limit: int, extras: bool = True) -> Iterator[tuple[str, list[Mutation]]]:
    """(field, its mutations) for every field of `obj` and the whole of it, then the extras.

    The core values on every field; the others in turn (all of them with `ALL`).
    """
    fields = [(), *_paths(obj)]
    for i, path in enumerate(fields):
        values = list(CORE)
        if ALL:
            values += [*CHEAP, *COSTLY]
        else:
            values += [CHEAP[i % len(CHEAP)], COSTLY[i % len(COSTLY)]]
        where = ".".join(str(p) for p in path) or "<message>"
        cases = [Mutation(f"{where}={v.name}", _replaced(obj, path, v, limit)) for v in values]
        current = _at(obj, path)
        if isinstance(current, list) and current and path:
            # A valid list, only longer: its first item again and again (up to 10,000 times,
            # within the payload).
            item = msgpack.packb(current[0], use_bin_type=True)
            n = max(1, min(REPEAT, (limit - len(_replaced(obj, path, NOTHING, limit)) - MARGIN)
                           // len(item)))  # fmt: skip
            many = Value(f"first item x{n}", _packed([current[0]] * n))
            cases.append(Mutation(f"{where}={many.name}", _replaced(obj, path, many, limit)))
        yield where, cases
    if extras:
        yield "<top-level keys>", [
            Mutation(f"+{name}", _with_extra(obj, keys))
            for name, keys, costly in EXTRAS
            if ALL or not costly or isinstance(obj, dict)
        ]


# ---------------------------------------------------------------------------- the log meter
class LogMeter(logging.Handler):
    """Sizes (characters) of what the services log: message plus traceback."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[int, str]] = []
        self._formatter = logging.Formatter()

    def emit(self, record: logging.LogRecord) -> None:  # noqa: D102
        if not record.name.startswith(("zeus_agent", "coordinator", "nats")):
            return
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format is a finding, not a crash here
            text = str(record.msg)
        size = len(text)
        if record.exc_info:
            size += len(self._formatter.formatException(record.exc_info))
        self.records.append((size, f"{record.name} {record.levelname}: {text[:160]!r}"))

    def mark(self) -> int:
        return len(self.records)

    def problems(self, mark: int, what: str) -> list[str]:
        """What logging since `mark` exceeds (one bad message's share)."""
        records = self.records[mark:]
        total = sum(size for size, _ in records)
        found = [f"{what}: a {size}-character log record: {head}"
                 for size, head in records if size > LOG_RECORD_MAX]  # fmt: skip
        if total > LOG_CASE_MAX and not found:
            heads = "; ".join(head for _, head in records[:3])
            found.append(f"{what}: {total} characters logged for one message ({heads} ...)")
        return found

    def biggest(self) -> tuple[int, str]:
        return max(self.records, default=(0, ""))


@dataclass
class Outcome:
    """What one test sent and what went wrong (reported all at once)."""

    cases: int = 0
    fields: int = 0
    problems: list[str] = field(default_factory=list)

    def check(self) -> None:
        assert not self.problems, f"{len(self.problems)} problem(s) in {self.cases} cases:\n" + (
            "\n".join(self.problems[:40])
        )


MAX_PROBLEMS = 60
"""Stop a test once this many problems are found (a dead service fails every case)."""


@pytest.fixture(scope="module")
def meter(bus: Bus) -> Iterator[LogMeter]:
    """Measure the services' logging, at INFO as they run in production."""
    handler = LogMeter()
    loggers = [logging.getLogger(name) for name in ("zeus_agent", "coordinator")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.INFO)
    logging.getLogger().addHandler(handler)
    yield handler
    logging.getLogger().removeHandler(handler)
    for lg, level in zip(loggers, levels, strict=True):
        lg.setLevel(level)
    size, head = handler.biggest()
    print(f"\nlargest log record seen: {size} characters: {head}")


@pytest.fixture(scope="module")
def env(bus: Bus) -> dict[str, Any]:
    """Register $JOB (power-limit optimised, ranks on both GPUs) and $JOB2 (4 ranks, none yet);
    the placeholders of the base messages."""
    node = bus.node
    job = {"v": 1, "job": {"dp_degree": 2, "pp_degree": 1, "tp_degree": 1, "world_size": 2,
                           "job_metadata": "long-values"},
           "power_limit": {"selector": "Energy", "wait_steps": 0, "warmup_steps": 0,
                           "profile_steps": 1, "pl_step_w": 100}}  # fmt: skip
    reply = bus.ask(subjects.coord_register_job(node), codec.encode(job))
    assert reply.ok, reply
    job_id, token = reply.result["job_id"], reply.result["join_token"]
    for rank in (0, 1):
        rank_request = {"v": 1, "job_id": job_id, "join_token": token,
                        "rank_info": {"rank": rank, "dp_rank": rank, "pp_rank": 0, "tp_rank": 0,
                                      "available_frequencies": [1740, 210]},
                        "gpu": {"node": node, "gpu_index": rank}}  # fmt: skip
        reply = bus.ask(subjects.coord_register_rank(node), codec.encode(rank_request))
        assert reply.ok, reply
    job2 = {"v": 1, "job": {"dp_degree": 4, "pp_degree": 1, "tp_degree": 1, "world_size": 4,
                            "job_metadata": "long-values-2"}}  # fmt: skip
    reply2 = bus.ask(subjects.coord_register_job(node), codec.encode(job2))
    assert reply2.ok, reply2
    wait_for(lambda: job_id in bus.call(lambda: set(bus.coord.optimisers)), 10,
             "the optimiser of the module's job to start", interval_s=0.02)
    gpu0 = bus.run(bus.agent.agents[0].describe()).model_dump()
    values = {"$JOB": job_id, "$TOKEN": token, "$DIGEST": join_token_digest(token),
              "$JOB2": reply2.result["job_id"], "$TOKEN2": reply2.result["join_token"],
              "$PID": os.getpid(), "$AGENT_ID": bus.agent.agent_id, "$GPU0": gpu0,
              "$REPLICA": bus.coord.settings.replica_name}  # fmt: skip
    bus.env_extra.update(values)
    return values


# ---------------------------------------------------------------------------- base messages
PROFILE_ROW = {"power_limit": 200, "energy": 10.0, "time": 1.0}
REGISTER_JOB = {
    "v": 1,
    "job": {"pp_degree": 1, "dp_degree": 1, "tp_degree": 1, "world_size": 1, "job_id": "",
            "job_metadata": "lv"},
    "uid": 1000,
    "scheduler": "PowerLimitOptimizer",
    "power_limit": {"selector": "Energy", "eta_knob": 0.5, "world_size": 1, "max_slowdown": 1.1,
                    "wait_steps": 0, "warmup_steps": 0, "profile_steps": 1, "pl_step_w": 100,
                    "search": "exhaustive", "profile": [PROFILE_ROW], "save_profile": False},
}  # fmt: skip
REGISTER_RANK = {
    "v": 1,
    "job_id": "$JOB2",
    "join_token": "$TOKEN2",
    "uid": 1000,
    "rank_info": {"rank": 0, "dp_rank": 0, "pp_rank": 0, "tp_rank": 0,
                  "available_frequencies": [1740], "instructions": ["forward"]},
    "gpu": {"node": "$NODE", "gpu_index": 0, "gpu_uuid": ""},
    "gpu_info": "$GPU0",
}  # fmt: skip
JOB_QUERY = {"v": 1, "job_id": "$JOB", "offset": 0, "limit": 10}
STRAGGLER = {"v": 1, "job_id": "$JOB", "pipeline": 0, "factor": 1.5, "clear": False}
SCHEDULE = {"rank": 0, "frequencies": [["forward", 1740]]}
HOLDER = "lv-holder"
COMMANDS: dict[str, dict[str, Any]] = {
    "info": {"op": "info"},
    "set_power_limit": {"op": "set_power_limit", "power_limit_w": 250, "holder": HOLDER,
                        "lease_s": 1.0},
    "reset_power_limit": {"op": "reset_power_limit"},
    "lock_clocks": {"op": "lock_clocks", "min_mhz": 210, "max_mhz": 1740, "holder": HOLDER,
                    "lease_s": 1.0},
    "reset_clocks": {"op": "reset_clocks"},
    "install_schedule": {"op": "install_schedule", "job_id": "lv-job", "schedule": SCHEDULE,
                         "version": 1, "from_step": 0, "holder": HOLDER, "lease_s": 1.0},
    "clear_schedule": {"op": "clear_schedule"},
    "bind": {"op": "bind", "job_id": "lv-job", "rank": 0, "join_digest": "0" * 64},
    "unbind": {"op": "unbind"},
    "energy": {"op": "energy", "t0_ns": "$NOW-1s", "t1_ns": "$NOW"},
    "renew": {"op": "renew", "holder": HOLDER, "lease_s": 1.0},
}  # fmt: skip

EVENTS = {
    "v": 1, "job_id": "$JOB", "rank": 0, "node": "$NODE", "gpu": 0,
    "events": [{"kind": "step_begin", "t_ns": "$NOW", "epoch": 0, "step": 1, "index": 0,
                "name": "", "power_limit_w": 300}],
    "join_digest": "$DIGEST",
}  # fmt: skip
MEASUREMENTS = {
    "v": 1, "node": "$NODE", "job_id": "$JOB", "gpus": [{
        "gpu": 0, "rank": 0,
        "marks": [{"kind": "step_begin", "epoch": 0, "step": 1, "t_ns": "$NOW", "energy_j": 5.0,
                   "power_limit_w": 300}],
        "measurements": [{"kind": "step", "name": "step", "epoch": 0, "step": 1, "index": 0,
                          "t0_ns": "$NOW-1s", "t1_ns": "$NOW", "time_s": 1.0, "energy_j": 5.0,
                          "schedule": 1}],
        "join_digest": "$DIGEST"}],
}  # fmt: skip
GPU_ERROR = {
    "v": 1, "source": "agent:lv", "code": "lease_expired", "message": "lease lapsed",
    "job_id": "$JOB", "rank": 0, "detail": {"restored": ["power_limit"], "note": "lv"},
}  # fmt: skip
HELLO = {
    "v": 1, "node": "$NODE", "agent_id": "$AGENT_ID", "backend": "sim", "heartbeat_s": 0.5,
    "socket_path": "/tmp/lv.sock", "gpus": ["$GPU0"],
}  # fmt: skip
RENEWAL = {"v": 1, "holder": HOLDER, "lease_s": 1.0}


@dataclass(frozen=True)
class Target:
    """A subject and a valid message of its kind."""

    name: str
    subject: Callable[[dict[str, Any]], str]
    base: Any
    model: Any = None


REQUESTS: tuple[Target, ...] = (
    Target("jobs.register", lambda e: subjects.coord_register_job("lv-node"), REGISTER_JOB,
           RegisterJob),
    Target("ranks.register", lambda e: subjects.coord_register_rank(e["$NODE"]), REGISTER_RANK,
           RegisterRank),
    Target("jobs.query", lambda e: subjects.coord_job_query(), JOB_QUERY, JobQuery),
    Target("jobs.straggler", lambda e: subjects.coord_job_straggler(), STRAGGLER,
           StragglerNotice),
    Target("replica query", lambda e: subjects.coord_replica(e["$REPLICA"], "query"), JOB_QUERY,
           JobQuery),
    Target("replica straggler", lambda e: subjects.coord_replica(e["$REPLICA"], "straggler"),
           STRAGGLER, StragglerNotice),
    *(
        Target(f"gpu cmd {op}", lambda e: subjects.gpu_command(e["$NODE"], 0),
               {"v": 1, "cmd": cmd}, CommandEnvelope)
        for op, cmd in COMMANDS.items()
    ),
)  # fmt: skip

COORD_STREAMS: tuple[Target, ...] = (
    Target("job events", lambda e: subjects.job_events(e["$JOB"], 0, e["$NODE"]), EVENTS,
           TrainerEventBatch),
    Target("node measurements", lambda e: subjects.job_measurements(e["$JOB"], e["$NODE"]),
           MEASUREMENTS, NodeMeasurementBatch),
    Target("gpu errors", lambda e: subjects.gpu_errors(e["$NODE"], 0), GPU_ERROR, ErrorEvent),
    Target("agent hello", lambda e: subjects.agent_hello(e["$NODE"]), HELLO, AgentHello),
)  # fmt: skip


# ---------------------------------------------------------------------------- sending
def _decodes(data: bytes, model: Any) -> bool:
    try:
        codec.decode(data, model)
    except PayloadError:
        return False
    return True


def request_problems(bus: Bus, subject: str, data: bytes, model: Any, what: str) -> list[str]:
    """Send one request; what is wrong with its answer (nothing: [])."""
    try:
        msg = bus.request(subject, data)
    except Exception as e:  # noqa: BLE001 - no answer is the finding
        return [f"{what}: no answer on {subject[:80]} ({type(e).__name__}: {str(e)[:100]})"]
    try:
        reply = codec.decode(msg.data, Reply)
    except PayloadError as e:
        return [f"{what}: the answer is not a Reply: {e}"]
    outcome = OK if reply.ok else reply.code
    expected = set(STABLE_CODES) | {OK} if _decodes(data, model) else {"bad_request"}
    if outcome not in expected:
        return [f"{what}: answered {outcome!r} ({reply.error[:200]!r}), expected one of "
                f"{sorted(expected)}"]  # fmt: skip
    if len(reply.error) > ECHO_CHARS:
        return [f"{what}: the error echoes {len(reply.error)} characters "
                f"({reply.error[:120]!r}...): what a peer sent must be shown cut"]
    return []


ECHO_CHARS = 1_500
"""Longest error text a reply may carry here: a message names a few of the peer's values, each
cut by `shown()` (`SHOWN_CHARS`), never a whole one."""

def coord_stream_problems(bus: Bus, subject: str, data: bytes, model: Any, what: str,
                          unfollowed: str | None = None) -> list[str]:
    """Publish one stream message to the coordinator; a malformed one must be counted.

    `unfollowed`: the subject names no job the coordinator drives, so it does not follow it:
    the message reaches nobody (nothing counted), and the barrier goes to `unfollowed`.
    """
    reason = "malformed"
    malformed = not unfollowed and not _decodes(data, model)
    before, after = publish_with_barrier(bus, subject, data, reason, int(malformed), 3,
                                         0.001, unfollowed)  # what moved tells the rest
    moved = after.get(reason, 0) - before.get(reason, 0) - 1
    if moved != malformed:
        return [f"{what}: {reason!r} moved by {moved} (malformed: {malformed}; all drops "
                f"{ {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k)} })"]
    return []


def _agent_drops(bus: Bus) -> int:
    return bus.agent.counters["bad_lease_renewal"]


def hold_a_lease(bus: Bus) -> None:
    """GPU 0's power limit held by HOLDER for 30 s (a fuzzed renewal may have shortened it)."""
    cmd = msgpack.packb({"v": 1, "cmd": COMMANDS["set_power_limit"] | {"lease_s": 30.0}})
    reply = bus.ask(subjects.gpu_command(bus.node, 0), cmd)
    assert reply.ok, reply


def renewal_problems(bus: Bus, subject: str, data: bytes, what: str,
                     followed: bool = True) -> list[str]:
    """Publish a lease renewal to the agent; a malformed one must be counted.

    On a subject no holder of a lease on the node has (`followed` False), nothing reaches the
    agent: nothing may move.
    """
    malformed = followed and not _decodes(data, LeaseRenewal)
    before = bus.call(_agent_drops, bus)
    bus.publish(subject, data)
    if not malformed:
        bus.info(0)  # Handled by then (the agent answers a later request).
        moved = bus.call(_agent_drops, bus) - before
    else:
        moves: list[int] = []

        def counted() -> bool:
            moves[:] = [bus.call(_agent_drops, bus) - before]
            return moves[0] >= 1

        wait_for(counted, 3, interval_s=0.001, fail=False)  # what moved tells the rest
        moved = moves[0]
    if moved != malformed:
        return [f"{what}: bad_lease_renewal moved by {moved} (malformed: {malformed})"]
    return []


def health_problems(bus: Bus, mark: tuple[int, int, int], what: str) -> list[str]:
    try:
        bus.check_healthy(mark, what)
    except AssertionError as e:
        return [f"{what}: {str(e)[:1500]}"]
    return []


def run_fields(
    bus: Bus,
    meter: LogMeter,
    outcome: Outcome,
    name: str,
    base: Any,
    send: Callable[[bytes, str], list[str]],
    limit: int,
    extras: bool = True,
) -> None:
    """Every mutation of `base`, sent with `send`; health checked after each field."""
    for where, cases in mutations(base, limit, extras):
        mark = bus.mark()
        for case in cases:
            what = f"{name}: {case.what}"
            log_mark = meter.mark()
            outcome.problems += send(case.data, what)
            outcome.problems += meter.problems(log_mark, what)
            outcome.cases += 1
        outcome.fields += 1
        outcome.problems += health_problems(bus, mark, f"{name}: {where}")
        if len(outcome.problems) >= MAX_PROBLEMS:
            return


# ---------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("target", REQUESTS, ids=[t.name for t in REQUESTS])
def test_requests_with_long_and_nested_values_get_coded_replies(
    bus: Bus, env: dict[str, Any], meter: LogMeter, target: Target
):
    values = bus.env()
    base = resolve(target.base, values)
    subject = target.subject(values)
    limit = bus.nc.max_payload
    outcome = Outcome()

    def send(data: bytes, what: str) -> list[str]:
        return request_problems(bus, subject, data, target.model, what)

    run_fields(bus, meter, outcome, target.name, base, send, limit)
    print(f"{target.name}: {outcome.cases} cases over {outcome.fields} fields")
    outcome.check()


@pytest.mark.parametrize("target", COORD_STREAMS, ids=[t.name for t in COORD_STREAMS])
def test_coordinator_streams_drop_and_count_long_and_nested_values(
    bus: Bus, env: dict[str, Any], meter: LogMeter, target: Target
):
    values = bus.env()
    base = resolve(target.base, values)
    subject = target.subject(values)
    outcome = Outcome()

    def send(data: bytes, what: str) -> list[str]:
        return coord_stream_problems(bus, subject, data, target.model, what)

    run_fields(bus, meter, outcome, target.name, base, send, bus.nc.max_payload)
    print(f"{target.name}: {outcome.cases} cases over {outcome.fields} fields")
    outcome.check()


def test_agent_streams_drop_and_count_long_and_nested_values(
    bus: Bus, env: dict[str, Any], meter: LogMeter
):
    """Lease renewals (counted when malformed) and pings (any payload) of the agent."""
    outcome = Outcome()
    renewals = subjects.lease_renewal(HOLDER)

    def renew(data: bytes, what: str) -> list[str]:
        hold_a_lease(bus)  # (The agent hears the renewals of its leases' holders only.)
        return renewal_problems(bus, renewals, data, what)

    def ping(data: bytes, what: str) -> list[str]:
        bus.publish(subjects.agent_ping(), data)
        bus.info(0)
        return []

    limit = bus.nc.max_payload
    run_fields(bus, meter, outcome, "lease renewal", dict(RENEWAL), renew, limit)
    run_fields(bus, meter, outcome, "agent ping", {"v": 1}, ping, limit)
    print(f"agent streams: {outcome.cases} cases over {outcome.fields} fields")
    outcome.check()


# -- subject tokens a credential chooses
ODD_TOKENS = ("t" * 3_000, "é" * 1_000, "²", "¹²³", "٣", "~", "x~0123456789abcdef", "9" * 3_000)
"""Tokens within nats-server's 4 KiB control line: long, multi-byte, digits `int()` refuses
("²": `str.isdigit` says yes) or reads (Arabic-Indic), the "~" of shortened tokens."""


def test_odd_subject_tokens_are_answered_or_dropped(
    bus: Bus, env: dict[str, Any], meter: LogMeter
):
    """A valid message on subjects whose wildcard tokens (node, GPU, job, rank, holder) are
    long or odd: a request is answered with a code, a stream message is handled or dropped."""
    values = bus.env()
    node = values["$NODE"]
    outcome = Outcome()
    for tok in ODD_TOKENS:
        mark = bus.mark()
        requests = (
            ("jobs.register", f"zeus.coord.jobs.register.{tok}", REGISTER_JOB, RegisterJob),
            ("ranks.register", f"zeus.coord.ranks.register.{tok}", REGISTER_RANK, RegisterRank),
        )
        for name, subject, base, model in requests:
            what = f"{name} via token {tok[:12]!r}*{len(tok)}"
            log_mark = meter.mark()
            data = codec.encode(resolve(base, values))
            outcome.problems += request_problems(bus, subject, data, model, what)
            outcome.problems += meter.problems(log_mark, what)
            outcome.cases += 1
        job_token = subjects.token(values["$JOB"])
        streams = (
            ("job events (job)", f"zeus.job.{tok}.ev.0.{node}", EVENTS, TrainerEventBatch),
            ("job events (rank)", f"zeus.job.{job_token}.ev.{tok}.{node}", EVENTS,
             TrainerEventBatch),
            ("job events (node)", f"zeus.job.{job_token}.ev.0.{tok}", EVENTS, TrainerEventBatch),
            ("measurements (job)", f"zeus.job.{tok}.meas.{node}", MEASUREMENTS,
             NodeMeasurementBatch),
            ("measurements (node)", f"zeus.job.{job_token}.meas.{tok}", MEASUREMENTS,
             NodeMeasurementBatch),
            ("gpu errors (node)", f"zeus.gpu.{tok}.0.error", GPU_ERROR, ErrorEvent),
            ("gpu errors (gpu)", f"zeus.gpu.{node}.{tok}.error", GPU_ERROR, ErrorEvent),
            ("agent hello", f"zeus.agent.{tok}.hello", HELLO, AgentHello),
        )  # fmt: skip
        for name, subject, base, model in streams:
            what = f"{name} on token {tok[:12]!r}*{len(tok)}"
            log_mark = meter.mark()
            data = codec.encode(resolve(base, values))
            unfollowed = (f"zeus.gpu.{node}.0.error"
                          if name in ("job events (job)", "measurements (job)") else None)
            outcome.problems += coord_stream_problems(bus, subject, data, model, what,
                                                      unfollowed)
            outcome.problems += meter.problems(log_mark, what)
            outcome.cases += 1
        for data, what in ((codec.encode(RENEWAL), "valid"), (b"\xc1", "malformed")):
            what = f"{what} lease renewal on token {tok[:12]!r}*{len(tok)}"
            log_mark = meter.mark()
            # (No holder has these raw tokens: `subjects.token` shortens and escapes them.)
            outcome.problems += renewal_problems(bus, f"zeus.lease.{tok}", data, what,
                                                 followed=False)
            outcome.problems += meter.problems(log_mark, what)
            outcome.cases += 1
        outcome.problems += health_problems(bus, mark, f"subject token {tok[:12]!r}*{len(tok)}")
    print(f"subject tokens: {outcome.cases} cases")
    outcome.check()


# ---------------------------------------------------------------------------- trainer socket
READ_BYTES = 1 << 17


class Trainer:
    """A raw trainer socket (autobound, so the agent can answer it)."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        self.sock.bind("")
        self.sock.connect(path)

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        def sent() -> bool:
            try:
                self.sock.send(data, socket.MSG_DONTWAIT)
                return True
            except (BlockingIOError, TimeoutError):
                return False

        wait_for(sent, 3, lambda: "the agent stopped reading its socket", interval_s=0.001)

    def drain(self) -> None:
        while True:
            try:
                self.sock.recv(READ_BYTES, socket.MSG_DONTWAIT)
            except (BlockingIOError, TimeoutError):
                return

    def reply(self, request_id: int, timeout_s: float = 3.0) -> Reply | str:
        """The agent's reply to `request_id`, or what is wrong."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(READ_BYTES)
            except TimeoutError:
                continue
            finally:
                self.sock.settimeout(None)
            if len(data) > dg.MAX_DATAGRAM_BYTES:
                return f"a {len(data)}-byte reply (a trainer reads {dg.MAX_DATAGRAM_BYTES})"
            try:
                got = dg.decode_datagram(data)
            except PayloadError as e:
                return f"an unreadable reply: {e}"
            if isinstance(got, dg.ReplyDatagram) and got.request_id == request_id:
                return got.reply
        return f"no reply to request {request_id} within {timeout_s} s"


def _gateway(bus: Bus) -> dict[str, int]:
    assert bus.agent.gateway is not None
    return dict(bus.agent.gateway.counters)


def _expected_datagram(decoded: Any) -> set[str] | None:
    """Outcomes a request datagram may get (None: not a request, nothing is answered)."""
    if not isinstance(decoded, dg.RequestDatagram):
        return None
    models: dict[dg.Kind, Any] = {
        K.HELLO: dg.TrainerHello, K.REGISTER_JOB: RegisterJob, K.WINDOW: dg.WindowRequest,
        K.QUERY_JOB: JobQuery,
    }  # fmt: skip
    payload = decoded.payload
    model = models.get(decoded.kind)
    if decoded.kind is K.REGISTER_RANK:
        payload, model = {k: v for k, v in payload.items() if k != "pid"}, RegisterRank
    if model is not None:
        try:
            codec.validate(model, payload)
        except PayloadError:
            return {"bad_request"}
    return set(STABLE_CODES) | {OK}


def datagram_problems(bus: Bus, trainer: Trainer, data: bytes, what: str) -> list[str]:
    """Send one datagram: counted; a request answered with a code; never an internal error."""
    try:
        decoded: Any = dg.decode_datagram(data)
    except PayloadError as e:
        decoded = e
    except Exception as e:  # noqa: BLE001 - the decoder itself failing is a finding
        decoded = e
    problems = []
    if not isinstance(decoded, PayloadError | dg.EventDatagram | dg.RequestDatagram
                      | dg.ReplyDatagram | dg.ScheduleNotice):  # fmt: skip
        problems.append(f"{what}: decode_datagram raised {type(decoded).__name__}: "
                        f"{str(decoded)[:100]}")  # fmt: skip
    oversized = len(data) > dg.MAX_DATAGRAM_BYTES
    before = bus.call(_gateway, bus)
    trainer.drain()
    trainer.send(data)
    expected = None if oversized else _expected_datagram(decoded)
    if expected is not None:
        reply = trainer.reply(decoded.request_id)
        if isinstance(reply, str):
            problems.append(f"{what}: {reply}")
        elif (OK if reply.ok else reply.code) not in expected:
            problems.append(f"{what}: answered {reply.code or OK!r} ({reply.error[:200]!r}), "
                            f"expected one of {sorted(expected)}")  # fmt: skip
    reads: list[dict[str, int]] = []

    def counted() -> bool:
        reads[:] = [bus.call(_gateway, bus)]
        return reads[0].get("datagrams", 0) > before.get("datagrams", 0)

    if not wait_for(counted, 3, interval_s=0.001, fail=False):
        problems.append(f"{what}: the gateway never counted it")
    after = reads[0]
    if after.get("internal_error", 0) != before.get("internal_error", 0):
        problems.append(f"{what}: the gateway's internal_error moved")
    if isinstance(decoded, Exception) and after.get("malformed", 0) == before.get("malformed", 0):
        problems.append(f"{what}: dropped but not counted malformed")
    return problems


TRAINER_JOB = "lv-trainer-job"
DATAGRAM_REQUESTS: dict[dg.Kind, dict[str, Any]] = {
    K.HELLO: {"job_id": TRAINER_JOB, "rank": 0, "gpu_index": 0, "dp_rank": 0, "pp_rank": 0,
              "tp_rank": 0, "join_token": "A" * 16},
    K.REGISTER_JOB: {k: v for k, v in REGISTER_JOB.items() if k != "uid"},
    K.REGISTER_RANK: {k: v for k, v in REGISTER_RANK.items() if k not in ("uid", "gpu_info")},
    K.WINDOW: {"t0_ns": "$NOW-1s", "t1_ns": "$NOW", "gpus": [0]},
    K.QUERY_JOB: dict(JOB_QUERY),
    K.BYE: {},
}  # fmt: skip


def test_trainer_datagrams_with_long_and_nested_values(
    bus: Bus, env: dict[str, Any], meter: LogMeter
):
    """Every field of every request datagram's payload, every item of the frames of a request
    and an event: counted, answered with a code, logged briefly."""
    trainer = Trainer(bus.agent.settings.socket_path)
    outcome = Outcome()
    values = bus.env()
    limit = dg.MAX_DATAGRAM_BYTES
    try:

        def send(data: bytes, what: str) -> list[str]:
            return datagram_problems(bus, trainer, data, what)

        for kind, payload in DATAGRAM_REQUESTS.items():
            frame = [1, int(kind), os.getpid(), 7, resolve(payload, values)]
            # The frame's items (version, kind, pid, request id) only once (for HELLO).
            base: Any = frame if kind is K.HELLO else frame[4]

            def send_payload(data: bytes, what: str, _kind: dg.Kind = kind) -> list[str]:
                # `data` is the payload alone: frame it (it keeps the marker's room).
                head = msgpack.packb([1, int(_kind), os.getpid(), 7], use_bin_type=True)
                return send(b"\x95" + head[1:] + data, what)

            sender = send if base is frame else send_payload
            run_fields(bus, meter, outcome, f"{kind.name}", base, sender, limit - 16)
        event = resolve([1, int(K.INSTRUCTION_BEGIN), os.getpid(), "$NOW", 1, 0, "forward"],
                        values)  # fmt: skip
        run_fields(bus, meter, outcome, "event", event, send, limit, extras=False)
        bye = trainer.sock.send(dg.encode_request(K.BYE, os.getpid(), 99, {}))
        assert bye
    finally:
        trainer.close()
    print(f"trainer datagrams: {outcome.cases} cases over {outcome.fields} fields")
    outcome.check()


# ---------------------------------------------------------------------------- regressions
@pytest.mark.parametrize("position", range(7))
def test_a_datagram_item_nested_near_the_recursion_limit_is_a_payload_error(position: int):
    """`decode_datagram` echoed a bad item with `!r`: an item nested ~1,000 deep (which the
    msgpack unpacker accepts) made that `repr` raise RecursionError, so the gateway counted an
    internal error and logged a traceback, and a 60 KB item was echoed in full into the error
    (and the WARNING line)."""
    for item in (b"\x91" * 1_000 + b"\xc0", msgpack.packb("z" * 60_000)):
        parts = [msgpack.packb(v) for v in [1, 3, 1, 1, 0, 0, ""]]
        parts[position] = item
        with pytest.raises(PayloadError) as raised:
            dg.decode_datagram(b"\x97" + b"".join(parts))
        assert len(str(raised.value)) < 400, str(raised.value)[:200]


def test_a_command_whose_op_is_nested_near_the_recursion_limit_is_refused_quietly(
    monkeypatch: pytest.MonkeyPatch,
):
    """pydantic reports a discriminator it cannot read by printing its `repr`: a command whose
    `op` was a list nested ~1,000 deep made that `repr` fail, an "unraisable" RecursionError
    (printed to stderr) per command. Payloads nested deeper than `codec.MAX_DEPTH` are refused
    before validation."""
    import sys

    unraisable: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(repr(u.exc_value)))
    for depth in (40, 960, 1_020):
        data = b"\x82\xa1v\x01\xa3cmd\x81\xa2op" + b"\x91" * depth + b"\xc0"
        with pytest.raises(PayloadError, match="levels deep"):
            codec.decode(data, CommandEnvelope)
    assert not unraisable, unraisable
    nested = {"v": 1, "cmd": {"op": "info"}}
    assert codec.decode(codec.encode(nested), CommandEnvelope).cmd.op == "info"
    deep_enough = {"v": 1, "source": "s", "code": "c", "message": "m", "detail": {"k": 1}}
    node: dict[str, Any] = deep_enough["detail"]
    for _ in range(codec.MAX_DEPTH - 2):  # the message and detail are 2 levels: 32 in all
        node["k"] = node = {}
    assert codec.decode(codec.encode(deep_enough), ErrorEvent)
    node["k"] = {}
    with pytest.raises(PayloadError, match="levels deep"):
        codec.decode(codec.encode(deep_enough), ErrorEvent)


def test_a_gpu_error_on_a_gpu_token_of_non_ascii_digits_is_dropped(
    bus: Bus, env: dict[str, Any]
):
    """`<p>.gpu.<node>.².error` (an agent may publish any GPU token of its own node): the
    coordinator read the token with `int()` because `"²".isdigit()`, and the ValueError left its
    subscription callback ("NATS error on zeus-coordinator")."""
    values = bus.env()
    data = codec.encode(resolve(GPU_ERROR, values))
    for gpu in ("²", "¹²³", "٣"):
        mark = bus.mark()
        subject = f"zeus.gpu.{values['$NODE']}.{gpu}.error"
        before = drops(bus)
        assert coord_stream_problems(bus, subject, data, ErrorEvent, gpu) == []
        after = drops(bus)
        assert after.get("wrong_node", 0) == before.get("wrong_node", 0) + 1, (gpu, after)
        bus.check_healthy(mark, f"a GPU error on {subject}")


async def test_bad_lease_renewals_log_one_short_line_then_every_1000th(tmp_path: Any):
    """The agent logged every bad renewal, with its whole subject (a 3,000-character holder
    token: a 3 KB WARNING line per message)."""
    from types import SimpleNamespace

    from zeus_agent.agent.server import AgentServer
    from zeus_agent.config import AgentSettings

    server = AgentServer(AgentSettings(backend="sim", node="lv", socket_path=str(tmp_path / "s")))
    subject = "zeus.lease." + "t" * 3_000
    meter = LogMeter()
    logger = logging.getLogger("zeus_agent")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(meter)
    try:
        for _ in range(2_000):
            await server._on_lease_renewal(SimpleNamespace(subject=subject, data=b"\xc1"))
    finally:
        logger.removeHandler(meter)
        logger.setLevel(level)
    lines = [(size, head) for size, head in meter.records if "bad lease renewal" in head]
    assert server.counters["bad_lease_renewal"] == 2_000
    assert len(lines) == 3, lines  # the 1st, the 1000th, the 2000th
    assert max(size for size, _ in lines) < 600, lines
