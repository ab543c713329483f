"""Fuzz kit: hypothesis against live services, and the malformed-payload strategies.

Per test module (the `bus` fixture of conftest.py): one real nats-server (`nats_server` of
tests/conftest.py), one agent on two simulated A40s (`tests.shell.agent_kit.running_agent`,
100-300 W) and one coordinator (`tests.shell.coordinator_kit.start`). They run on an asyncio
loop in a background thread (`LoopThread`), so hypothesis drives plain synchronous tests: each
example submits coroutines to that loop with `bus.run(...)`, and the services keep running
between examples (sampling, lease expiry, heartbeats, the coordinator's timers) as they do in
production. State checks (`bus.call(fn)`) run as one step of the loop, so they see the services
between two of their own steps, never half way through one.

What every example is held to (`Bus.check_healthy`):
* no internal error: nothing logged with a traceback, at ERROR or above, or as a NATS callback
  failure ("NATS error on zeus-...") by the agent or the coordinator;
* both services still answer a control request (`info` on every GPU, `jobs.query`) and are
  still connected;
* the GPUs are safe: every call that changed a power limit or locked clocks was inside the
  GPU's range and under a live lease (`audit_gpus` wraps the simulated devices), and the
  devices' state files (`SimGPU.open`) hold a limit and clocks in range, each non-default one
  covered by a lease that is neither longer than `MAX_LEASE_S` nor overdue;
* the agent's state is consistent: a GPU bound to a trainer process is tracked by the gateway
  (so it is restored when the process dies), an installed schedule holds a lease;
* the coordinator's registry is consistent (ranks fit their job's degrees, the GPU index
  matches the ranks, optimised jobs are registered ones);
* nothing answered a message published on a stream subject.

`ZEUS_FUZZ_SCALE` (default 1) multiplies every test's number of examples for longer runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import itertools
import logging
import math
import os
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from coordinator.service import CoordinatorService
from zeus_agent.agent.server import AgentServer
from zeus_agent.errors import PayloadError
from zeus_agent.gpu.sim import SimGPU
from zeus_agent.gpu.sim.presets import PRESETS
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import MAX_LEASE_S, CommandEnvelope, InfoCmd, JobQuery, Reply
from zeus_demo.cluster import wait_for

# ---------------------------------------------------------------------------- settings
SCALE = float(os.environ.get("ZEUS_FUZZ_SCALE", "1"))


def fuzz(max_examples: int) -> settings:
    """Hypothesis settings of a fuzz test: bounded examples, no deadline (live services)."""
    return settings(
        max_examples=max(1, round(max_examples * SCALE)),
        deadline=None,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
        ],
    )


A40 = PRESETS["A40"]
CLOCKS = tuple(A40.supported_sm_clocks_mhz)
STABLE_CODES = frozenset({
    "bad_request", "out_of_range", "not_supported", "permission", "forbidden", "quota", "too_large",
    "unavailable", "unknown_job", "unknown_rank", "duplicate", "conflict", "trainer_left",
    "timeout",
})  # fmt: skip
"""Codes a refusal may carry (`Reply`'s docstring), "internal" excluded on purpose."""
OK = "ok"
"""Stands for a successful reply in a set of expected outcomes."""
REPLY_TIMEOUT_S = 3.0


# ---------------------------------------------------------------------------- the loop
class LoopThread:
    """An asyncio loop running forever in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float = 30.0) -> Any:
        """Run `coro` on the loop and return its result (raising its exception)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:  # Also the coroutine's own TimeoutError.
            if future.done():
                raise
            future.cancel()
            raise TimeoutError(f"{coro!r} did not finish within {timeout_s} s") from None

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run the plain function `fn(*args)` on the loop, as one step of it."""

        async def step() -> Any:
            return fn(*args)

        return self.run(step())

    def close(self) -> None:
        """Stop the loop and its thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class LogTrap(logging.Handler):
    """Collects what the services log that means an internal failure."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:  # noqa: D102
        if not record.name.startswith(("zeus_agent", "coordinator", "nats")):
            return
        message = record.getMessage()
        nats_callback = message.startswith("NATS error on zeus-")
        if record.exc_info or record.levelno >= logging.ERROR or nats_callback:
            detail = ""
            if record.exc_info and record.exc_info[1] is not None:
                exc = record.exc_info[1]
                detail = f" [{type(exc).__name__}: {str(exc)[:300]}]"
            self.records.append(f"{record.name} {record.levelname}: {message[:500]}{detail}")


# ---------------------------------------------------------------------------- GPU audit
def audit_gpus(server: AgentServer, violations: list[str]) -> None:
    """Wrap each simulated GPU's setters to record any call out of range or without a lease.

    The wrappers run inside the agent, at the moment a setting is applied (the agent grants the
    lease before it applies the setting), so "never applied" is checked, not just the state
    afterwards. They still call the device, so the device's own checks are unchanged.
    """
    for agent in server.agents.values():
        gpu, info = agent.gpu, agent.info
        assert info is not None
        clocks = set(info.supported_graphics_clocks_mhz)

        def set_power_limit_w(watts: Any, _agent=agent, _info=info, _orig=gpu.set_power_limit_w):
            if not (
                type(watts) is int and _info.min_power_limit_w <= watts <= _info.max_power_limit_w
            ):
                violations.append(
                    f"GPU {_agent.index}: set_power_limit_w({watts!r}) outside "
                    f"[{_info.min_power_limit_w}, {_info.max_power_limit_w}] W was called"
                )
            lease = _agent.leases.get("power_limit")
            if watts != _info.default_power_limit_w and not _live(lease):
                violations.append(
                    f"GPU {_agent.index}: set_power_limit_w({watts!r}) applied without a live "
                    f"power_limit lease (lease: {lease})"
                )
            return _orig(watts)

        def lock_sm_clocks_mhz(
            lo: Any, hi: Any, _agent=agent, _clocks=clocks, _orig=gpu.lock_sm_clocks_mhz
        ):
            if lo not in _clocks or hi not in _clocks or not lo <= hi:
                violations.append(
                    f"GPU {_agent.index}: lock_sm_clocks_mhz({lo!r}, {hi!r}) with an unsupported "
                    "clock or min > max was called"
                )
            leases = [_agent.leases.get("sm_clocks"), _agent.leases.get("schedule")]
            if not any(_live(lease) for lease in leases):
                violations.append(
                    f"GPU {_agent.index}: lock_sm_clocks_mhz({lo!r}, {hi!r}) applied without a "
                    f"live sm_clocks or schedule lease (leases: {leases})"
                )
            return _orig(lo, hi)

        gpu.set_power_limit_w = set_power_limit_w  # type: ignore[method-assign]
        gpu.lock_sm_clocks_mhz = lock_sm_clocks_mhz  # type: ignore[method-assign]


def _live(lease: Any) -> bool:
    return lease is not None and lease.deadline_ns > time.monotonic_ns()


def gpu_state_problems(server: AgentServer) -> list[str]:
    """The simulated devices' state against the agent's leases (run on the loop: atomic)."""
    problems: list[str] = []
    now = time.monotonic_ns()
    for agent in server.agents.values():
        info = agent.info
        assert info is not None
        device = SimGPU.open(server.settings.sim_state_dir, agent.index)
        limit = device.get_power_limit_w()
        locked = device.get_locked_sm_clocks_mhz()
        held = {lease.kind: lease for lease in agent.leases.held()}
        where = f"GPU {agent.index}"
        if not info.min_power_limit_w <= limit <= info.max_power_limit_w:
            problems.append(f"{where}: power limit {limit} W is outside its range")
        if limit != info.default_power_limit_w and "power_limit" not in held:
            problems.append(f"{where}: power limit {limit} W (not the default) without a lease")
        if locked is not None:
            lo, hi = locked
            clocks = set(info.supported_graphics_clocks_mhz)
            if lo > hi or lo not in clocks or hi not in clocks:
                problems.append(f"{where}: SM clocks locked to {locked}, not a supported range")
            if not held.keys() & {"sm_clocks", "schedule"}:
                problems.append(f"{where}: SM clocks locked to {locked} without a lease")
        for lease in held.values():
            if not lease.holder:
                problems.append(f"{where}: lease {lease} has no holder")
            if lease.deadline_ns > now + int((MAX_LEASE_S + 1) * 1e9):
                problems.append(f"{where}: lease {lease} runs beyond {MAX_LEASE_S:g} s from now")
            if lease.deadline_ns < now - 2_000_000_000:
                problems.append(
                    f"{where}: lease {lease} lapsed {(now - lease.deadline_ns) / 1e9:.1f} s ago "
                    "and its setting was not restored"
                )
    return problems


def agent_state_problems(server: AgentServer) -> list[str]:
    """The agent's bindings and schedules against its gateway and leases (run on the loop)."""
    problems: list[str] = []
    gateway = server.gateway
    for agent in server.agents.values():
        binding = agent.binding
        tracked = (
            gateway is not None
            and binding is not None
            and binding.pid is not None
            and (agent in gateway.by_pid.get(binding.pid, []))
        )
        if binding is not None and binding.pid is not None and not tracked:
            problems.append(
                f"GPU {agent.index} is bound to pid {binding.pid}, which the gateway does "
                "not track (its GPU would not be restored when it dies)"
            )
        if agent.cursor.installed and agent.leases.get("schedule") is None:
            problems.append(f"GPU {agent.index} has a schedule installed without a lease")
    return problems


def registry_problems(coord: CoordinatorService) -> list[str]:
    """The coordinator's registry invariants (run on the loop: atomic)."""
    problems: list[str] = []
    for job_id, record in coord.registry.jobs.items():
        job = record.job
        if record.job_id != job_id:
            problems.append(f"job {job_id!r} is filed under another id {record.job_id!r}")
        if job.world_size != job.dp_degree * job.pp_degree * job.tp_degree:
            problems.append(f"job {job_id!r}: world size does not match its degrees")
        if len(record.ranks) > job.world_size:
            problems.append(f"job {job_id!r}: {len(record.ranks)} ranks > {job.world_size}")
        for rank, rr in record.ranks.items():
            info = rr.info
            if info.rank != rank:
                problems.append(f"job {job_id!r}: rank {rank} filed with info of {info.rank}")
            for name, value, limit in (
                ("rank", info.rank, job.world_size),
                ("dp_rank", info.dp_rank, job.dp_degree),
                ("pp_rank", info.pp_rank, job.pp_degree),
                ("tp_rank", info.tp_rank, job.tp_degree),
            ):
                if not 0 <= value < limit:
                    problems.append(f"job {job_id!r}: {name} {value} does not fit (< {limit})")
        index = {(rr.gpu.node, rr.gpu.gpu_index): rank for rank, rr in record.ranks.items()}
        if record.gpu_ranks != index:
            problems.append(
                f"job {job_id!r}: GPU index {record.gpu_ranks} does not match its ranks {index}"
            )
    orphans = set(coord.optimisers) - set(coord.registry.jobs)
    if orphans:
        problems.append(f"optimised jobs that are not registered: {sorted(orphans)}")
    return problems


# ---------------------------------------------------------------------------- the bus
@dataclass
class Bus:
    """The module's live services and the test's own NATS client."""

    loop: LoopThread
    agent: AgentServer
    coord: CoordinatorService
    nc: Any
    trap: LogTrap
    violations: list[str]
    stray: list[str]
    state_dir: Path
    env_extra: dict[str, Any] = field(default_factory=dict)
    _stray_ids: Iterator[int] = field(default_factory=itertools.count)

    # -- plumbing
    @property
    def node(self) -> str:
        """The agent's node name."""
        return self.agent.settings.node

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float = 30.0) -> Any:
        """Run a coroutine on the services' loop."""
        return self.loop.run(coro, timeout_s)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a plain function on the services' loop, atomically."""
        return self.loop.call(fn, *args)

    def env(self) -> dict[str, Any]:
        """Values of the placeholders of `Case` payloads, now."""
        now = time.monotonic_ns()
        values: dict[str, Any] = {
            "$NODE": self.node,
            "$NOW": now,
            "$NOW-100ms": now - 100_000_000,
            "$NOW+100ms": now + 100_000_000,
            "$NOW-1s": now - 1_000_000_000,
            "$NOW+10s": now + 10_000_000_000,
            "$NOW-1h": now - 3_600_000_000_000,
        }
        for index, agent in self.agent.agents.items():
            assert agent.info is not None
            values[f"$UUID{index}"] = agent.info.uuid
        values.update(self.env_extra)
        return values

    # -- requests and publications
    def request(self, subject: str, data: bytes, timeout_s: float = REPLY_TIMEOUT_S) -> Any:
        """One request; returns the reply message (raises on timeout / no responders)."""
        return self.run(self.nc.request(subject, data, timeout=timeout_s), timeout_s + 5)

    def ask(self, subject: str, data: bytes) -> Reply:
        """One request whose reply must be a `Reply`."""
        msg = self.request(subject, data)
        try:
            return codec.decode(msg.data, Reply)
        except PayloadError as e:
            raise AssertionError(f"the reply on {subject} is not a Reply: {e}") from None

    def publish(self, subject: str, data: bytes) -> None:
        """Publish on a stream subject with a reply inbox nobody else knows (see `stray`)."""
        reply = f"_INBOX.fuzzstray.{next(self._stray_ids)}"

        async def go() -> None:
            await self.nc.publish(subject, data, reply=reply)
            await self.nc.flush()

        self.run(go())

    def info(self, gpu: int) -> dict[str, Any]:
        """The agent's `info` for a GPU (asserting it answers ok)."""
        reply = self.ask(subjects.gpu_command(self.node, gpu), INFO)
        assert reply.ok, f"the agent no longer answers info on GPU {gpu}: {reply}"
        return reply.result

    def query(self) -> Reply:
        """The coordinator's job list (asserting it answers ok)."""
        reply = self.ask(subjects.coord_job_query(), QUERY_ALL)
        assert reply.ok, f"the coordinator no longer answers jobs.query: {reply}"
        return reply

    # -- health
    def mark(self) -> tuple[int, int, int]:
        """Where the logs, the GPU audit and the stray replies stand now."""
        return len(self.trap.records), len(self.violations), len(self.stray)

    def check_healthy(self, mark: tuple[int, int, int], what: str = "") -> None:
        """Assert every standing property (see the module docstring) since `mark`."""
        logs, audit, stray = mark
        for gpu in self.agent.agents:
            self.info(gpu)
        self.query()
        errors = self.trap.records[logs:]
        assert not errors, f"internal errors logged after {what}:\n" + "\n".join(errors)
        assert self.agent.nc.is_connected, f"the agent lost its NATS connection after {what}"
        assert self.coord.nc.is_connected, f"the coordinator lost NATS after {what}"
        assert not self.violations[audit:], (
            f"GPU settings applied out of range or without a lease after {what}: "
            f"{self.violations[audit:]}"
        )
        problems = self.call(self._agent_problems)
        if problems:  # A transient state would be gone after one lease-expiry period.
            time.sleep(0.3)
            problems = self.call(self._agent_problems)
        assert not problems, f"unsafe GPU state after {what}: {problems}"
        inconsistent = self.call(registry_problems, self.coord)
        assert not inconsistent, f"inconsistent coordinator registry after {what}: {inconsistent}"
        assert not self.stray[stray:], (
            f"a stream subject answered after {what}: {self.stray[stray:]}"
        )

    def _agent_problems(self) -> list[str]:
        return gpu_state_problems(self.agent) + agent_state_problems(self.agent)

    def metrics_counters(self) -> dict[str, float]:
        """The agent's Prometheus counter samples (GPU counters left out)."""
        from prometheus_client.parser import text_string_to_metric_families

        url = f"http://127.0.0.1:{self.agent.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            if family.type != "counter" or family.name.startswith(("zeus_gpu_", "DCGM_")):
                continue
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                values[f"{sample.name}{{{labels}}}"] = sample.value
        return values


