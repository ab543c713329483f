"""Fuzzing the trainers' Unix datagram socket of the agent with a plain `socket.socket`: random
bytes, msgpack of other shapes, events and requests (HELLO, REGISTER_JOB, REGISTER_RANK,
WINDOW, BYE, QUERY_JOB) with a field mutated, huge pids, ids, names and job ids, oversized
datagrams, events of a process that has not said hello.

Properties (besides `Bus.check_healthy` after every example):
* every datagram is counted by the gateway (`counters["datagrams"]`), and one that is dropped
  is counted with its reason: "malformed" for what does not decode (or is longer than
  `MAX_DATAGRAM_BYTES`, unless refused with a coded reply), "unbound" for events of a process
  without a binding; an event of a bound process is taken;
* every well-framed request gets exactly one `Reply` to its own request id, in one datagram a
  trainer can read (at most `MAX_DATAGRAM_BYTES`): ok when valid, otherwise a stable code
  ("bad_request" for a payload its kind's model refuses), never "internal";
* a fresh trainer socket is served afterwards (a well-formed request, then HELLO and BYE), and
  a burst of 1,000 bad datagrams is counted one by one;
* a schedule's clocks are applied by instruction events only under its live lease (also while
  the trainer keeps looping across the moment it lapses), and are unlocked once it lapsed;
* an answer relayed from the coordinator that is too long for a datagram (the job list of
  600 jobs) still reaches the trainer as a readable reply.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tests.fuzz.fuzz_kit import (
    BAD_VALUES,
    I64,
    JOB_IDS,
    JOB_QUERIES,
    ODD_VALUES,
    OK,
    RANDOM,
    REGISTER_JOBS,
    REGISTER_RANKS,
    STABLE_CODES,
    STAMPS,
    U64,
    Bus,
    Case,
    counter_delta,
    fuzz,
    huge_text,
    mutated,
)
from zeus_agent.errors import PayloadError
from zeus_agent.wire import codec, subjects
from zeus_agent.wire import trainer as dg
from zeus_agent.wire.messages import JobQuery, RegisterJob, RegisterRank, Reply
from zeus_demo.cluster import wait_for

pytestmark = pytest.mark.timeout(180)
K = dg.Kind
READ_BYTES = 65_536
"""What the agent reads of one datagram at most (a longer one arrives truncated)."""


# ---------------------------------------------------------------------------- the trainer side
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
            except (BlockingIOError, TimeoutError):  # The agent's queue is full: retry.
                return False

        wait_for(sent, 3, lambda: "the agent stopped reading its socket", interval_s=0.001)

    def drain(self) -> None:
        while True:
            try:
                self.sock.recv(READ_BYTES, socket.MSG_DONTWAIT)
            except (BlockingIOError, TimeoutError):
                return

    def reply(self, request_id: int, timeout_s: float = 3.0) -> Reply:
        """The agent's reply to `request_id` (asserting it comes, well formed, and fits in
        `MAX_DATAGRAM_BYTES`, what a trainer reads)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no reply to request {request_id} within {timeout_s} s"
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(1 << 20)
            except TimeoutError:
                continue
            finally:
                self.sock.settimeout(None)
            assert len(data) <= dg.MAX_DATAGRAM_BYTES, (
                f"the agent's reply to request {request_id} is a {len(data)}-byte datagram; a "
                f"trainer reads at most {dg.MAX_DATAGRAM_BYTES} (MAX_DATAGRAM_BYTES)"
            )
            got = dg.decode_datagram(data)
            if isinstance(got, dg.ScheduleNotice):
                continue  # The agent tells a bound trainer its schedule, unasked.
            assert isinstance(got, dg.ReplyDatagram), f"the agent sent a non-reply {got!r}"
            if got.request_id == request_id:
                return got.reply

    def request(self, kind: dg.Kind, payload: Any, request_id: int = 1) -> Reply:
        self.send(dg.encode_request(kind, os.getpid(), request_id, payload))
        return self.reply(request_id)


@pytest.fixture(scope="module")
def trainer(bus: Bus) -> Iterator[Trainer]:
    """The fuzzer's socket; the module's job ($JOB) registered through it."""
    t = Trainer(bus.agent.settings.socket_path)
    job = RegisterJob.model_validate(
        {
            "job": {
                "dp_degree": 2,
                "pp_degree": 1,
                "tp_degree": 1,
                "world_size": 2,
                "job_metadata": "trainer-fuzz",
            }
        }
    )
    reply = t.request(K.REGISTER_JOB, job)
    assert reply.ok, reply
    bus.env_extra["$JOB"] = reply.result["job_id"]
    bus.env_extra["$PID"] = os.getpid()
    yield t
    t.close()


