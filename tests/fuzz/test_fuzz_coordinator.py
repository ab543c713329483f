"""Fuzzing the coordinator: its endpoints `<p>.coord.jobs.register.<node>`,
`<p>.coord.ranks.register.<node>`, `<p>.coord.jobs.query` and its streams `<p>.job.*.ev.*.*`,
`<p>.job.*.meas.*`, `<p>.agent.*.hello`, with random bytes, wrong shapes, near-valid payloads
with one field mutated, unknown jobs and ranks, spoofed nodes, huge counters and energies.

The module's jobs: $JOB (data parallel on the agent's two GPUs, power-limit optimised with
one profiling step per limit, so fuzzed events and marks drive its optimiser and its commands
to the agent) and $JOB2 (four ranks, none registered, for rank registrations).

Properties (besides `Bus.check_healthy` after every example: registry consistent, GPUs safe,
no internal error, still serving):
* a request gets a `Reply`: "bad_request" when it does not decode, "forbidden" for a rank
  registered through another node than its GPU's, "unknown_job", "out_of_range" for a rank
  that does not fit its job, never "internal"; every acknowledged registration is on disk;
* a stream message never gets an answer; a malformed one is counted ("malformed"), and so is
  one about an unknown job, or a rank not bound to the node it came through (in a node's
  measurement batch, each GPU's part that fails is counted once, the others count);
* a node's ranks in columns (`RegisterRankColumns`) are refused whole exactly when they do not
  decode, else answered rank by rank with coded replies;
* racing registrations of a job's ranks leave one rank per GPU and register exactly what was
  acknowledged;
* an optimiser started with any options (loaded profiles in or out of range, empty, long) and
  fed step events and marks with any energies and times reports a status, never crashes, and
  keeps the GPUs in range and under leases;
* `jobs.query` answers with 6,000 jobs registered (within the default `max_jobs`).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tests.fuzz.fuzz_kit import (
    I64,
    JOB_QUERIES,
    NODES,
    OK,
    PROFILE_ROWS,
    RANDOM,
    REGISTER_JOBS,
    REGISTER_RANKS,
    STABLE_CODES,
    STAMPS,
    U64,
    Bus,
    Case,
    fuzz,
    mutated,
    publish_with_barrier,
    resolve,
)
from zeus_agent.errors import PayloadError
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.event_columns import EVENT_KINDS, decode_events
from zeus_agent.wire.messages import (
    AgentHello,
    JobQuery,
    JobStatus,
    RegisterJob,
    RegisterRank,
    Reply,
    join_token_digest,
)
from zeus_agent.wire.node_columns import (
    MARK_KINDS,
    MEASUREMENT_KINDS,
    NodeColumnBatch,
    decode_measurements,
)
from zeus_agent.wire.rank_columns import decode_registration
from zeus_demo.cluster import wait_for

pytestmark = pytest.mark.timeout(180)

ACKNOWLEDGED: dict[str, set[int]] = {}
"""Jobs (and their ranks) the coordinator acknowledged during the fuzz."""


@pytest.fixture(scope="module")
def jobs(bus: Bus) -> dict[str, str]:
    """Register $JOB (optimised, both ranks on the agent's GPUs) and $JOB2 (no ranks)."""
    node = bus.node
    job = {"v": 1, "job": {"dp_degree": 2, "pp_degree": 1, "tp_degree": 1, "world_size": 2,
                           "job_metadata": "fuzz-optimised"},
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
                            "job_metadata": "fuzz-ranks"}}  # fmt: skip
    reply = bus.ask(subjects.coord_register_job(node), codec.encode(job2))
    assert reply.ok, reply
    wait_for(lambda: job_id in bus.call(lambda: set(bus.coord.optimisers)), 10,
             "the optimiser of the module's job to start", interval_s=0.02)
    bus.env_extra.update({"$JOB": job_id, "$JOB2": reply.result["job_id"],
                          "$TOKEN": token, "$TOKEN2": reply.result["join_token"],
                          "$DIGEST": join_token_digest(token)})
    ACKNOWLEDGED.update({job_id: {0, 1}, reply.result["job_id"]: set()})
    return {"$JOB": job_id, "$JOB2": reply.result["job_id"]}


# ---------------------------------------------------------------------------- requests
VIA = st.sampled_from(["$NODE", "$NODE", "$NODE", "ghost-node", "v" * 64, "a~b"])
REQUEST_CASES = st.one_of(
    st.tuples(st.just("job"), st.one_of(RANDOM, REGISTER_JOBS, mutated(REGISTER_JOBS)), VIA),
    st.tuples(st.just("rank"),
              st.one_of(RANDOM, REGISTER_RANKS, REGISTER_RANKS, mutated(REGISTER_RANKS)), VIA),
    st.tuples(st.just("query"), st.one_of(RANDOM, JOB_QUERIES, mutated(JOB_QUERIES)), st.just("")),
)  # fmt: skip


def _request_subject(endpoint: str, via: str) -> str:
    if endpoint == "job":
        return subjects.coord_register_job(via)
    if endpoint == "rank":
        return subjects.coord_register_rank(via)
    return subjects.coord_job_query()


