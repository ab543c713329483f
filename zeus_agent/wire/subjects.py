"""NATS subject names, built by pure functions (one owner per subject).

Every subject starts with a configurable prefix (default "zeus") so tenants can share a NATS.
Tokens that come from users (node names, job ids) go through `token()`: a value made only of
safe characters (letters, digits, `-_+=:@,`) and at most `MAX_TOKEN_CHARS` long is used as is;
any other value becomes a readable head plus a digest of the whole value. So a user string can
never widen a subscription, split a subject, or make a subject long enough for nats-server to
close the connection (its control line is limited to 4 KiB), and two different values never
share a token.

Subjects a node's agent publishes or requests on carry the node's token
(`jobs.register.<node>`, `ev.<rank>.<node>`, `meas.<node>`), so NATS permissions can confine an
agent's credentials to its own node and the coordinator knows which node a request came through
(`deploy/nats/`, `permissions.py`).

| function | subject | from -> to |
|---|---|---|
| `agent_hello` | `<p>.agent.<node>.hello` | agent -> all: GPUs, heartbeat |
| `agent_errors` | `<p>.agent.<node>.error` | agent ->: bad datagrams, gone trainers |
| `node_command` | `<p>.agent.<node>.cmd` | -> agent, request/reply: several GPUs' commands |
| `gpu_samples` | `<p>.gpu.<node>.<gpu>.sample` | agent ->: batched samples |
| `gpu_command` | `<p>.gpu.<node>.<gpu>.cmd` | -> agent, request/reply |
| `gpu_errors` | `<p>.gpu.<node>.<gpu>.error` | agent ->: schedule mismatches |
| `lease_renewal` | `<p>.lease.<holder>` | coordinator -> agents: renew leases |
| `coord_register_job` | `<p>.coord.jobs.register.<node>` | agent -> coordinator, req/reply |
| `coord_register_rank` | `<p>.coord.ranks.register.<node>` | agent -> coordinator, req/reply |
| `coord_job_query` | `<p>.coord.jobs.query` | anyone -> coordinator, req/reply |
| `coord_job_straggler` | `<p>.coord.jobs.straggler` | operator -> coordinator, req/reply |
| `replica_alive` | `<p>.coord.replica.<replica>.alive` | replica -> replicas: roster |
| `job_events` | `<p>.job.<job>.ev.<rank>.<node>` | agent ->: batched trainer events |
| `job_measurements` | `<p>.job.<job>.meas.<node>` | agent ->: a node's marks and measurements |
| `job_status` | `<p>.job.<job>.status` | coordinator ->: state and progress |

The parsers (`parse_job_events`, `parse_job_measurements`, `parse_gpu_subject`,
`parse_agent_hello`) read the tokens
back from a subject a wildcard subscription delivered, counting from its end (the prefix may
hold dots); they return None for a subject of another shape.
"""

from __future__ import annotations

import functools
import hashlib
import re
from typing import NamedTuple

DEFAULT_PREFIX = "zeus"
MAX_TOKEN_CHARS = 64
"""Longest token used verbatim; longer values are shortened to a head plus a digest."""
MAX_PREFIX_CHARS = 64
_SAFE = re.compile(r"[A-Za-z0-9_\-+=:@,]+")
_UNSAFE = re.compile(r"[^A-Za-z0-9_\-+=:@,]")
_PREFIX = re.compile(r"[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*")
_HEAD_CHARS = 40
_DIGEST_CHARS = 16


def token(value: str | int) -> str:
    """Make a user-supplied value safe and short as one NATS subject token.

    A value of safe characters (letters, digits, `-_+=:@,`) up to `MAX_TOKEN_CHARS` long is
    its own token. Anything else becomes `<head>~<digest>`: the first characters with unsafe
    ones replaced by "_", then 16 hex digits of the SHA-256 of the whole value, so the token
    stays short and two different values do not share one ("~" never appears in a verbatim
    token). An empty value becomes "_".
    """
    if isinstance(value, str) and type(value) is str and len(value) <= _CACHED_CHARS \
            or type(value) is int:
        return _token(value)  # (Subjects are built per message: the same nodes, again.)
    return _make_token(value)


_CACHED_CHARS = 256
"""Strings up to this long (and ints: GPU indices) have their tokens cached (the cache's
memory stays bounded)."""


def _make_token(value: str | int) -> str:
    """`token`'s work."""
    text = str(value)
    if not text:
        return "_"
    if len(text) <= MAX_TOKEN_CHARS and _SAFE.fullmatch(text):
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:_DIGEST_CHARS]
    return f"{_UNSAFE.sub('_', text[:_HEAD_CHARS])}~{digest}"


