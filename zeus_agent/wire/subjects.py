"""NATS subject names, built by pure functions (one owner per subject).

Every subject starts with a configurable prefix (default "zeus") so tenants can share a NATS.
Tokens that come from users (node names, job ids) go through `token()`, which replaces the
characters NATS reserves (".", "*", ">", white space) so a user string can never widen a
subscription or split a subject.

| function | subject | from -> to |
|---|---|---|
| `agent_hello` | `<p>.agent.<node>.hello` | agent -> all: GPUs, heartbeat |
| `agent_errors` | `<p>.agent.<node>.error` | agent ->: bad datagrams, gone trainers |
| `gpu_samples` | `<p>.gpu.<node>.<gpu>.sample` | agent ->: batched samples |
| `gpu_command` | `<p>.gpu.<node>.<gpu>.cmd` | -> agent, request/reply |
| `gpu_measurements` | `<p>.gpu.<node>.<gpu>.meas` | agent ->: marks, step/instr. time+energy |
| `gpu_errors` | `<p>.gpu.<node>.<gpu>.error` | agent ->: schedule mismatches |
| `lease_renewal` | `<p>.lease.<holder>` | coordinator -> agents: renew leases |
| `coord_register_job` | `<p>.coord.jobs.register` | agent -> coordinator, req/reply |
| `coord_register_rank` | `<p>.coord.ranks.register` | agent -> coordinator, req/reply |
| `coord_job_query` | `<p>.coord.jobs.query` | anyone -> coordinator, req/reply |
| `job_events` | `<p>.job.<job>.ev.<rank>` | agent ->: batched trainer events |
| `job_schedule` | `<p>.job.<job>.sched.<rank>` | coordinator ->: a rank's schedule |
| `job_status` | `<p>.job.<job>.status` | coordinator ->: state and progress |
"""

from __future__ import annotations

import re

DEFAULT_PREFIX = "zeus"
_RESERVED = re.compile(r"[.*>\s]")


def token(value: str | int) -> str:
    """Make a user-supplied value safe as one NATS subject token.

    ".", "*", ">" and white space become "_"; an empty value becomes "_".
    """
    text = _RESERVED.sub("_", str(value))
    return text or "_"


def _p(prefix: str) -> str:
    if not prefix or _RESERVED.search(prefix.replace(".", "")):
        raise ValueError(f"invalid subject prefix {prefix!r}: use letters, digits, '-', '_'")
    return prefix


def agent_hello(node: str, prefix: str = DEFAULT_PREFIX) -> str:
    """Subject on which an agent announces its GPUs and heartbeats."""
    return f"{_p(prefix)}.agent.{token(node)}.hello"


def agent_errors(node: str, prefix: str = DEFAULT_PREFIX) -> str:
    """Subject of a node agent's error events (bad datagrams, dead trainers)."""
    return f"{_p(prefix)}.agent.{token(node)}.error"


def _gpu(node: str, gpu: int | str, leaf: str, prefix: str) -> str:
    return f"{_p(prefix)}.gpu.{token(node)}.{token(gpu)}.{leaf}"


def gpu_samples(node: str, gpu: int | str, prefix: str = DEFAULT_PREFIX) -> str:
    """Subject of a GPU's batched samples."""
    return _gpu(node, gpu, "sample", prefix)


def gpu_command(node: str, gpu: int | str, prefix: str = DEFAULT_PREFIX) -> str:
    """Request/reply subject of a GPU's commands."""
    return _gpu(node, gpu, "cmd", prefix)


def gpu_measurements(node: str, gpu: int | str, prefix: str = DEFAULT_PREFIX) -> str:
    """Subject of a GPU's step marks and step/instruction measurements."""
    return _gpu(node, gpu, "meas", prefix)


def gpu_errors(node: str, gpu: int | str, prefix: str = DEFAULT_PREFIX) -> str:
    """Subject of a GPU's rank errors (schedule mismatch, measurement gaps)."""
    return _gpu(node, gpu, "error", prefix)


def lease_renewal(holder: str, prefix: str = DEFAULT_PREFIX) -> str:
    """Subject on which a lease holder renews all of its leases on every agent."""
    return f"{_p(prefix)}.lease.{token(holder)}"


def coord_register_job(prefix: str = DEFAULT_PREFIX) -> str:
    """Request/reply subject to register a job with the coordinator."""
    return f"{_p(prefix)}.coord.jobs.register"


def coord_register_rank(prefix: str = DEFAULT_PREFIX) -> str:
    """Request/reply subject to register a rank with the coordinator."""
    return f"{_p(prefix)}.coord.ranks.register"


def coord_job_query(prefix: str = DEFAULT_PREFIX) -> str:
    """Request/reply subject to ask the coordinator about a job."""
    return f"{_p(prefix)}.coord.jobs.query"


def job_events(job_id: str, rank: int | str, prefix: str = DEFAULT_PREFIX) -> str:
    """Subject of a rank's batched trainer events."""
    return f"{_p(prefix)}.job.{token(job_id)}.ev.{token(rank)}"


def job_schedule(job_id: str, rank: int | str, prefix: str = DEFAULT_PREFIX) -> str:
    """Subject of a rank's frequency schedule."""
    return f"{_p(prefix)}.job.{token(job_id)}.sched.{token(rank)}"


def job_status(job_id: str, prefix: str = DEFAULT_PREFIX) -> str:
    """Subject of a job's status events."""
    return f"{_p(prefix)}.job.{token(job_id)}.status"


# Wildcards for subscribers of every node, GPU, job or holder (tokens above never produce them).
def all_gpu_measurements(prefix: str = DEFAULT_PREFIX) -> str:
    """Every GPU's measurements: `<p>.gpu.*.*.meas`."""
    return f"{_p(prefix)}.gpu.*.*.meas"


def all_gpu_commands(prefix: str = DEFAULT_PREFIX) -> str:
    """Every GPU's command subject: `<p>.gpu.*.*.cmd`."""
    return f"{_p(prefix)}.gpu.*.*.cmd"


def all_job_events(prefix: str = DEFAULT_PREFIX) -> str:
    """Every rank's trainer events: `<p>.job.*.ev.*`."""
    return f"{_p(prefix)}.job.*.ev.*"


def all_job_status(prefix: str = DEFAULT_PREFIX) -> str:
    """Every job's status: `<p>.job.*.status`."""
    return f"{_p(prefix)}.job.*.status"


def all_lease_renewals(prefix: str = DEFAULT_PREFIX) -> str:
    """Every holder's lease renewals: `<p>.lease.*`."""
    return f"{_p(prefix)}.lease.*"


def agent_ping(prefix: str = DEFAULT_PREFIX) -> str:
    """Ask every agent to announce itself now: `<p>.agent.ping`."""
    return f"{_p(prefix)}.agent.ping"