def expected_request(bus: Bus, endpoint: str, data: bytes, via: str, case: Case) -> set[str]:
    """What the coordinator may answer (independent of its code, from its documented codes)."""
    model = {"job": RegisterJob, "rank": RegisterRank, "query": JobQuery}[endpoint]
    try:
        request: Any = codec.decode(data, model)
    except PayloadError:
        return {"bad_request"}
    if case.bad:
        return set(STABLE_CODES)
    known = bus.call(lambda: {j: r.job for j, r in bus.coord.registry.jobs.items()})
    digests = bus.call(lambda: {j: r.join_digest for j, r in bus.coord.registry.jobs.items()})
    if endpoint == "job":
        allowed = {"PowerLimitOptimizer"}
        if request.power_limit is None:
            allowed.add(bus.coord.pfo.scheduler)
        if request.scheduler not in allowed:
            # A pipeline job names another scheduler than the one run, or a power-limit job
            # names a pipeline scheduler.
            return {"bad_request"}
        return {OK, "quota"}
    if endpoint == "query":
        return {OK} if request.job_id is None or request.job_id in known else {"unknown_job"}
    if subjects.token(via) != subjects.token(request.gpu.node):
        return {"forbidden"}
    job = known.get(request.job_id)
    if job is None:
        return {"unknown_job"}
    digest = digests[request.job_id]
    if digest is not None and (request.join_token is None
                               or join_token_digest(request.join_token) != digest):
        return {"forbidden"}  # Knowing the id is not enough: the rank presents the job's token.
    info = request.rank_info
    if (
        info.rank >= job.world_size
        or info.dp_rank >= job.dp_degree
        or info.pp_rank >= job.pp_degree
        or info.tp_rank >= job.tp_degree
    ):
        return {"out_of_range"}
    return set(STABLE_CODES) | {OK}


@fuzz(150)
@given(request=REQUEST_CASES)
def test_requests_get_coded_replies_and_the_registry_stays_consistent(
    bus: Bus, jobs: dict[str, str], request: tuple[str, Case, str]
):
    endpoint, case, via = request
    mark = bus.mark()
    env = bus.env()
    via = resolve(via, env)
    data = case.encode(env)
    subject = _request_subject(endpoint, via)
    expected = expected_request(bus, endpoint, data, via, case)
    reply = bus.ask(subject, data)
    outcome = OK if reply.ok else reply.code
    assert outcome in expected, (
        f"{subject} answered {outcome!r} ({reply.error[:300]!r}), expected one of "
        f"{sorted(expected)} for {case!r}"
    )
    if not reply.ok:
        assert reply.code in STABLE_CODES, f"unstable code {reply.code!r} for {case!r}"
    elif endpoint == "job":
        ACKNOWLEDGED.setdefault(reply.result["job_id"], set())
    elif endpoint == "rank":
        ACKNOWLEDGED.setdefault(reply.result["job_id"], set()).add(reply.result["rank"])
    bus.check_healthy(mark, f"{subject} {case!r}")


def _rank_columns(job: str, ranks: list[int], gpus: list[int], node: str,
                  token: str | None) -> Case:
    """A node's ranks in columns (`RegisterRankColumns`), each with its GPU's description."""
    n = min(len(ranks), len(gpus))
    return Case("register rank columns", {
        "v": 1, "columns": 1, "job_id": job, "join_token": token, "uid": None, "node": node,
        "rank": ranks[:n], "dp_rank": ranks[:n], "pp_rank": [0] * n, "tp_rank": [0] * n,
        "clocks": [[1740, 210], [7251]], "available_frequencies": [0] * n,
        "gpu_index": gpus[:n], "gpu_uuid": [""] * n, "gpu_job_id": [None] * n,
        "uuid": [f"GPU-{g}" for g in gpus[:n]], "name": ["NVIDIA A40"] * n,
        "architecture": ["Ampere"] * n, "min_power_limit_w": [100] * n,
        "max_power_limit_w": [300] * n, "default_power_limit_w": [300] * n,
        "supported_memory_clocks_mhz": [1] * n, "supported_graphics_clocks_mhz": [0] * n,
        "has_energy_counter": [True] * n, "power_limit_w": [300] * n,
        "schedule_version": [None] * n, "controllable": [True] * n,
        "energy_period_ms": [100.0] * n})  # fmt: skip


RANK_COLUMNS = st.builds(
    _rank_columns, st.sampled_from(["$JOB2", "$JOB2", "$JOB", "no-such-job"]),
    st.lists(st.sampled_from([0, 1, 2, 3, 3, 4, 2**24 - 1]), min_size=1, max_size=3),
    st.lists(st.sampled_from([0, 1, 1, 2, 7]), min_size=1, max_size=3), NODES,
    st.sampled_from(["$TOKEN2", "$TOKEN2", "$TOKEN", None, "a-guessed-token-0000000"]))