def gateway_counters(bus: Bus) -> dict[str, int]:
    assert bus.agent.gateway is not None
    return dict(bus.agent.gateway.counters)


def bound(bus: Bus) -> bool:
    assert bus.agent.gateway is not None
    return bool(bus.agent.gateway.by_pid.get(os.getpid()))


# ---------------------------------------------------------------------------- strategies
INTS = st.one_of(st.integers(-3, 50), st.sampled_from([U64, I64, 2**63, -1, 0]))
PIDS = st.sampled_from(["$PID", "$PID", 0, 1, -1, U64, I64, 2**31])
NAMES = st.one_of(
    st.sampled_from(["", "forward", "backward"]), st.text(max_size=8), huge_text(256, 300),
    huge_text(5_000, 20_000),
)  # fmt: skip

EVENTS = st.builds(
    lambda kind, pid, t, a, b, name: Case(f"event {kind}", [1, kind, pid, t, a, b, name]),
    st.integers(1, 6), PIDS, st.one_of(STAMPS, INTS), INTS, INTS, NAMES,
)  # fmt: skip

HELLOS = st.builds(
    lambda job, rank, gpu, extra: Case("hello", {"job_id": job, "rank": rank, "gpu_index": gpu,
                                                 **extra}),
    st.one_of(JOB_IDS, huge_text(5_000, 5_000)),
    st.sampled_from([0, 1, 2**24 - 1, 2**24, -1]),
    st.sampled_from([0, 1, 0, 1, 2, 7, -1, 2**24]),
    st.sampled_from([{}, {}, {"dp_rank": 1}, {"tp_rank": -1}, {"pid": 5}]),
)  # fmt: skip
WINDOWS = st.builds(
    lambda t0, t1, gpus: Case("window", {"t0_ns": t0, "t1_ns": t1, "gpus": gpus}),
    STAMPS, STAMPS,
    st.one_of(st.lists(st.sampled_from([0, 1, 0, 1, 2, -1, 2**24]), max_size=4),
              st.sampled_from([[0] * 1024, [1] * 1025])),
)  # fmt: skip
BYES = st.sampled_from([{}, {"x": 1}, {"pid": 1}]).map(lambda p: Case("bye", p))

PAYLOADS = {
    K.HELLO: HELLOS,
    K.REGISTER_JOB: REGISTER_JOBS,
    K.REGISTER_RANK: REGISTER_RANKS,
    K.WINDOW: WINDOWS,
    K.BYE: BYES,
    K.QUERY_JOB: JOB_QUERIES,
}
REQUEST_IDS = st.one_of(st.integers(0, 2**16), st.sampled_from([U64, I64, -1]))


def _request(kind: dg.Kind, request_id: int, payload: Case) -> Case:
    return Case(f"{kind.name}: {payload.what}", [1, int(kind), "$PID", request_id, payload.obj],
                bad=payload.bad)  # fmt: skip


REQUESTS = st.one_of(*(
    st.builds(_request, st.just(kind), REQUEST_IDS, payloads | mutated(payloads))
    for kind, payloads in PAYLOADS.items()
))  # fmt: skip
ODD_FRAMES = st.one_of(
    # Unknown kinds, replies sent to the agent, wrong lengths and versions.
    st.builds(lambda kind, rest: Case("odd kind", [1, kind, *rest]),
              st.sampled_from([0, 7, 19, 26, 29, 30, 31, -1, U64, "3", 3.0, True, None]),
              st.lists(INTS | ODD_VALUES, max_size=6)),
    st.builds(lambda v, rest: Case("odd version", [v, *rest]),
              st.sampled_from([0, 2, "1", None, 1.0, U64]), st.lists(INTS, min_size=3, max_size=6)),
    st.builds(lambda v: Case("short", v), st.lists(INTS, max_size=3)),
    st.builds(lambda n: Case("reply to the agent", [1, 30, n, {"v": 1, "ok": True}]), INTS),
    st.builds(lambda value: Case("event with a bad value", [1, 3, "$PID", value, 0, 0, ""]),
              BAD_VALUES | ODD_VALUES),
    st.builds(lambda n: Case("oversized hello", [1, 20, "$PID", 7, {"job_id": "o" * n, "rank": 0,
                                                                       "gpu_index": 0}]),
              st.sampled_from([64_990, 65_600, 70_000, 100_000])),
)  # fmt: skip

