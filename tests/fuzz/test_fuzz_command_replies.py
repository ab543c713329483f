"""Fuzzing the agents' replies to the coordinator's GPU commands (issue 33).

A fake agent on the fuzz bus serves nodes of its own (`fz<n>`, one per example) and answers the
coordinator's `info`, `set_power_limit`, `install_schedule`, `clear_schedule` and
`reset_power_limit` commands with fuzzed replies: random bytes, msgpack of other shapes, maps
nested 100,000 deep, `Reply`s whose `ok`, `code`, `error` and `result` have the wrong types,
huge ints (2**63 - 1, 2**64 - 1; msgpack carries no larger), negatives, NaN and infinities,
strings of a few characters and of 100,000,
GPU descriptions upside down (min > max), with a default outside their range, 100,000 clocks,
fields missing or mutated, no reply at all. Each example registers a job through the API (a
power-limit job or a pipeline job, one or two ranks, the GPU described by the rank's
`gpu_info` as a relaying agent sends it, or asked with `info` when the rank registers, or when
the job starts) and drives it until its GPUs are commanded (a power-limit job sets its first
limit; a pipeline job is fed iterations' instruction measurements until it installs its first
profiling schedule).

Properties, after every example:
* the coordinator replica is still serving: its task group runs, it is connected, a
  `JobQuery` is answered, its registry is consistent;
* a registration is answered with a stable code, never "internal"; one whose `gpu_info` is
  outside the wire's bounds is refused `bad_request`;
* a job whose ranks all registered is driven (its optimiser runs) or says why not in a status
  ("error", "failed", "waiting"); a job that failed is quarantined, is not driven, its GPUs are
  sent back to their defaults, and it is never started again (one "failed" status, however
  long the replica runs); a job waiting for its agents says so once;
* nothing is logged with a traceback, nor at ERROR, except the quarantine of a failed job.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from coordinator.state import records
from tests.fuzz.fuzz_kit import (
    I64,
    INF,
    NAN,
    RANDOM,
    U64,
    Bus,
    Case,
    fuzz,
    mutated,
    registry_problems,
    resolve,
)
from zeus_agent.errors import PayloadError
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import REPLY_CODES, JobStatus, RegisterRank, join_token_digest
from zeus_demo.cluster import wait_for

pytestmark = pytest.mark.timeout(180)

NODE_PREFIX = "fz"
"""The fake agent serves nodes `fz<n>` (the module's real agent serves its own node)."""
LONG = 100_000
"""A long string, a long list, a deep nesting."""
ORDER = ("forward", "backward")
"""The instructions of one iteration of the fake pipeline's ranks."""
CODES = set(REPLY_CODES) - {"internal"}
"""The codes a refusal may carry: any stable one but "internal" (a bug)."""
ALLOWED_LOGGERS = ("coordinator.service.failures",)
"""Where an ERROR (or a traceback) is the documented outcome: a job that failed is quarantined."""


def description(changes: dict[str, Any] | None = None) -> dict[str, Any]:
    """A valid GPU description (an A40's: 100-300 W) of the fake node's GPU 0, with `changes`.

    (The fake agent and the rank requests give a description the index of the GPU asked.)
    """
    desc = {"index": 0, "uuid": "GPU-fz-0", "name": "NVIDIA A40",
            "architecture": "Ampere", "min_power_limit_w": 100, "max_power_limit_w": 300,
            "default_power_limit_w": 300, "supported_memory_clocks_mhz": [7251],
            "supported_graphics_clocks_mhz": [1740, 210], "has_energy_counter": True,
            "power_limit_w": 300}  # fmt: skip
    desc.update(changes or {})
    return desc


OK_REPLY = {"v": 1, "ok": True, "code": "", "error": "", "result": {}}


def info_reply(desc: Any) -> dict[str, Any]:
    """The reply to `info` carrying `desc` as the GPU's description."""
    return {"v": 1, "ok": True, "code": "", "error": "", "result": {"gpu": desc}}


def deep_info_reply() -> bytes:
    """An `info` reply whose description is a list nested 100,000 deep (raw msgpack)."""
    head = msgpack.packb({"v": 1, "ok": True, "result": {"gpu": None}}, use_bin_type=True)
    assert head.endswith(b"\xc0")
    return head[:-1] + b"\x91" * LONG + b"\xc0"


def deep_result_reply() -> bytes:
    """A reply whose `result` is a map nested 100,000 deep (raw msgpack)."""
    head = msgpack.packb({"v": 1, "ok": True, "result": None}, use_bin_type=True)
    return head[:-1] + b"\x81\xa1k" * LONG + b"\xc0"


# ---------------------------------------------------------------------------- fuzzed replies
# A reply spec: a `Case` (bytes on the wire) or None (no reply: the command times out). Long
# values are placeholders in the cases (short reprs), replaced when encoded (`LONG_VALUES`);
# descriptions are GPU 0's, adapted to the GPU asked (`_for_gpu`).
LONG_VALUES: dict[str, Any] = {
    "$STR": "u" * LONG,
    "$UTF8": "é" * LONG,
    "$CLOCKS": list(range(1, LONG + 1)),
    "$SAME_CLOCKS": [1740] * LONG,
    "$LIST": list(range(LONG)),
}
"""What the placeholders of the cases stand for (strings and lists of 100,000)."""

HOSTILE_DESCRIPTIONS = st.sampled_from([
    {"max_power_limit_w": 2**63 - 1},
    {"max_power_limit_w": U64},
    {"min_power_limit_w": 2**63 - 1, "max_power_limit_w": 2**63 - 1,
     "default_power_limit_w": 2**63 - 1, "power_limit_w": 2**63 - 1},
    {"min_power_limit_w": 300, "max_power_limit_w": 100},  # upside down
    {"min_power_limit_w": 250, "max_power_limit_w": 200, "default_power_limit_w": 200},
    {"default_power_limit_w": 50},  # outside its range
    {"default_power_limit_w": 10_001},
    {"min_power_limit_w": 0}, {"min_power_limit_w": -1}, {"min_power_limit_w": I64},
    {"max_power_limit_w": 10_001, "default_power_limit_w": 10_001},
    {"min_power_limit_w": NAN}, {"max_power_limit_w": INF}, {"max_power_limit_w": -INF},
    {"max_power_limit_w": 300.5}, {"max_power_limit_w": 1e300}, {"max_power_limit_w": "300"},
    {"max_power_limit_w": None}, {"max_power_limit_w": [300]},
    {"supported_graphics_clocks_mhz": "$CLOCKS"},
    {"supported_graphics_clocks_mhz": "$SAME_CLOCKS"},
    {"supported_memory_clocks_mhz": [2**63 - 1]},
    {"supported_graphics_clocks_mhz": [-1, 0]},
    {"supported_graphics_clocks_mhz": [NAN]},
    {"supported_graphics_clocks_mhz": "1740"},
    {"uuid": "$STR"}, {"name": "$STR"}, {"architecture": "$UTF8"}, {"job_id": "$STR"},
    {"schedule_version": U64}, {"schedule_version": -1},
    {"index": 2**63 - 1}, {"index": -1},
    {"power_limit_w": 2**63 - 1}, {"power_limit_w": NAN},
    {"has_energy_counter": "yes"}, {"controllable": "no"}, {"extra": "$STR"},
])  # fmt: skip
"""Changes that put a description outside the wire's bounds (or give it the wrong types)."""
ODD_DESCRIPTIONS = st.sampled_from([
    {},  # valid
    {"min_power_limit_w": 1, "max_power_limit_w": 10_000, "default_power_limit_w": 10_000,
     "power_limit_w": 10_000},  # the widest range the wire allows
    {"min_power_limit_w": 1, "max_power_limit_w": 1, "default_power_limit_w": 1,
     "power_limit_w": 1},  # a range of one limit
    {"min_power_limit_w": 200, "max_power_limit_w": 200, "default_power_limit_w": 200},
    {"supported_graphics_clocks_mhz": [], "supported_memory_clocks_mhz": []},
    {"uuid": "GPU-another-one"},  # not the uuid the rank named
    {"index": 7},  # another GPU's description
    {"controllable": False},  # observe-only
    {"job_id": "someone-else"}, {"schedule_version": 0}, {"power_limit_w": 100},
    {"has_energy_counter": False}, {"max_power_limit_w": 300.0},
])  # fmt: skip
"""Changes within the wire's bounds, some odd (the widest range, observe-only...)."""
DESCRIPTIONS = st.one_of(
    ODD_DESCRIPTIONS.map(lambda c: ("odd", description(c))),
    HOSTILE_DESCRIPTIONS.map(lambda c: ("hostile", description(c))),
    mutated(st.just(Case("description", description()))).map(lambda c: ("mutated", c.obj)),
)
"""(how, a GPU description) for `gpu_info` and for the answers to `info`."""

REPLY_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "v": st.sampled_from([1, 1, 1, 0, 2, -1, U64, "1", None, NAN]),
        "ok": st.sampled_from([True, False, 1, 0, None, "true", [], NAN]),
        "code": st.sampled_from(["", "bad_request", "conflict", "internal", "zz", 5, None, ["x"],
                                 "$STR", "c" * 64]),
        "error": st.sampled_from(["", "refused", 5, None, {"a": 1}, b"\xff", "$STR", "$UTF8"]),
        "result": st.one_of(st.sampled_from([{}, None, [], 5, "r", {"gpu": None},
                                             {"gpu": []}, {"gpu": 2**63 - 1}, "$LIST"]),
                            st.dictionaries(st.text(max_size=4), st.integers(I64, U64),
                                            max_size=3)),
        "extra": st.sampled_from([1, "$STR", None]),
    },
)
"""`Reply` maps with fields missing or of the wrong type."""