_token = functools.lru_cache(maxsize=16384)(_make_token)


@functools.lru_cache(maxsize=64)
def check_prefix(prefix: str) -> str:
    """Return `prefix` if it is a valid subject prefix.

    Raises:
        ValueError: Empty, too long, or not dot-separated tokens of letters, digits, "-", "_".
    """
    if not prefix or len(prefix) > MAX_PREFIX_CHARS or not _PREFIX.fullmatch(prefix):
        raise ValueError(
            f"invalid subject prefix {prefix!r}: use up to {MAX_PREFIX_CHARS} letters, digits, "
            "'-' and '_' (dots may separate tokens), e.g. 'zeus' or 'zeus-prod'"
        )
    return prefix


_p = check_prefix


def agent_hello(node: str, prefix: str = DEFAULT_PREFIX) -> str:
    """Subject on which an agent announces its GPUs and heartbeats."""
    return f"{_p(prefix)}.agent.{token(node)}.hello"


def agent_power(node: str, prefix: str = DEFAULT_PREFIX) -> str:
    """Subject of a node's GPUs' latest power draw (`NodePower`)."""
    return f"{_p(prefix)}.agent.{token(node)}.power"


def agent_errors(node: str, prefix: str = DEFAULT_PREFIX) -> str:
    """Subject of a node agent's error events (bad datagrams, dead trainers)."""
    return f"{_p(prefix)}.agent.{token(node)}.error"


def node_command(node: str, prefix: str = DEFAULT_PREFIX) -> str:
    """Request/reply subject of a node's command batches (`NodeCommandBatch`)."""
    return f"{_p(prefix)}.agent.{token(node)}.cmd"


def parse_node_command_of(gpu_command_subject: str) -> tuple[str, int] | None:
    """The `node_command` subject of a `gpu_command` subject, and its GPU index; or None.

    Built from the subject's own tokens (its prefix and node token as they are), so the node's
    batches go to the agent that serves the GPU's subject.
    """
    parts = gpu_command_subject.rsplit(".", 4)
    if len(parts) != 5 or parts[1] != "gpu" or parts[4] != "cmd":
        return None
    gpu = parts[3]
    if not (gpu.isascii() and gpu.isdigit()):
        return None
    return f"{parts[0]}.agent.{parts[2]}.cmd", int(gpu)


def _gpu(node: str, gpu: int | str, leaf: str, prefix: str) -> str:
    return f"{_p(prefix)}.gpu.{token(node)}.{token(gpu)}.{leaf}"


def gpu_samples(node: str, gpu: int | str, prefix: str = DEFAULT_PREFIX) -> str:
    """Subject of a GPU's batched samples."""
    return _gpu(node, gpu, "sample", prefix)


def gpu_command(node: str, gpu: int | str, prefix: str = DEFAULT_PREFIX) -> str:
    """Request/reply subject of a GPU's commands."""
    return _gpu(node, gpu, "cmd", prefix)


def gpu_errors(node: str, gpu: int | str, prefix: str = DEFAULT_PREFIX) -> str:
    """Subject of a GPU's rank errors (schedule mismatch, measurement gaps)."""
    return _gpu(node, gpu, "error", prefix)


def lease_renewal(holder: str, prefix: str = DEFAULT_PREFIX) -> str:
    """Subject on which a lease holder renews all of its leases.

    Only the agents holding one of them follow it: a renewal reaches its job's nodes, not the
    whole cluster.
    """
    return f"{_p(prefix)}.lease.{token(holder)}"


def coord_register_job(node: str, prefix: str = DEFAULT_PREFIX) -> str:
    """Request/reply subject on which `node`'s agent registers its trainers' jobs."""
    return f"{_p(prefix)}.coord.jobs.register.{token(node)}"


def coord_register_rank(node: str, prefix: str = DEFAULT_PREFIX) -> str:
    """Request/reply subject on which `node`'s agent registers its trainers' ranks."""
    return f"{_p(prefix)}.coord.ranks.register.{token(node)}"


def all_coord_register_job(prefix: str = DEFAULT_PREFIX) -> str:
    """Job registrations from every node: `<p>.coord.jobs.register.*`."""
    return f"{_p(prefix)}.coord.jobs.register.*"


def all_coord_register_rank(prefix: str = DEFAULT_PREFIX) -> str:
    """Rank registrations from every node: `<p>.coord.ranks.register.*`."""
    return f"{_p(prefix)}.coord.ranks.register.*"


def coord_job_query(prefix: str = DEFAULT_PREFIX) -> str:
    """Request/reply subject to ask the coordinator about a job."""
    return f"{_p(prefix)}.coord.jobs.query"