DATAGRAMS = st.one_of(RANDOM, EVENTS, EVENTS, mutated(EVENTS), REQUESTS, REQUESTS, REQUESTS,
                      ODD_FRAMES)  # fmt: skip


def expected_reply(request: dg.RequestDatagram, case: Case) -> set[str]:
    """What the agent may answer a well-framed request (independent of the agent's code)."""
    payload = request.payload
    try:
        match request.kind:
            case K.HELLO:
                hello = codec.validate(dg.TrainerHello, payload)
                # forbidden: a job this agent relayed a rank of with its join token, and
                # this HELLO does not present that token.
                outcomes = {OK, "forbidden"} if hello.gpu_index in (0, 1) else {"bad_request"}
            case K.WINDOW:
                window = codec.validate(dg.WindowRequest, payload)
                if (window.t1_ns < window.t0_ns or not set(window.gpus) <= {0, 1}
                        or len(set(window.gpus)) != len(window.gpus)):
                    return {"bad_request"}  # distinct GPUs of this agent only
                outcomes = {OK, "out_of_range"}
            case K.REGISTER_JOB:
                job = codec.validate(RegisterJob, payload)
                # A job names no scheduler, or (a pipeline job) the one this coordinator runs.
                allowed = {"PowerLimitOptimizer"}
                if job.power_limit is None:
                    allowed.add("InstructionProfiler")
                if job.scheduler not in allowed:
                    return {"bad_request"}
                outcomes = {OK, "quota"}
            case K.REGISTER_RANK:
                codec.validate(RegisterRank, {k: v for k, v in payload.items() if k != "pid"})
                outcomes = set(STABLE_CODES) | {OK}
            case K.QUERY_JOB:
                query = codec.validate(JobQuery, payload)
                if query.job_id is None:
                    return {"bad_request"}  # trainers may not list other jobs
                outcomes = {OK, "unknown_job"}
            case _:  # BYE: its payload means nothing
                return {OK}
    except PayloadError:
        return {"bad_request"}
    return outcomes - {OK} if case.bad else outcomes