INFO = codec.encode(CommandEnvelope(cmd=InfoCmd()))
QUERY_ALL = codec.encode(JobQuery())


# ---------------------------------------------------------------------------- payloads
NAN = float("nan")
INF = float("inf")
U64 = 2**64 - 1
I64 = -(2**63)


def _short(obj: Any) -> str:
    """A repr that shows long strings and bytes by their head and length."""
    if isinstance(obj, str) and len(obj) > 60:
        return f"{obj[:12]!r}*{len(obj)}"
    if isinstance(obj, bytes) and len(obj) > 60:
        return f"{obj[:24]!r}+{len(obj) - 24}B"
    if isinstance(obj, list):
        if len(obj) > 12:
            return "[" + ", ".join(_short(o) for o in obj[:12]) + f", ... {len(obj)} items]"
        return "[" + ", ".join(_short(o) for o in obj) + "]"
    if isinstance(obj, tuple):
        return "(" + ", ".join(_short(o) for o in obj) + ")"
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{_short(k)}: {_short(v)}" for k, v in obj.items()) + "}"
    return repr(obj)


def resolve(obj: Any, env: Mapping[str, Any]) -> Any:
    """Replace placeholder strings ("$NODE", "$NOW-1s", "$JOB"...) with their values."""
    if isinstance(obj, str):
        return env.get(obj, obj) if obj.startswith("$") else obj
    if isinstance(obj, list):
        return [resolve(o, env) for o in obj]
    if isinstance(obj, dict):
        return {k: resolve(v, env) for k, v in obj.items()}
    return obj