COMMON_REPLIES = st.one_of(
    RANDOM,
    REPLY_FIELDS.map(lambda o: Case("reply of wrong fields", o)),
    mutated(st.just(Case("ok reply", OK_REPLY))),
    st.sampled_from([
        Case("deep result", raw=deep_result_reply()),
        Case("ok reply", OK_REPLY),
        Case("refused", {"v": 1, "ok": False, "code": "conflict", "error": "held"}),
        Case("refused at length", {"v": 1, "ok": False, "code": "c" * 64, "error": "$UTF8"}),
        Case("ok, long result", {"v": 1, "ok": True, "result": {"k": "$STR", "l": "$LIST"}}),
    ]),
    st.just(None),
)  # fmt: skip
"""Replies to any command (including `info`)."""

INFO_REPLIES = st.one_of(
    DESCRIPTIONS.map(lambda d: Case(f"info ({d[0]} description)", info_reply(d[1]))),
    DESCRIPTIONS.map(lambda d: Case(f"info ({d[0]} description)", info_reply(d[1]))),
    mutated(st.just(Case("info", info_reply(description())))),
    st.sampled_from([Case("deep description", raw=deep_info_reply()),
                     Case("description a list", info_reply([description()]))]),
    COMMON_REPLIES,
)
"""Answers to `info`."""
COMMAND_REPLIES = COMMON_REPLIES
"""Answers to `set_power_limit`, `install_schedule`, `clear_schedule`, `reset_power_limit`."""