@fuzz(60)
@given(case=st.one_of(RANK_COLUMNS, mutated(RANK_COLUMNS)), via=VIA)
def test_rank_columns_get_a_coded_reply_per_rank(bus: Bus, jobs: dict[str, str], case: Case,
                                                 via: str):
    """A node's ranks in columns, near-valid or with one field mutated: refused whole
    (`bad_request`) or answered rank by rank with coded replies, as the same rows would be."""
    mark = bus.mark()
    env = bus.env()
    via = resolve(via, env)
    data = case.encode(env)
    reply = bus.ask(subjects.coord_register_rank(via), data)
    try:
        ranks = decode_registration(data)
    except PayloadError:
        assert (reply.ok, reply.code) == (False, "bad_request"), (reply, case)
    else:
        assert isinstance(ranks, list) and reply.ok, (reply, case)
        replies = [Reply.model_validate(r) for r in reply.result["replies"]]
        assert len(replies) == len(ranks)
        for rank, one in zip(ranks, replies, strict=True):
            if one.ok:
                ACKNOWLEDGED.setdefault(rank.job_id, set()).add(rank.rank_info.rank)
            else:
                assert one.code in STABLE_CODES, (one, case)
    bus.check_healthy(mark, f"rank columns via {via} {case!r}")


def test_acknowledged_registrations_are_on_disk(bus: Bus, jobs: dict[str, str]):
    """What the fuzz got acknowledged is in the registry and in JetStream, as it is."""
    registry = bus.call(lambda: {j: set(r.ranks) for j, r in bus.coord.registry.jobs.items()})
    for job_id, ranks in ACKNOWLEDGED.items():
        assert job_id in registry, f"acknowledged job {job_id!r} is not registered"
        assert ranks <= registry[job_id], f"acknowledged ranks of {job_id!r} are missing"
    durable = bus.run(bus.coord.link.state.read_jobs())
    on_disk = {j: set(r.ranks) for j, r in durable.items()}
    assert on_disk == registry, "the state bucket does not hold the registry"


# ---------------------------------------------------------------------------- streams
BIG = st.sampled_from([2**63 - 1, U64, I64, -1, 10**6])
COUNTER = st.one_of(st.integers(0, 3), BIG)
STEP = st.one_of(st.integers(0, 40), BIG)
STREAM_JOBS = st.sampled_from(["$JOB", "$JOB2", "no-such-job", "j" * 256])
STREAM_RANKS = st.sampled_from([0, 0, 1, 2, -1, 2**24])
STREAM_GPUS = st.sampled_from([0, 0, 1, 5, -1])

TRAINER_EVENTS = st.lists(
    st.fixed_dictionaries(
        {"kind": st.sampled_from(["step_begin", "step_begin", "step_end", "epoch_begin",
                                  "epoch_end", "instruction_begin"]),
         "t_ns": st.one_of(STAMPS, BIG), "epoch": COUNTER, "step": STEP},
        optional={"index": COUNTER, "name": st.sampled_from(["", "forward"])},
    ),
    max_size=6,
)  # fmt: skip
STREAM_DIGESTS = st.sampled_from(["$DIGEST", "$DIGEST", "$DIGEST", "<absent>", None,
                                  "0" * 64, "not-a-digest"])
"""The digest of the join token the bound trainer presented: $JOB's, none, another, bad."""


def _with_digest(message: dict[str, Any], digest: str | None) -> dict[str, Any]:
    return message if digest == "<absent>" else {**message, "join_digest": digest}


EVENT_BATCHES = st.builds(
    lambda job, rank, node, gpu, events, digest: Case(
        "event batch", _with_digest({"v": 1, "job_id": job, "rank": rank, "node": node,
                                     "gpu": gpu, "events": events}, digest)),
    STREAM_JOBS, STREAM_RANKS, NODES, STREAM_GPUS, TRAINER_EVENTS, STREAM_DIGESTS,
)  # fmt: skip
EVENT_DEFAULTS = {"epoch": 0, "step": 0, "index": 0, "name": "", "power_limit_w": None}


def events_as_columns(case: Case) -> Case:
    """An event batch `Case` in columns (`TrainerEventColumns`): what a newer agent sends.

    Values are carried over as they are (a bad one stays bad); a kind no event has is 9.
    """
    obj = {**case.obj}
    events = [{**EVENT_DEFAULTS, **e} for e in obj.pop("events")]
    names: dict[str, int] = {}
    return Case(f"{case.what} in columns", {
        **obj, "columns": 1,
        **{f: [e[f] for e in events] for f in ("t_ns", "epoch", "step", "index",
                                               "power_limit_w")},
        "kind": [EVENT_KINDS.index(e["kind"]) if e["kind"] in EVENT_KINDS else 9
                 for e in events],
        "name": [names.setdefault(e["name"], len(names)) for e in events],
        "names": list(names)})