def coord_job_straggler(prefix: str = DEFAULT_PREFIX) -> str:
    """Request/reply subject of straggler notices about a pipeline job (`StragglerNotice`)."""
    return f"{_p(prefix)}.coord.jobs.straggler"


def coord_budget(prefix: str = DEFAULT_PREFIX) -> str:
    """Request/reply subject of power budgets (`BudgetRequest`), for the operator role."""
    return f"{_p(prefix)}.coord.budget"


def budget_status(budget_id: str, prefix: str = DEFAULT_PREFIX) -> str:
    """Subject of a budget's status, published by the replica applying it."""
    return f"{_p(prefix)}.budget.{token(budget_id)}.status"


def all_budget_status(prefix: str = DEFAULT_PREFIX) -> str:
    """Wildcard over every budget's status."""
    return f"{_p(prefix)}.budget.*.status"


def coord_replica(replica: str, endpoint: str, prefix: str = DEFAULT_PREFIX) -> str:
    """Request/reply subject of one coordinator replica (`query`, `straggler`).

    A replica that does not own a job forwards requests about it to its owner.
    """
    return f"{_p(prefix)}.coord.replica.{token(replica)}.{token(endpoint)}"


def all_coord_replicas(prefix: str = DEFAULT_PREFIX) -> str:
    """Every replica's own request subjects: `<p>.coord.replica.>`."""
    return f"{_p(prefix)}.coord.replica.>"


def replica_alive(replica: str, prefix: str = DEFAULT_PREFIX) -> str:
    """Where a coordinator replica announces itself (`ReplicaAlive`, every `lease_s / 3`).

    The replicas share the jobs out among those they hear (`coordinator.state.assignment`).
    """
    return f"{_p(prefix)}.coord.replica.{token(replica)}.alive"


def all_replica_alive(prefix: str = DEFAULT_PREFIX) -> str:
    """Every replica's announcements: `<p>.coord.replica.*.alive`."""
    return f"{_p(prefix)}.coord.replica.*.alive"


def job_events(job_id: str, rank: int | str, node: str, prefix: str = DEFAULT_PREFIX) -> str:
    """Subject of a rank's batched trainer events, as relayed by `node`'s agent."""
    return f"{_p(prefix)}.job.{token(job_id)}.ev.{token(rank)}.{token(node)}"


def job_measurements(job_id: str, node: str, prefix: str = DEFAULT_PREFIX) -> str:
    """Subject of the marks and measurements of `job_id`'s ranks on `node`'s GPUs.

    One `NodeMeasurementBatch` per job per flush; the node is the last token, so an agent's
    credentials can be confined to its own node's.
    """
    return f"{_p(prefix)}.job.{token(job_id)}.meas.{token(node)}"


def job_status(job_id: str, prefix: str = DEFAULT_PREFIX) -> str:
    """Subject of a job's status events."""
    return f"{_p(prefix)}.job.{token(job_id)}.status"


# Wildcards for subscribers of every node, GPU, job or holder (tokens above never produce them).
def all_gpu_errors(prefix: str = DEFAULT_PREFIX) -> str:
    """Every GPU's rank errors: `<p>.gpu.*.*.error`."""
    return f"{_p(prefix)}.gpu.*.*.error"


def all_job_measurements(prefix: str = DEFAULT_PREFIX) -> str:
    """Every job's measurements from every node: `<p>.job.*.meas.*`."""
    return f"{_p(prefix)}.job.*.meas.*"


def all_node_measurements(node: str, prefix: str = DEFAULT_PREFIX) -> str:
    """Every job's measurements from one node: `<p>.job.*.meas.<node>` (its GPUs' observers)."""
    return f"{_p(prefix)}.job.*.meas.{token(node)}"


def all_agent_hellos(prefix: str = DEFAULT_PREFIX) -> str:
    """Every agent's announcements: `<p>.agent.*.hello`."""
    return f"{_p(prefix)}.agent.*.hello"


def all_agent_power(prefix: str = DEFAULT_PREFIX) -> str:
    """Every node's power readings: `<p>.agent.*.power`."""
    return f"{_p(prefix)}.agent.*.power"


def all_gpu_commands(prefix: str = DEFAULT_PREFIX) -> str:
    """Every GPU's command subject: `<p>.gpu.*.*.cmd`."""
    return f"{_p(prefix)}.gpu.*.*.cmd"


def all_node_commands(prefix: str = DEFAULT_PREFIX) -> str:
    """Every node's command-batch subject: `<p>.agent.*.cmd`."""
    return f"{_p(prefix)}.agent.*.cmd"