def _with_index(desc: Any, gpu: int) -> Any:
    """A description of GPU 0 made GPU `gpu`'s (anything else as it is)."""
    if isinstance(desc, dict) and desc.get("index") == 0:
        uuid = f"GPU-fz-{gpu}" if desc.get("uuid") == "GPU-fz-0" else desc.get("uuid")
        return {**desc, "index": gpu, "uuid": uuid}
    return desc


def _for_gpu(case: Case | None, gpu: int) -> Case | None:
    """The reply spec adapted to GPU `gpu` (a description's index follows the GPU asked)."""
    if case is None or case.raw is not None or not isinstance(case.obj, dict):
        return case
    result = case.obj.get("result")
    if not isinstance(result, dict) or "gpu" not in result:
        return case
    obj = {**case.obj, "result": {**result, "gpu": _with_index(result["gpu"], gpu)}}
    return Case(case.what, obj, bad=case.bad)


# ---------------------------------------------------------------------------- the fake agent
@dataclass
class Behaviour:
    """How the fake agent answers one node's commands (by op; "info" and the others)."""

    info: Case | None
    command: Case | None
    asked: list[tuple[int, str]] = field(default_factory=list)
    """(GPU, op) of every command received, in order."""


class FakeAgent:
    """Answers the commands of the `fz<n>` nodes' GPUs as each example's `Behaviour` says."""

    def __init__(self) -> None:
        self.nodes: dict[str, Behaviour] = {}
        self.errors: list[str] = []

    async def on_command(self, msg: Any) -> None:
        where = subjects.parse_gpu_subject(msg.subject)
        behaviour = self.nodes.get(where.node) if where is not None else None
        if behaviour is None or not msg.reply:
            return  # Another agent's GPU (the module's real agent answers it).
        try:
            gpu = int(where.gpu)
            op = str(msgpack.unpackb(msg.data)["cmd"]["op"])
        except Exception as e:  # noqa: BLE001 - the coordinator's command is not what it says
            self.errors.append(f"the coordinator sent {msg.subject} {bytes(msg.data)[:200]!r}: {e}")
            return
        behaviour.asked.append((gpu, op))
        spec = behaviour.info if op == "info" else behaviour.command
        spec = _for_gpu(spec, gpu)
        if spec is None:
            return  # No reply: the coordinator's command times out.
        await msg.respond(spec.encode(LONG_VALUES))