EVENT_COLUMN_BATCHES = EVENT_BATCHES.map(events_as_columns)
"""The same event batches in columns."""
MARKS = st.lists(
    st.fixed_dictionaries({
        "kind": st.sampled_from(["step_begin", "step_begin", "step_end", "epoch_begin",
                                 "epoch_end"]),
        "epoch": COUNTER, "step": STEP, "t_ns": st.one_of(STAMPS, BIG),
        "energy_j": st.one_of(st.floats(-1e6, 1e9), st.sampled_from([0.0, -1.0, 1e300, -1e300,
                                                                     5e-324])),
    }),
    max_size=4,
)  # fmt: skip
MEASUREMENT_ITEMS = st.lists(
    st.builds(
        lambda kind, name, counters, t0, dt, time_s, energy, schedule: {
            "kind": kind, "name": name, "epoch": counters[0], "step": counters[1],
            "index": counters[2], "t0_ns": t0, "t1_ns": t0 + dt, "time_s": time_s,
            "energy_j": energy, "schedule": schedule},
        st.sampled_from(["step", "instruction", "instruction"]),
        st.sampled_from(["", "forward", "backward"]),
        st.tuples(st.integers(0, 3), st.integers(0, 40), st.integers(0, 3)),
        st.integers(0, 10**15), st.integers(0, 10**9), st.floats(0, 1e3), st.floats(0, 1e9),
        st.sampled_from([None, 0, 3])),
    max_size=3,
)  # fmt: skip
"""Step and instruction measurements, well-formed (`mutated` spoils them): a power-limit job
ignores them, but they are decoded and checked all the same."""
GPU_PARTS = st.lists(
    st.builds(lambda rank, gpu, marks, measurements, digest: _with_digest(
        {"gpu": gpu, "rank": rank, "marks": marks, "measurements": measurements}, digest),
        STREAM_RANKS, STREAM_GPUS, MARKS, st.one_of(st.just([]), MEASUREMENT_ITEMS),
        STREAM_DIGESTS),
    max_size=3,
)  # fmt: skip
MEASUREMENT_BATCHES = st.builds(
    lambda job, node, parts: Case(
        "measurement batch", {"v": 1, "node": node, "job_id": job, "gpus": parts}),
    STREAM_JOBS, NODES, GPU_PARTS,
)  # fmt: skip
"""A node's batch of a job's GPUs' parts (each part its rank, GPU, marks and digest)."""
MARK_COLUMNS = ("epoch", "step", "t_ns", "energy_j")
MEASUREMENT_COLUMNS = ("epoch", "step", "index", "t0_ns", "t1_ns", "time_s", "energy_j",
                       "schedule")


def as_columns(case: Case) -> Case:
    """A measurement batch `Case` in columns (`NodeColumnBatch`): what a newer agent sends.

    Values are carried over as they are (a bad one stays bad); a kind no item has is 9.
    """
    obj = case.obj
    parts = obj["gpus"]
    marks = [m for p in parts for m in p["marks"]]
    measured = [m for p in parts for m in p["measurements"]]
    columns = {f: [m[f] for m in marks] for f in MARK_COLUMNS}
    kinds = [MARK_KINDS.index(m["kind"]) if m["kind"] in MARK_KINDS else 9 for m in marks]
    names: dict[str, int] = {}
    digests = [p.get("join_digest") for p in parts]
    return Case(f"{case.what} in columns", {
        "v": 1, "columns": 1, "node": obj["node"], "job_id": obj["job_id"],
        "gpu": [p["gpu"] for p in parts], "rank": [p["rank"] for p in parts],
        "join_digest": digests, "mark_count": [len(p["marks"]) for p in parts],
        "measurement_count": [len(p["measurements"]) for p in parts],
        "marks": {**columns, "kind": kinds, "power_limit_w": [None] * len(marks)},
        "measurements": {
            **{f: [m[f] for m in measured] for f in MEASUREMENT_COLUMNS},
            "kind": [MEASUREMENT_KINDS.index(m["kind"]) for m in measured],
            "name": [names.setdefault(m["name"], len(names)) for m in measured]},
        "names": list(names)})


COLUMN_BATCHES = MEASUREMENT_BATCHES.map(as_columns)
"""The same batches in columns (a missing digest: None)."""
GPU_DESCRIPTIONS = st.builds(
    lambda index, uuid, limit: {
        "index": index, "uuid": uuid, "name": "NVIDIA A40", "architecture": "Ampere",
        "min_power_limit_w": 100, "max_power_limit_w": 300, "default_power_limit_w": 300,
        "supported_memory_clocks_mhz": [7251], "supported_graphics_clocks_mhz": [1740, 210],
        "has_energy_counter": True, "power_limit_w": limit},
    st.sampled_from([0, 1, 2, -1]), st.sampled_from(["$UUID0", "$UUID1", "GPU-x"]),
    st.sampled_from([100, 200, 300, 0, -5, 10**6]),
)  # fmt: skip
AGENT_HELLOS = st.builds(
    lambda node, agent_id, gpus: Case(
        "agent hello", {"v": 1, "node": node, "agent_id": agent_id, "backend": "sim",
                        "heartbeat_s": 0.5, "socket_path": "/tmp/fuzz.sock", "gpus": gpus}),
    NODES, st.sampled_from(["fuzz-agent", "a" * 256]), st.lists(GPU_DESCRIPTIONS, max_size=3),
)  # fmt: skip