@dataclass(frozen=True)
class Case:
    """One payload to send: raw bytes, or an object packed with msgpack after `resolve`.

    `bad`: the contract refuses it whatever the services' schemas say (a non-finite number,
    a string longer than any field allows, a schema version other than 1, an unknown field
    at the top, an unknown `op`, a lease outside (0, 3600] s...).
    """

    what: str
    obj: Any = None
    raw: bytes | None = None
    bad: bool = False

    def encode(self, env: Mapping[str, Any]) -> bytes:
        """The bytes on the wire."""
        if self.raw is not None:
            return self.raw
        return msgpack.packb(resolve(self.obj, env), use_bin_type=True)

    def resolved(self, env: Mapping[str, Any]) -> Any:
        """The object with its placeholders replaced (None for raw bytes)."""
        return None if self.raw is not None else resolve(self.obj, env)

    def __repr__(self) -> str:
        body = _short(self.raw) if self.raw is not None else _short(self.obj)
        return f"Case({self.what!r}, {body}{', bad' if self.bad else ''})"


def huge_text(lo: int = 5_000, hi: int = 100_000) -> st.SearchStrategy[str]:
    """Strings of `lo`..`hi` characters (longer than any field allows)."""
    return st.builds(
        lambda n, c: c * n, st.integers(lo, hi), st.sampled_from(["z", "é", ".", "*", ">", "\0"])
    )


SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(I64, U64), st.floats(), st.text(max_size=12),
    st.binary(max_size=12),
)  # fmt: skip
SHAPES = st.recursive(
    SCALARS,
    lambda kids: (
        st.lists(kids, max_size=4)
        | st.dictionaries(st.text(max_size=6) | st.integers(-3, 3), kids, max_size=4)
    ),
    max_leaves=10,
)
"""Any msgpack value: the wrong shape for every message."""

TRICKY_BYTES = st.sampled_from([
    b"", b"\xc1", b"\xa2\xff\xfe",  # a byte msgpack never uses; a str that is not UTF-8
    b"\x91" * 5_000 + b"\xc0",  # arrays nested 5,000 deep
    b"\xdf\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff",  # map / array claiming 2**32-1 items
    b"\xdb\xff\xff\xff\xff" + b"z" * 10,  # str claiming 4 GiB
    b"\x81\x90\x01",  # a map whose key is an array
    b"\xd6\xff\x00\x00\x00\x01", b"\xc7\x00\x05",  # ext types (timestamp, empty ext)
    b"\x82\xa1v\x01\xa1v\x02",  # "v" twice
])  # fmt: skip

RANDOM = st.one_of(
    st.binary(max_size=300).map(lambda b: Case("random bytes", raw=b)),
    TRICKY_BYTES.map(lambda b: Case("tricky bytes", raw=b)),
    SHAPES.map(lambda o: Case("msgpack of another shape", obj=o)),
    st.dictionaries(st.sampled_from(["v", "cmd", "op", "job", "job_id", "holder", "lease_s"]),
                    SHAPES, max_size=4).map(lambda o: Case("map of wrong values", obj=o)),
)  # fmt: skip
"""Random bytes and valid msgpack of wrong shapes (lists, ints, nested maps)."""