# ---------------------------------------------------------------------------- properties
@fuzz(150)
@example(
    case=Case(
        "hello with a 5,000-char job id",
        [1, 20, "$PID", 1, {"job_id": "j" * 5000, "rank": 0, "gpu_index": 0}],
        bad=True,
    )
)
@example(case=Case("bye", [1, 24, "$PID", 2, {}]))
@example(case=Case("event of an unbound process", [1, 3, "$PID", "$NOW", 1, 0, ""]))
@example(case=Case("huge pid and ids", [1, 3, U64, U64, U64, I64, ""]))
@example(
    case=Case(
        "hello with a huge request id",
        [1, 20, U64, U64, {"job_id": "$JOB", "rank": 0, "gpu_index": 1}],
    )
)
@example(
    case=Case("oversized", [1, 20, "$PID", 3, {"job_id": "o" * 70_000, "rank": 0, "gpu_index": 0}])
)
@given(case=DATAGRAMS)
def test_datagrams_are_answered_or_dropped_and_counted(bus: Bus, trainer: Trainer, case: Case):
    mark = bus.mark()
    data = case.encode(bus.env())
    try:
        decoded: Any = dg.decode_datagram(data)
    except PayloadError as e:
        decoded = e
    was_bound = bus.call(bound, bus)
    before = bus.call(gateway_counters, bus)
    trainer.drain()
    trainer.send(data)

    oversized = len(data) > dg.MAX_DATAGRAM_BYTES  # Dropped, or refused with a coded reply.
    reply: Reply | None = None
    expected: set[str] = set()
    if isinstance(decoded, dg.RequestDatagram) and not oversized:
        expected = expected_reply(decoded, case)
        reply = trainer.reply(decoded.request_id)
    wait_for(lambda: bus.call(gateway_counters, bus).get("datagrams", 0)
             > before.get("datagrams", 0), 3, lambda: f"the gateway never counted {case!r}",
             interval_s=0.002)
    delta = counter_delta(bus.call(gateway_counters, bus), before)
    drops = {k: v for k, v in delta.items() if k != "datagrams"}

    assert delta["datagrams"] == 1, f"datagrams counted {delta} for one {case!r}"
    assert not delta.get("internal_error"), f"the gateway failed on {case!r}: {delta}"
    if oversized and drops.get("malformed") != 1:
        assert isinstance(decoded, dg.RequestDatagram) and len(data) <= READ_BYTES, (
            f"an oversized datagram ({len(data)} bytes) was neither dropped as malformed nor "
            f"answered: {delta} ({case!r})"
        )
        reply = trainer.reply(decoded.request_id)
        expected = set(STABLE_CODES)
    if isinstance(decoded, PayloadError) or len(data) > READ_BYTES:
        assert drops.get("malformed") == 1, f"{case!r} ({decoded}) not counted malformed: {delta}"
    elif isinstance(decoded, dg.ReplyDatagram):
        assert drops.get("malformed") == 1, f"a reply sent to the agent was not counted: {delta}"
    elif isinstance(decoded, dg.EventDatagram) and not oversized:
        if was_bound:
            assert not drops, f"an event of a bound trainer was dropped: {delta} ({case!r})"
        else:
            assert drops == {"unbound": 1}, f"an unbound event was not counted: {delta}"
    elif reply is not None:
        outcome = OK if reply.ok else reply.code
        assert outcome in expected, (
            f"{decoded.kind.name} answered {outcome!r} ({reply.error[:300]!r}), expected one of "
            f"{sorted(expected)} for {case!r}"
        )
        if not reply.ok:
            assert reply.code in STABLE_CODES, f"unstable code {reply.code!r} for {case!r}"
    bus.check_healthy(mark, repr(case))
    fresh = Trainer(bus.agent.settings.socket_path)
    try:
        window = fresh.request(K.WINDOW, {"t0_ns": 0, "t1_ns": 0, "gpus": []})
        assert window.ok, f"a fresh trainer is not served after {case!r}: {window}"
    finally:
        fresh.close()


def test_a_fresh_trainer_says_hello_and_bye_after_the_fuzz(bus: Bus, trainer: Trainer):
    fresh = Trainer(bus.agent.settings.socket_path)
    try:
        hello = fresh.request(K.HELLO, {"job_id": "after-fuzz", "rank": 0, "gpu_index": 1}, 11)
        assert hello.ok, hello
        assert hello.result["gpu_uuid"] == bus.agent.agents[1].info.uuid
        assert bus.info(1)["binding"]["job_id"] == "after-fuzz"
        bye = fresh.request(K.BYE, {}, 12)
        assert bye.ok, bye
        assert bus.info(1)["binding"] is None
        assert bus.info(0)["binding"] is None
    finally:
        fresh.close()
    counters = bus.call(gateway_counters, bus)
    assert counters.get("internal_error", 0) == 0, counters


def test_garbage_keeps_counting_under_a_burst(bus: Bus, trainer: Trainer):
    """1,000 bad datagrams back to back: every one is counted, the gateway keeps serving."""
    before = bus.call(gateway_counters, bus)
    junk = [b"\xc1", msgpack.packb([1, 3]), msgpack.packb({"v": 1}), b"",
            msgpack.packb([2, 20, 1, 1, {}])] * 200  # fmt: skip
    for data in junk:
        trainer.send(data)
    deltas: list[dict[str, int]] = []

    def all_counted() -> bool:
        deltas[:] = [counter_delta(bus.call(gateway_counters, bus), before)]
        return deltas[0]["datagrams"] >= len(junk)

    wait_for(all_counted, 10, interval_s=0.01, fail=False)  # the assertions say what is missing
    delta = deltas[0]
    assert delta["datagrams"] == len(junk), delta
    assert delta["malformed"] == len(junk), delta
    fresh = Trainer(bus.agent.settings.socket_path)
    try:
        assert fresh.request(K.QUERY_JOB, {"v": 1, "job_id": "no-such"}, 5).code == "unknown_job"
    finally:
        fresh.close()


SCHEDULE_NAMES = st.sampled_from(["forward", "backward", "", "other", "f" * 255])