STREAM_CASES = st.one_of(
    st.tuples(st.just("events"), st.one_of(RANDOM, EVENT_BATCHES, EVENT_BATCHES,
                                           mutated(EVENT_BATCHES), EVENT_COLUMN_BATCHES,
                                           mutated(EVENT_COLUMN_BATCHES)), STREAM_JOBS,
              STREAM_RANKS, NODES),
    st.tuples(st.just("meas"), st.one_of(RANDOM, MEASUREMENT_BATCHES, MEASUREMENT_BATCHES,
                                         mutated(MEASUREMENT_BATCHES), COLUMN_BATCHES,
                                         mutated(COLUMN_BATCHES)), STREAM_JOBS,
              STREAM_GPUS, NODES),
    st.tuples(st.just("hello"), st.one_of(RANDOM, AGENT_HELLOS, mutated(AGENT_HELLOS)),
              st.just(""), st.just(""), NODES),
)  # fmt: skip
"""(stream, payload, subject job, subject rank or GPU, subject node)."""

def decoded(stream: str, data: bytes) -> Any:
    """A stream message as the coordinator decodes it (events, a node's batch: either layout)."""
    if stream == "meas":
        return decode_measurements(data)
    if stream == "events":
        return decode_events(data)
    return codec.decode(data, AgentHello)


def gpu_parts(batch: Any) -> list[Any]:
    """A node's batch's parts, in either layout."""
    return batch.parts() if isinstance(batch, NodeColumnBatch) else batch.gpus


def _stream_subject(stream: str, job: str, rank_or_gpu: Any, node: str) -> str:
    if stream == "events":
        return subjects.job_events(job, rank_or_gpu, node)
    if stream == "meas":
        return subjects.job_measurements(job, node)
    return subjects.agent_hello(node)


def _bound_here(bus: Bus, job_id: str, rank: int, node: str, gpu: int | None) -> bool:
    record = bus.coord.registry.jobs.get(job_id)
    rr = record.ranks.get(rank) if record is not None else None
    if rr is None or subjects.token(rr.gpu.node) != node:
        return False
    return gpu is None or rr.gpu.gpu_index == gpu


def _has_token(bus: Bus, job_id: str, digest: str | None) -> bool:
    """Whether `digest` is the job's join token's digest (or the job has none)."""
    expected = bus.coord.registry.jobs[job_id].join_digest
    return expected is None or digest == expected


def _unknown_job_subject(bus: Bus, subject: str) -> bool:
    """Whether `subject` carries events or a node's measurements of no job the coordinator
    knows: it follows only the streams of the jobs it drives, so such messages never reach it
    (nothing is counted)."""
    where = subjects.parse_job_events(subject) or subjects.parse_job_measurements(subject)
    return where is not None and bus.coord.jobs.by_token(where.job) is None


def expected_drop(bus: Bus, stream: str, data: bytes, subject: str) -> tuple[str | None, int]:
    """The reason a stream message must be dropped for ("any": some reason), or None, and how
    many drops it counts (a node's measurement batch: one per GPU's part that fails)."""
    if _unknown_job_subject(bus, subject):
        return None, 0  # Never delivered: nothing to count.
    try:
        message: Any = decoded(stream, data)
    except PayloadError:
        return "malformed", 1
    tokens = subject.split(".")
    if stream == "hello":
        return (None, 0) if subjects.token(message.node) == tokens[-2] else ("any", 1)
    known = message.job_id in bus.coord.registry.jobs
    if not known:
        return "any", 1  # an unknown job
    where = subjects.parse_job_events(subject) or subjects.parse_job_measurements(subject)
    assert where is not None, subject
    if subjects.token(message.job_id) != where.job:
        return "wrong_job", 1  # The payload names another job than its subject.
    if stream == "events":
        if where.node != subjects.token(message.node) or not _bound_here(
            bus, message.job_id, message.rank, where.node, message.gpu
        ) or not _has_token(bus, message.job_id, message.join_digest):
            return "any", 1
        return None, 0
    if where.node != subjects.token(message.node):
        return "wrong_node", 1  # The whole batch: another node's agent.
    if message.job_id not in bus.coord.optimisers:
        return None, 0
    bad = sum(
        1 for part in gpu_parts(message)
        if (part.marks or part.measurements) and (
            not _bound_here(bus, message.job_id, part.rank, where.node, part.gpu)
            or not _has_token(bus, message.job_id, part.join_digest))
    )  # fmt: skip
    return ("any", bad) if bad else (None, 0)


def _publish_stream(bus: Bus, stream_case: tuple[Any, ...]) -> tuple[str, bytes, str, Case]:
    stream, case, job, rank_or_gpu, node = stream_case
    env = bus.env()
    subject = _stream_subject(stream, resolve(job, env), rank_or_gpu, resolve(node, env))
    return stream, case.encode(env), subject, case


def publish_and_settle(bus: Bus, subject: str, data: bytes, malformed: bool) -> dict[str, int]:
    """Publish `data` then the barrier; return how the drop counters moved (barrier excluded).

    On a subject of no known job's events or measurements (which the coordinator does not
    follow), the barrier goes to a GPU's error subject (counted "malformed" there) and the
    message is delivered to nobody.
    """
    barrier, elsewhere = "malformed", None
    if bus.call(_unknown_job_subject, bus, subject):
        elsewhere, malformed = subjects.gpu_errors(bus.node, 0), False
    before, after = publish_with_barrier(bus, subject, data, barrier, int(malformed), 2,
                                         0.002, elsewhere)  # what moved tells the rest
    moved = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    moved[barrier] = moved.get(barrier, 0) - 1
    return {k: v for k, v in moved.items() if v}