BAD_VALUES = st.one_of(st.sampled_from([NAN, INF, -INF]), huge_text())
"""Values no field of the contract accepts."""
ODD_VALUES = st.sampled_from([
    1e300, -1e300, U64, I64, 2**63, -1, 0, True, None, "", "zz", b"\x00\xff", [], {}, [[]],
    {"k": [[]]}, 0.5, 5e-324,
])  # fmt: skip
"""Values of the wrong type or range for most fields (accepted by a few)."""


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if isinstance(obj, dict):
        items: Any = obj.items()
    elif isinstance(obj, list):
        items = enumerate(obj)
    else:
        return
    for key, value in items:
        yield (*prefix, key)
        yield from _paths(value, (*prefix, key))


def _at(obj: Any, path: tuple[Any, ...]) -> tuple[Any, Any]:
    for key in path[:-1]:
        obj = obj[key]
    return obj, path[-1]


@st.composite
def mutated(draw: st.DrawFn, bases: st.SearchStrategy[Case]) -> Case:
    """A near-valid payload: a `bases` case with one field mutated.

    The field gets a value no field accepts (NaN, +-inf, a huge string: `bad`), a value of
    the wrong type or range (1e300, 2**64-1, -1, "", [], None...), or is deleted; or the
    message gets a wrong schema version or an unknown top-level field (`bad`). A datagram (a
    list) gets a wrong protocol version or an extra item instead.
    """
    base = draw(bases)
    obj = copy.deepcopy(base.obj)
    assert isinstance(obj, dict | list)
    how = draw(st.sampled_from(["bad", "odd", "odd", "delete", "extra", "version"]))
    if how == "version":
        v = draw(st.sampled_from([0, 2, -1, "1", None, U64, NAN, [1]]))
        if isinstance(obj, list):
            obj[0] = v
        else:
            obj["v"] = v
        return Case(f"{base.what}; v={v!r}", obj, bad=True)
    if how == "extra":
        value = draw(ODD_VALUES | st.integers(I64, U64))
        if isinstance(obj, list):
            obj.append(value)
            return Case(f"{base.what}; extra item {_short(value)}", obj, bad=True)
        key = draw(
            st.sampled_from(["extra", "V", "", "\0", "op2", "jobid", 5, -1, None, b"v", 1.5, True])
        )
        obj[key] = value
        return Case(f"{base.what}; unknown field {key!r}", obj, bad=True)
    paths = [p for p in _paths(obj) if p not in {("v",), (0,)}]
    if not paths:
        return base
    path = draw(st.sampled_from(paths))
    parent, key = _at(obj, path)
    where = ".".join(str(p) for p in path)
    # Only the mutation decides `bad`: it may have removed what made the base bad.
    if how == "delete":
        del parent[key]
        return Case(f"{base.what}; {where} deleted", obj)
    value = draw(BAD_VALUES if how == "bad" else ODD_VALUES)
    parent[key] = value
    return Case(f"{base.what}; {where}={_short(value)}", obj, bad=how == "bad")