@fuzz(25)
@example(pairs=[("forward", 1740)], lease=0.05, events=[], pause_at=0, pause_s=0.0, stream_s=0.3)
@given(
    pairs=st.lists(st.tuples(st.sampled_from(["forward", "backward"]),
                             st.sampled_from([1740, 1200, 210])), min_size=1, max_size=4),
    lease=st.sampled_from([0.05, 0.12, 30.0]),
    events=st.lists(st.tuples(st.sampled_from([K.INSTRUCTION_BEGIN, K.INSTRUCTION_BEGIN,
                                               K.INSTRUCTION_END, K.STEP_END, K.STEP_BEGIN]),
                              SCHEDULE_NAMES, INTS), max_size=12),
    pause_at=st.integers(0, 12),
    pause_s=st.sampled_from([0.0, 0.0, 0.12]),
    stream_s=st.sampled_from([0.0, 0.0, 0.0, 0.2]),
)  # fmt: skip
def test_schedules_lock_clocks_only_under_their_lease(
    bus: Bus,
    trainer: Trainer,
    pairs: list[tuple[str, int]],
    lease: float,
    events: list[tuple[dg.Kind, str, int]],
    pause_at: int,
    pause_s: float,
    stream_s: float,
):
    """Instruction events of a bound trainer apply its schedule's clocks, always under the
    schedule's lease (also while it lapses), and nothing is left locked once it has lapsed.
    `stream_s`: then a training loop (every instruction of the schedule, a step end) every
    2 ms for that long, across the moment the lease lapses."""
    mark = bus.mark()
    hello = trainer.request(K.HELLO, {"job_id": "sched-job", "rank": 0, "gpu_index": 0}, 900)
    assert hello.ok, hello
    install = {
        "v": 1,
        "cmd": {
            "op": "install_schedule",
            "job_id": "sched-job",
            "holder": "sched-job",
            "lease_s": lease,
            "schedule": {"rank": 0, "frequencies": [list(p) for p in pairs]},
        },
    }
    reply = bus.ask(subjects.gpu_command(bus.node, 0), codec.encode(install))
    assert reply.ok, reply
    for i, (kind, name, counter) in enumerate(events):
        if i == pause_at and pause_s:
            time.sleep(pause_s)
        trainer.send(dg.encode_event(kind, os.getpid(), time.monotonic_ns(), counter, 0, name))
    end, index = time.monotonic() + stream_s, 0
    while time.monotonic() < end:
        for name, _mhz in pairs:
            trainer.send(dg.encode_event(K.INSTRUCTION_BEGIN, 0, time.monotonic_ns(), index, 0,
                                         name))  # fmt: skip
            index += 1
        trainer.send(dg.encode_event(K.STEP_END, 0, time.monotonic_ns(), index, 0, ""))
        time.sleep(0.002)
    what = f"schedule {pairs} lease {lease} events {events} then a loop for {stream_s} s"
    bus.check_healthy(mark, what)
    if lease < 1:  # Once lapsed (and one expiry period later), the clocks are unlocked.
        locked: list[Any] = []

        def unlocked() -> bool:
            locked[:] = [bus.call(lambda: bus.agent.agents[0].gpu.get_locked_sm_clocks_mhz())]
            return not locked[0]

        wait_for(unlocked, max(lease, 0.1) + 0.5,
                 lambda: f"clocks still locked to {locked[0]} after the lease", interval_s=0.01)
    bye = trainer.request(K.BYE, {}, 901)
    assert bye.ok, bye


def test_a_relayed_answer_too_long_for_a_datagram_still_gets_a_fitting_reply(
    bus: Bus, trainer: Trainer
):
    """QUERY_JOB without a job id relays the coordinator's job list; with 600 jobs of long
    names that list no longer fits in a datagram: the trainer still gets a reply it can read
    (the list, bounded, or a coded refusal)."""
    job = codec.encode(
        {
            "v": 1,
            "job": {
                "dp_degree": 1,
                "pp_degree": 1,
                "tp_degree": 1,
                "world_size": 1,
                "job_metadata": "m" * 128,
            },
        }
    )

    async def register(n: int) -> None:
        import asyncio

        await asyncio.gather(*(bus.nc.request(subjects.coord_register_job(f"many-{i % 100}"), job,
                                              timeout=30) for i in range(n)))  # fmt: skip

    bus.run(register(600), 60)
    fresh = Trainer(bus.agent.settings.socket_path)
    try:
        reply = fresh.request(K.QUERY_JOB, {"v": 1}, 31)
    finally:
        fresh.close()
    assert reply.ok or reply.code in STABLE_CODES, reply