def _malformed(data: bytes, stream: str) -> bool:
    try:
        decoded(stream, data)
    except PayloadError:
        return True
    return False


@fuzz(150)
@given(stream_case=STREAM_CASES)
def test_streams_never_answer_never_crash_and_count_malformed(
    bus: Bus, jobs: dict[str, str], stream_case: tuple[Any, ...]
):
    stream, data, subject, case = _publish_stream(bus, stream_case)
    mark = bus.mark()
    if bus.call(_unknown_job_subject, bus, subject):  # Followed by no replica: not delivered.
        moved = publish_and_settle(bus, subject, data, True)
        assert moved == {}, f"{subject} {case!r}: the drops moved by {moved}"
        bus.check_healthy(mark, f"{subject} {case!r}")
        return
    malformed = _malformed(data, stream)
    moved = publish_and_settle(bus, subject, data, malformed)
    assert moved.get("malformed", 0) == malformed, (
        f"'malformed' drops moved by {moved.get('malformed', 0)} for {subject} {case!r} "
        f"(malformed: {malformed})"
    )
    bus.check_healthy(mark, f"{subject} {case!r}")


ACCOUNTING_CASES = st.one_of(
    st.tuples(st.just("events"), EVENT_BATCHES | mutated(EVENT_BATCHES), STREAM_JOBS,
              STREAM_RANKS, NODES),
    st.tuples(st.just("meas"), MEASUREMENT_BATCHES | mutated(MEASUREMENT_BATCHES)
              | COLUMN_BATCHES | mutated(COLUMN_BATCHES), STREAM_JOBS, STREAM_GPUS, NODES),
    st.tuples(st.just("hello"), AGENT_HELLOS, st.just(""), st.just(""), NODES),
)  # fmt: skip
"""Mostly well-formed stream messages, about known and unknown jobs, ranks and nodes."""


def _events(job: str, rank: int, node: str) -> Case:
    event = {"kind": "step_begin", "t_ns": "$NOW", "epoch": 0, "step": 1}
    return Case("event batch", {"v": 1, "job_id": job, "rank": rank, "node": node, "gpu": rank,
                                "events": [event], "join_digest": "$DIGEST"})  # fmt: skip


def _marks(job: str, node: str, *parts: tuple[int, int, bool]) -> Case:
    """A node's batch of `job` with a part per (rank, GPU, with a mark or empty)."""
    mark = {"kind": "step_begin", "epoch": 0, "step": 1, "t_ns": "$NOW", "energy_j": 5.0}
    return Case("measurement batch", {"v": 1, "node": node, "job_id": job, "gpus": [
        {"gpu": gpu, "rank": rank, "marks": [mark] if marks else [], "measurements": [],
         "join_digest": "$DIGEST"} for rank, gpu, marks in parts]})  # fmt: skip


@fuzz(100)
@example(stream_case=("events", _events("no-such-job", 0, "$NODE"), "no-such-job", 0, "$NODE"))
@example(stream_case=("events", _events("$JOB", 3, "$NODE"), "$JOB", 3, "$NODE"))
@example(stream_case=("events", _events("$JOB", 0, "ghost-node"), "$JOB", 0, "ghost-node"))
@example(stream_case=("events", _events("$JOB", 0, "$NODE"), "$JOB", 0, "ghost-node"))
@example(stream_case=("meas", _marks("no-such-job", "$NODE", (0, 0, True)), "$JOB", 0, "$NODE"))
@example(stream_case=("meas", _marks("no-such-job", "$NODE", (0, 0, True)), "no-such-job", 0,
                      "$NODE"))
@example(stream_case=("meas", _marks("$JOB", "$NODE", (0, 0, False)), "$JOB", 0, "$NODE"))
@example(stream_case=("meas", _marks("$JOB", "$NODE", (3, 0, True)), "$JOB", 0, "$NODE"))
@example(stream_case=("meas", _marks("$JOB", "$NODE", (0, 1, True)), "$JOB", 0, "$NODE"))
@example(stream_case=("meas", _marks("$JOB", "$NODE", (0, 1, True), (1, 1, True), (1, 0, True)),
                      "$JOB", 0, "$NODE"))  # the good part counts, the two others are dropped
@example(stream_case=("meas", _marks("$JOB", "$NODE", (0, 0, True)), "$JOB", 0, "ghost-node"))
@example(stream_case=("meas", as_columns(_marks("$JOB", "$NODE", (0, 1, True), (1, 1, True),
                                                (1, 0, True))), "$JOB", 0, "$NODE"))
@example(stream_case=("meas", as_columns(_marks("$JOB", "$NODE", (0, 0, True))), "$JOB", 0,
                      "ghost-node"))
@example(stream_case=("meas", as_columns(_marks("$JOB", "$NODE", (3, 0, True), (0, 0, False))),
                      "$JOB", 0, "$NODE"))