@pytest.fixture(scope="module")
def fake(bus: Bus) -> FakeAgent:
    """The fake agent, subscribed to every GPU's commands (it answers only its own nodes)."""
    agent = FakeAgent()

    async def subscribe() -> None:
        await bus.nc.subscribe(f"{subjects.DEFAULT_PREFIX}.gpu.*.*.cmd", cb=agent.on_command)
        await bus.nc.flush()

    bus.run(subscribe())
    return agent


@pytest.fixture(scope="module")
def statuses(bus: Bus) -> list[JobStatus]:
    """Every job status the coordinator publishes from now on (each must decode)."""
    got: list[JobStatus] = []

    async def on_status(msg: Any) -> None:
        got.append(codec.decode(msg.data, JobStatus))

    async def subscribe() -> None:
        await bus.nc.subscribe(subjects.all_job_status(), cb=on_status)
        await bus.nc.flush()

    bus.run(subscribe())
    return got


# ---------------------------------------------------------------------------- one example
NODES = itertools.count()
PL_OPTIONS = {"selector": "Energy", "wait_steps": 0, "warmup_steps": 0, "profile_steps": 1,
              "pl_step_w": 100}  # fmt: skip


@dataclass(frozen=True)
class Scenario:
    """One example: the job, how its GPUs are described, how the fake agent answers."""

    kind: str
    """"power_limit" or "pipeline"."""
    world: int
    gpu_info: tuple[str, Any] | None
    """(how, the description a relaying agent adds to each `RegisterRank`), or None. How
    "start": a valid description, forgotten once the rank is in, so the job's start asks
    `info` (as a replica that takes a job over without its GPUs' recorded limits does)."""
    info: Case | None
    command: Case | None

    def __repr__(self) -> str:
        described = "no gpu_info" if self.gpu_info is None else f"{self.gpu_info[0]} gpu_info " \
            f"{Case('', self.gpu_info[1])!r}"
        return (f"Scenario({self.kind}, world {self.world}, {described}, info -> {self.info!r}, "
                f"commands -> {self.command!r})")


SCENARIOS = st.builds(
    Scenario,
    kind=st.sampled_from(["power_limit", "pipeline"]),
    world=st.sampled_from([1, 2]),
    gpu_info=st.one_of(st.none(), st.none(), st.just(("start", description())), DESCRIPTIONS),
    info=INFO_REPLIES,
    command=COMMAND_REPLIES,
)


def _register_job(bus: Bus, node: str, kind: str, world: int) -> tuple[str, str]:
    job: dict[str, Any] = {"v": 1, "job": {"dp_degree": world, "pp_degree": 1, "tp_degree": 1,
                                           "world_size": world, "job_metadata": "replies"}}
    if kind == "power_limit":
        job["power_limit"] = PL_OPTIONS
    reply = bus.ask(subjects.coord_register_job(node), codec.encode(job))
    assert reply.ok, f"the job was not registered: {reply}"
    return reply.result["job_id"], reply.result["join_token"]


def _rank_request(job_id: str, token: str, node: str, rank: int,
                  gpu_info: dict[str, Any] | None) -> dict[str, Any]:
    request = {"v": 1, "job_id": job_id, "join_token": token,
               "rank_info": {"rank": rank, "dp_rank": rank, "pp_rank": 0, "tp_rank": 0,
                             "available_frequencies": [1740, 210]},
               "gpu": {"node": node, "gpu_index": rank, "gpu_uuid": f"GPU-fz-{rank}"}}
    if gpu_info is not None:
        request["gpu_info"] = resolve(_with_index(gpu_info, rank), LONG_VALUES)
    return request


def _decodes(request: dict[str, Any]) -> bool:
    try:
        codec.decode(codec.encode(request), RegisterRank)
    except PayloadError:
        return False
    return True


def _start_settled(bus: Bus, job_id: str) -> bool:
    driver = bus.coord.jobs.get(job_id)
    return driver is not None and not driver.starting and not driver.lock.locked()