def lease_ok(value: Any, optional: bool = True) -> bool:
    """Whether a lease is acceptable by the contract: None (if optional) or finite in (0, 3600]."""
    if value is None:
        return optional
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return math.isfinite(value) and 0 < value <= MAX_LEASE_S


LEASES = st.one_of(
    st.none(),
    st.sampled_from([0.05, 1, 30.0, 3600, 3600.0, 5e-324, 0, 0.0, -0.0, -1, 3600.001, 1e300, U64,
                     NAN, INF, -INF]),
    st.floats(0.01, 3600),
)  # fmt: skip
"""Leases in and out of (0, 3600] s: 0, negative, NaN, inf, > 3600."""
HOLDERS = st.sampled_from(["", "fuzz-holder", "job-a", "h" * 256, "a.b*>"])
JOB_IDS = st.sampled_from(["fuzz-job", "", "j" * 256, "a.b.*>", "$JOB"])
POWER = st.one_of(
    st.integers(90, 310), st.sampled_from([0, -1, 99, 100, 300, 301, 2**63 - 1, U64, I64])
)
CLOCK = st.one_of(
    st.sampled_from(CLOCKS), st.integers(-10, 3000), st.sampled_from([0, -1, 2**63 - 1, U64, I64])
)
STAMPS = st.sampled_from(
    ["$NOW", "$NOW-100ms", "$NOW-1s", "$NOW+100ms", "$NOW+10s", "$NOW-1h", -1, 0, 2**63 - 1, U64]
)