@example(stream_case=("meas", _marks("$JOB", "$NODE", (0, 0, True)), "$JOB2", 0, "$NODE"))
@example(
    stream_case=(
        "hello",
        Case(
            "agent hello",
            {
                "v": 1,
                "node": "$NODE",
                "agent_id": "spoof",
                "backend": "sim",
                "heartbeat_s": 1.0,
                "socket_path": "/x",
                "gpus": [],
            },
        ),
        "",
        "",
        "ghost-node",
    )
)
@given(stream_case=ACCOUNTING_CASES)
def test_streams_count_unknown_jobs_ranks_and_spoofed_nodes(
    bus: Bus, jobs: dict[str, str], stream_case: tuple[Any, ...]
):
    stream, data, subject, case = _publish_stream(bus, stream_case)
    reason, count = bus.call(expected_drop, bus, stream, data, subject)
    moved = publish_and_settle(bus, subject, data, reason == "malformed")
    if reason is None:
        assert not moved, f"{subject} {case!r} is a valid message but was dropped: {moved}"
    else:
        assert sum(moved.values()) == count, (
            f"{subject} {case!r} must be dropped and counted {count} time(s) (expected reason: "
            f"{reason}); the drop counters moved by {moved}"
        )
        if reason != "any":
            assert moved.get(reason) == count, f"{case!r} counted as {moved}, not {reason!r}"


CONCURRENT_RANKS = st.lists(
    st.tuples(st.integers(0, 4), st.sampled_from([0, 1, 0, 1, 3]),
              st.sampled_from(["", "", "$UUID0", "$UUID1"])),
    min_size=2, max_size=8,
)  # fmt: skip


RACES = itertools.count()


@fuzz(30)
@given(requests=CONCURRENT_RANKS)
def test_concurrent_rank_registrations_keep_one_rank_per_gpu(
    bus: Bus, jobs: dict[str, str], requests: list[tuple[int, int, str]]
):
    """Registrations racing for the ranks and GPUs of a fresh job (dp4): each rank and each
    GPU is taken once, what was acknowledged is what is registered, refusals are coded."""
    mark = bus.mark()
    env = bus.env()
    job = {"v": 1, "job": {"dp_degree": 4, "pp_degree": 1, "tp_degree": 1, "world_size": 4,
                           "job_metadata": "race"}}  # fmt: skip
    # Through a node of its own (jobs are counted per node: the quota is not under test).
    reply = bus.ask(subjects.coord_register_job(f"race-{next(RACES)}"), codec.encode(job))
    assert reply.ok, reply
    job_id, token = reply.result["job_id"], reply.result["join_token"]
    payloads = [
        _rank_request(job_id, rank, bus.node, gpu, resolve(uuid, env), token)
        for rank, gpu, uuid in requests
    ]
    subject = subjects.coord_register_rank(bus.node)

    async def race() -> list[Any]:
        import asyncio

        return await asyncio.gather(*(bus.nc.request(subject, codec.encode(p), timeout=5)
                                      for p in payloads))  # fmt: skip

    replies = [codec.decode(m.data, Reply) for m in bus.run(race())]
    registered = bus.call(
        lambda: {
            r: (rr.gpu.gpu_index, rr.gpu.gpu_uuid)
            for r, rr in bus.coord.registry.jobs[job_id].ranks.items()
        }
    )
    for payload, reply in zip(payloads, replies, strict=True):
        rank, gpu = payload["rank_info"]["rank"], payload["gpu"]["gpu_index"]
        if reply.ok:
            assert registered.get(rank, (None,))[0] == gpu, (
                f"rank {rank} on GPU {gpu} was acknowledged but the registry has "
                f"{registered.get(rank)} ({requests})"
            )
        else:
            assert reply.code in {"duplicate", "out_of_range", "unavailable", "conflict"}, (
                f"rank {rank} on GPU {gpu}: {reply.code} {reply.error[:200]} ({requests})"
            )
    gpus = [gpu for gpu, _uuid in registered.values()]
    assert len(gpus) == len(set(gpus)), f"two ranks on one GPU: {registered} ({requests})"
    acknowledged = {p["rank_info"]["rank"] for p, r in zip(payloads, replies, strict=True) if r.ok}
    assert acknowledged == set(registered), f"{acknowledged} != {registered} ({requests})"
    bus.check_healthy(mark, f"racing registrations {requests}")


def _rank_request(job_id: str, rank: int, node: str, gpu: int, uuid: str,
                  token: str) -> dict[str, Any]:
    return {"v": 1, "job_id": job_id, "join_token": token,
            "rank_info": {"rank": rank, "dp_rank": rank, "pp_rank": 0, "tp_rank": 0,
                          "available_frequencies": [1740, 210]},
            "gpu": {"node": node, "gpu_index": gpu, "gpu_uuid": uuid}}  # fmt: skip


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