def _publish_iterations(bus: Bus, node: str, job_id: str, token: str, world: int) -> None:
    """One pipeline iteration after another (three), as the fake node's agent measures them."""
    digest = join_token_digest(token)
    t = time.monotonic_ns()
    for step in range(3):
        parts = []
        for rank in range(world):
            measurements = [
                {"kind": "instruction", "name": name, "epoch": 0, "step": step, "index": i,
                 "t0_ns": t + 10 * i, "t1_ns": t + 10 * i + 5, "time_s": 0.1, "energy_j": 1.0}
                for i, name in enumerate(ORDER)
            ] + [{"kind": "step", "name": "", "epoch": 0, "step": step, "index": 0, "t0_ns": t,
                  "t1_ns": t + 30, "time_s": 1.0, "energy_j": 10.0}]
            parts.append({"gpu": rank, "rank": rank, "marks": [],
                          "measurements": measurements, "join_digest": digest})
        batch = {"v": 1, "node": node, "job_id": job_id, "gpus": parts}  # the node's GPUs'
        bus.publish(subjects.job_measurements(job_id, node), codec.encode(batch))
        t += 1_000


def _serving(bus: Bus, what: str) -> None:
    """The coordinator replica still serves: task group, connection, queries, registry."""
    coord = bus.coord
    assert coord._tg is not None and not coord.should_exit.is_set(), (
        f"the coordinator's task group stopped after {what}"
    )
    assert coord.nc is not None and coord.nc.is_connected, f"the coordinator lost NATS after {what}"
    bus.query()  # a JobQuery is answered (asserts ok)
    assert bus.call(lambda: coord.health()[0]), f"/healthz says unhealthy after {what}"
    problems = bus.call(registry_problems, coord)
    assert not problems, f"inconsistent registry after {what}: {problems}"


def _forget_gpu(bus: Bus, node: str, gpu: int) -> None:
    """Forget what the coordinator learnt of a GPU (its start must ask the agent again)."""
    bus.coord.gpus.limits.pop((node, gpu), None)
    bus.coord.gpus._cache.pop((node, gpu), None)


def _job_statuses(statuses: list[JobStatus], job_id: str) -> list[JobStatus]:
    return [s for s in list(statuses) if s.job_id == job_id]


SAID_WHY = ("error", "failed", "waiting")
"""Statuses that say why a job whose ranks are all in is not driven."""
OUTCOMES: Counter[tuple[Any, ...]] = Counter()
"""(kind, ranks registered, driven, commands answered, statuses) -> how many examples."""


@fuzz(40)
@example(Scenario("power_limit", 1, None,
                  Case("info", info_reply(description({"max_power_limit_w": 2**63 - 1}))),
                  Case("ok reply", OK_REPLY)))
@example(Scenario("power_limit", 2, ("hostile", description({"max_power_limit_w": 2**63 - 1})),
                  Case("ok reply", OK_REPLY), Case("ok reply", OK_REPLY)))
@example(Scenario("power_limit", 1, None, Case("info", info_reply(description(
    {"min_power_limit_w": 1, "max_power_limit_w": 10_000, "default_power_limit_w": 10_000}))),
                  Case("refused at length", {"v": 1, "ok": False, "code": "c" * 64,
                                             "error": "$UTF8"})))
@example(Scenario("pipeline", 2, None, Case("info", info_reply(description())),
                  Case("deep result", raw=deep_result_reply())))