def counter_delta(after: Mapping[str, float], before: Mapping[str, float]) -> Counter[str]:
    """Positive and negative changes of counters between two snapshots (zeros left out)."""
    delta: Counter[str] = Counter()
    for key in set(after) | set(before):
        change = after.get(key, 0) - before.get(key, 0)
        if change:
            delta[key] = change
    return delta


# ---------------------------------------------------------------------------- coordinator requests
NODES = st.sampled_from(["$NODE", "$NODE", "ghost-node", "n" * 255, "a.b*>"])
RANK_NUMBERS = st.sampled_from([0, 1, 2, 3, -1, 2**24 - 1, 2**24])
PROFILE_ROWS = st.lists(
    st.fixed_dictionaries({
        "power_limit": st.sampled_from([100, 200, 300, 50, 1000, 0, -1]),
        "energy": st.sampled_from([1.0, 100.0, 0.0, -1.0, 1e300]),
        "time": st.sampled_from([1.0, 0.5, 0.0, -1.0, 1e300]),
    }),
    max_size=4,
)  # fmt: skip
POWER_LIMIT_OPTIONS = st.one_of(
    st.none(),
    st.fixed_dictionaries({}, optional={
        "selector": st.sampled_from(["Energy", "Time", "ZeusCost", "MaxSlowdownConstraint", "X"]),
        "eta_knob": st.sampled_from([0.0, 0.5, 1.0, -0.1, 1.1]),
        "world_size": st.sampled_from([None, 1, 2, 0]),
        "max_slowdown": st.sampled_from([1.0, 1.1, 0.9, 1e300]),
        "wait_steps": st.sampled_from([0, 1, 10**9]),
        "warmup_steps": st.sampled_from([0, 1, 10]),
        "profile_steps": st.sampled_from([1, 2, 0]),
        "pl_step_w": st.sampled_from([1, 25, 100, 0, 10**9]),
        "search": st.sampled_from(["exhaustive", "adaptive", "other"]),
        "profile": st.none() | PROFILE_ROWS,
        "save_profile": st.booleans(),
    }),
)  # fmt: skip