OPTIONS = st.fixed_dictionaries({}, optional={
    "selector": st.sampled_from(["Energy", "Time", "ZeusCost", "MaxSlowdownConstraint"]),
    "eta_knob": st.sampled_from([0.0, 0.5, 1.0]),
    "world_size": st.sampled_from([None, 1, 2, 10**6]),
    "max_slowdown": st.sampled_from([1.0, 1.1, 1e300]),
    "wait_steps": st.sampled_from([0, 1]),
    "warmup_steps": st.sampled_from([0, 1]),
    "profile_steps": st.sampled_from([1, 2]),
    "pl_step_w": st.sampled_from([1, 50, 100, 200, 10**9]),
    "search": st.sampled_from(["exhaustive", "adaptive"]),
    "profile": st.none() | PROFILE_ROWS | st.integers(1, 256).map(
        lambda n: [{"power_limit": 300 - (i % 201), "energy": 1.0 + i, "time": 1.0 + i / n}
                   for i in range(n)]),
})  # fmt: skip
ENERGY_STEPS = st.lists(
    st.tuples(st.one_of(st.floats(0, 1e4), st.sampled_from([0.0, -5.0, 1e300, -1e300, 5e-324])),
              st.sampled_from([0, 1, 1_000, 10**8, 10**12])),
    max_size=8,
)  # fmt: skip


@fuzz(40)
@given(options=OPTIONS, gpu=st.sampled_from([0, 1]), steps=ENERGY_STEPS)
def test_optimisers_start_and_run_safely_on_any_options_and_measurements(
    bus: Bus,
    jobs: dict[str, str],
    statuses: list[JobStatus],
    options: dict[str, Any],
    gpu: int,
    steps: list[tuple[float, int]],
):
    """A one-rank job with fuzzed optimiser options (loaded profiles too, in range or not) on
    one of the agent's GPUs, driven by step events and marks with any energies and times: the
    optimiser starts or refuses with a status, nothing crashes, the GPUs stay safe."""
    mark = bus.mark()
    job = {"v": 1, "job": {"dp_degree": 1, "pp_degree": 1, "tp_degree": 1, "world_size": 1,
                           "job_metadata": "opt"}, "power_limit": options}  # fmt: skip
    reply = bus.ask(subjects.coord_register_job(f"opt-{next(RACES)}"), codec.encode(job))
    if not reply.ok:
        assert reply.code in STABLE_CODES, reply
        return
    job_id, token = reply.result["job_id"], reply.result["join_token"]
    rank = _rank_request(job_id, 0, bus.node, gpu, "", token)
    reply = bus.ask(subjects.coord_register_rank(bus.node), codec.encode(rank))
    assert reply.ok, reply
    wait_for(lambda: any(s.job_id == job_id and s.state not in ("registered", "rank_registered")
                         for s in list(statuses)), 3,
             lambda: f"the optimiser of {options} never reported", interval_s=0.005)
    # Stamps and counters within the contract's bounds (monotonic, so >= 0); a counter may
    # still go back, jump or overflow to 1e308.
    t, energy = max(0, time.monotonic_ns() - 10**13), 0.0
    events, marks = [], []
    for step, (joules, dt) in enumerate(steps):
        t += dt
        energy = max(0.0, energy + joules)
        events.append({"kind": "step_begin", "t_ns": t, "epoch": 0, "step": step})
        marks.append(
            {
                "kind": "step_begin",
                "epoch": 0,
                "step": step,
                "t_ns": t,
                "energy_j": energy if abs(energy) < 1e308 else 1e308,
            }
        )
    digest = join_token_digest(token)  # as the agent of the rank's HELLO (with it) sends it
    batch = {"v": 1, "job_id": job_id, "rank": 0, "node": bus.node, "gpu": gpu,
             "events": events, "join_digest": digest}  # fmt: skip
    meas = {"v": 1, "node": bus.node, "job_id": job_id, "gpus": [
        {"gpu": gpu, "rank": 0, "marks": marks, "join_digest": digest}]}
    moved = publish_and_settle(bus, subjects.job_events(job_id, 0, bus.node), codec.encode(batch),
                               False)  # fmt: skip
    assert not moved, f"valid events were dropped: {moved}"
    moved = publish_and_settle(bus, subjects.job_measurements(job_id, bus.node),
                               codec.encode(meas), False)
    assert not moved, f"valid marks were dropped: {moved}"
    bus.check_healthy(mark, f"options {options}, steps {steps}")


def test_the_job_list_is_answered_with_thousands_of_jobs(bus: Bus, jobs: dict[str, str]):
    """6,000 jobs (the default max_jobs is 10,000) with the longest metadata: `jobs.query`
    still answers (the list, bounded, or a coded refusal), and so do single-job queries.
    Last in the module: it leaves the jobs registered."""
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

    async def register(first: int, n: int) -> None:
        import asyncio

        await asyncio.gather(*(bus.nc.request(subjects.coord_register_job(f"many-{i % 1000}"),
                                              job, timeout=60)
                               for i in range(first, first + n)))  # fmt: skip

    while (held := bus.call(lambda: len(bus.coord.registry.jobs))) < 6000:
        bus.run(register(held, min(1000, 6000 - held)), 120)
    try:
        reply = bus.ask(subjects.coord_job_query(), codec.encode(JobQuery()))
    except Exception as e:  # noqa: BLE001 - no answer at all is the failure
        raise AssertionError(
            f"jobs.query got no answer within 3 s with 6,000 jobs: {type(e).__name__} {e}"
        ) from None
    assert reply.ok or reply.code in STABLE_CODES, reply
    one = bus.ask(subjects.coord_job_query(), codec.encode(JobQuery(job_id=jobs["$JOB"])))
    assert one.ok, one