def all_events_of_job(job_id: str, prefix: str = DEFAULT_PREFIX) -> str:
    """Every rank's trainer events of one job: what its owning replica follows."""
    return f"{_p(prefix)}.job.{token(job_id)}.ev.*.*"


def all_measurements_of_job(job_id: str, prefix: str = DEFAULT_PREFIX) -> str:
    """Every node's measurements of one job: `<p>.job.<job>.meas.*` (a per-job subscription)."""
    return f"{_p(prefix)}.job.{token(job_id)}.meas.*"


def all_job_events(prefix: str = DEFAULT_PREFIX) -> str:
    """Every rank's trainer events: `<p>.job.*.ev.*.*`."""
    return f"{_p(prefix)}.job.*.ev.*.*"


def last_token(subject: str) -> str:
    """The last token of a subject (e.g. the node of `jobs.register.<node>`)."""
    return subject.rsplit(".", 1)[-1]


def inbox_prefix(role: str, name: str = "", prefix: str = DEFAULT_PREFIX) -> str:
    """Reply inbox prefix of a client: `_INBOX.<p>.<role>[.<name>]`.

    Agents use role "node" and their node's name, so NATS permissions can give each agent
    only its own replies (nats-py's default `_INBOX.>` would let it read everybody's).
    """
    tail = f".{token(name)}" if name else ""
    return f"_INBOX.{_p(prefix)}.{token(role)}{tail}"


def all_job_status(prefix: str = DEFAULT_PREFIX) -> str:
    """Every job's status: `<p>.job.*.status`."""
    return f"{_p(prefix)}.job.*.status"


def all_lease_renewals(prefix: str = DEFAULT_PREFIX) -> str:
    """Every holder's lease renewals: `<p>.lease.*` (what an agent may subscribe to)."""
    return f"{_p(prefix)}.lease.*"


def agent_ping(prefix: str = DEFAULT_PREFIX) -> str:
    """Ask every agent to announce itself now: `<p>.agent.ping`."""
    return f"{_p(prefix)}.agent.ping"


def state_buckets(prefix: str = DEFAULT_PREFIX) -> tuple[str, str]:
    """JetStream KV buckets of the coordinators of `prefix`: (state, ownership leases).

    Bucket names allow letters, digits, `_` and `-`; other characters of the prefix become `_`.
    """
    base = "zeus-state-" + re.sub(r"[^A-Za-z0-9_-]", "_", prefix)
    return base, base + "-owners"


class JobEventsSubject(NamedTuple):
    """Tokens of `<p>.job.<job>.ev.<rank>.<node>`."""

    job: str
    rank: str
    node: str


class JobMeasurementsSubject(NamedTuple):
    """Tokens of `<p>.job.<job>.meas.<node>`."""

    job: str
    node: str


class GpuSubject(NamedTuple):
    """Tokens of `<p>.gpu.<node>.<gpu>.<leaf>` (`leaf`: sample, cmd, error)."""

    node: str
    gpu: str
    leaf: str

    @property
    def gpu_index(self) -> int | None:
        """The GPU token as an index (None unless ASCII digits: "²" is a digit to `isdigit`)."""
        return int(self.gpu) if self.gpu.isascii() and self.gpu.isdigit() else None


def parse_job_events(subject: str) -> JobEventsSubject | None:
    """The tokens of a `job_events` subject, or None."""
    parts = subject.rsplit(".", 5)
    if len(parts) != 6 or parts[1] != "job" or parts[3] != "ev":
        return None
    return JobEventsSubject(parts[2], parts[4], parts[5])


def parse_job_measurements(subject: str) -> JobMeasurementsSubject | None:
    """The tokens of a `job_measurements` subject, or None."""
    parts = subject.rsplit(".", 4)
    if len(parts) != 5 or parts[1] != "job" or parts[3] != "meas":
        return None
    return JobMeasurementsSubject(parts[2], parts[4])


def parse_gpu_subject(subject: str) -> GpuSubject | None:
    """The tokens of a `gpu_*` subject (samples, commands, errors), or None."""
    parts = subject.rsplit(".", 4)
    if len(parts) != 5 or parts[1] != "gpu":
        return None
    return GpuSubject(parts[2], parts[3], parts[4])


def parse_agent_hello(subject: str) -> str | None:
    """The node token of an `agent_hello` subject, or None."""
    return _agent_node(subject, "hello")


def parse_agent_power(subject: str) -> str | None:
    """The node token of an `agent_power` subject, or None."""
    return _agent_node(subject, "power")


def _agent_node(subject: str, leaf: str) -> str | None:
    parts = subject.rsplit(".", 3)
    if len(parts) != 4 or parts[1] != "agent" or parts[3] != leaf:
        return None
    return parts[2]