@example(Scenario("pipeline", 1, ("odd", description()), None, None))
@given(scenario=SCENARIOS)
def test_fuzzed_command_replies_end_at_most_one_job(
    bus: Bus, fake: FakeAgent, statuses: list[JobStatus], scenario: Scenario
):
    mark = bus.mark()
    node = f"{NODE_PREFIX}{next(NODES)}"
    behaviour = fake.nodes[node] = Behaviour(scenario.info, scenario.command)
    job_id, token = _register_job(bus, node, scenario.kind, scenario.world)

    # The ranks, through the fake node's agent (which adds its description, or is asked).
    registered = 0
    for rank in range(scenario.world):
        request = _rank_request(job_id, token, node, rank,
                                scenario.gpu_info[1] if scenario.gpu_info else None)
        reply = bus.ask(subjects.coord_register_rank(node), codec.encode(request))
        if not _decodes(request):
            assert reply.code == "bad_request", (
                f"a rank whose gpu_info is outside the wire's bounds got {reply} ({scenario!r})"
            )
        elif not reply.ok:
            assert reply.code in CODES, (
                f"rank {rank}: unstable code {reply.code!r} {reply.error[:300]!r} ({scenario!r})"
            )
        registered += reply.ok
        if reply.ok and scenario.gpu_info is not None and scenario.gpu_info[0] == "start":
            bus.call(_forget_gpu, bus, node, rank)

    if registered == scenario.world:
        # Every rank is in: the job starts (or says why not); its first commands are answered.
        wait_for(lambda: bus.call(_start_settled, bus, job_id), 10,
                 f"the start of {job_id} to settle ({scenario!r})", interval_s=0.01)
        if scenario.kind == "pipeline" and bus.call(lambda: bus.coord.jobs.optimiser(job_id)):
            _publish_iterations(bus, node, job_id, token, scenario.world)
            wait_for(lambda: any(op == "install_schedule" for _, op in list(behaviour.asked))
                     or bus.call(lambda: bus.coord.jobs.optimiser(job_id)) is None, 5,
                     f"{job_id} to install a schedule ({scenario!r})", interval_s=0.01)
            wait_for(lambda: bus.call(_start_settled, bus, job_id), 10,
                     f"the schedule of {job_id} to be answered ({scenario!r})", interval_s=0.01)
        wait_for(lambda: bus.call(lambda: bus.coord.jobs.optimiser(job_id)) is not None
                 or any(s.state in SAID_WHY for s in _job_statuses(statuses, job_id)), 5,
                 f"{job_id} to be driven or to say why not ({scenario!r})", interval_s=0.01)

    _serving(bus, repr(scenario))
    assert not fake.errors, fake.errors
    said = _job_statuses(statuses, job_id)
    OUTCOMES[(scenario.kind, f"{registered}/{scenario.world} ranks",
              "driven" if bus.call(lambda: bus.coord.jobs.optimiser(job_id)) else "not driven",
              tuple(sorted({op for _, op in behaviour.asked})),
              tuple(sorted({s.state for s in said} - {"registered", "rank_registered"})))] += 1
    failed = [s for s in said if s.state == "failed"]
    if failed:
        h = records.job_hash(job_id)
        assert bus.call(lambda: h in bus.coord.failures.quarantined), (
            f"{job_id} failed but is not quarantined ({scenario!r})"
        )
        assert bus.call(lambda: bus.coord.jobs.optimiser(job_id)) is None, (
            f"{job_id} failed but is still driven ({scenario!r})"
        )
        wait_for(lambda: {"reset_power_limit", "clear_schedule"}
                 <= {op for _, op in list(behaviour.asked)}, 5,
                 f"the GPUs of the failed {job_id} to be set back to their defaults",
                 interval_s=0.01)
    if not failed:
        bus.check_healthy(mark, repr(scenario))  # the fuzz suite's checks, logs included
    errors = [r for r in bus.trap.records[mark[0]:] if not r.startswith(ALLOWED_LOGGERS)]
    assert not errors, f"internal errors logged after {scenario!r}:\n" + "\n".join(errors)


def test_failed_jobs_are_never_started_again(
    bus: Bus, fake: FakeAgent, statuses: list[JobStatus]
):
    """After the fuzz (and the job timers' ticks, ownership rounds): one 'failed' status per job
    at most, a failed job is still not driven, a job waiting for its agents said so once."""
    time.sleep(2.5)  # Two ticks of the job timers, five ownership rounds.
    said = Counter((s.job_id, s.state) for s in list(statuses))
    again = {j: n for (j, state), n in said.items() if state == "failed" and n > 1}
    assert not again, f"jobs that failed more than once (started again): {again}"
    waits = {j: n for (j, state), n in said.items() if state == "waiting" and n > 1}
    assert not waits, f"jobs that said more than once that they wait: {waits}"
    by_job = {j for (j, state) in said if state == "failed"}
    driven = [j for j in by_job if bus.call(lambda j=j: bus.coord.jobs.optimiser(j)) is not None]
    assert not driven, f"failed jobs driven again: {driven}"
    _serving(bus, "the fuzz")
    asked = {op for outcome in OUTCOMES for op in outcome[3]}
    assert {"info", "set_power_limit", "install_schedule"} <= asked, (
        f"the fuzz never had these commands answered: {OUTCOMES}"
    )