@st.composite
def _job_info(draw: st.DrawFn) -> dict[str, Any]:
    dp, pp, tp = draw(st.integers(1, 4)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    world = draw(st.sampled_from([dp * pp * tp, dp * pp * tp, dp * pp * tp + 1, 0]))
    info: dict[str, Any] = {"dp_degree": dp, "pp_degree": pp, "tp_degree": tp,
                            "world_size": world}  # fmt: skip
    meta = draw(st.sampled_from([None, "fuzz", "m" * 128, "m" * 129, "a.b", "*", ">", " "]))
    if meta is not None:
        info["job_metadata"] = meta
    return info


REGISTER_JOBS = st.builds(
    lambda job, scheduler, options: Case(
        "register job",
        {"v": 1, "job": job, "scheduler": scheduler, "power_limit": options},
    ),
    _job_info(),
    st.sampled_from(["PowerLimitOptimizer", "s" * 64, "s" * 65, "", "a.b*>"]),
    POWER_LIMIT_OPTIONS,
)  # fmt: skip
"""`RegisterJob` payloads, valid or not in their values."""


def _rank(job: str, rank: int, node: str, gpu: int, uuid: str, dp: int | None,
          token: str | None) -> Case:
    info = {"rank": rank, "dp_rank": rank if dp is None else dp, "pp_rank": 0, "tp_rank": 0,
            "available_frequencies": [1740, 210]}  # fmt: skip
    gpu_binding = {"node": node, "gpu_index": gpu, "gpu_uuid": uuid}
    request = {"v": 1, "job_id": job, "rank_info": info, "gpu": gpu_binding}
    if token != "<absent>":
        request["join_token"] = token
    return Case("register rank", request)


REGISTER_RANKS = st.builds(
    _rank,
    st.sampled_from(["$JOB", "$JOB", "$JOB2", "no-such-job", "", "j" * 256]),
    RANK_NUMBERS,
    NODES,
    st.sampled_from([0, 1, 0, 1, 2, 7, -1, 2**24 - 1]),
    st.sampled_from(["", "", "$UUID0", "$UUID1", "GPU-not-this-one"]),
    st.sampled_from([None, None, 0, 5]),
    # The join token of $JOB or $JOB2 (right or wrong for the job named), none, or another.
    st.sampled_from(["$TOKEN", "$TOKEN", "$TOKEN2", "$TOKEN2", "<absent>", None,
                     "a-guessed-token-0000000", "short", "not a token!"]),
)
"""`RegisterRank` payloads for the module's jobs ($JOB, $JOB2) and others."""

JOB_QUERIES = st.builds(
    lambda job: Case("job query", {"v": 1} if job == "<absent>" else {"v": 1, "job_id": job}),
    st.sampled_from(["<absent>", None, "$JOB", "$JOB2", "no-such-job", "", "j" * 256, "j" * 257]),
)
"""`JobQuery` payloads."""


BARRIER = b"\xc1"
"""Never msgpack: published after a fuzzed message on the same subject. One subscription's
messages are handled in order, so once the coordinator has counted the barrier, it has handled
the message before it too."""


def drops(bus: Bus) -> dict[str, int]:
    """The coordinator's stream drops by reason, now (read on its loop)."""
    return bus.call(lambda: dict(bus.coord.dropped))


def publish_with_barrier(bus: Bus, subject: str, data: bytes, reason: str, expected: int,
                         timeout_s: float, interval_s: float,
                         barrier_subject: str | None = None) -> tuple[dict[str, int],
                                                                      dict[str, int]]:
    """Publish `data`, then `BARRIER`; the drops before, and after `reason` grew by `expected`
    plus the barrier's one (or, past `timeout_s`, as they were then: the caller reports).

    `barrier_subject`: where the barrier goes (default `subject`), for a subject the coordinator
    does not follow (NATS delivers one client's messages to another in the order sent)."""
    before = drops(bus)
    bus.publish(subject, data)
    bus.publish(barrier_subject or subject, BARRIER)
    want = before.get(reason, 0) + 1 + expected
    last: list[dict[str, int]] = [before]

    def counted() -> bool:
        last[0] = drops(bus)
        return last[0].get(reason, 0) >= want

    wait_for(counted, timeout_s, interval_s=interval_s, fail=False)
    return before, last[0]
