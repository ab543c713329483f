"""What an agent started with `--history` records (`zeus_agent.history`).

Per GPU: every command it answered (the sender's lease from `LEASE_HEADER`, the op, the
outcome), every lease renewal, every restore of defaults (whatever restored them); each record
with the GPU's state right after it: `away` (a setting differs from its default) and `deadline`
(wall-clock s when its last lease lapses; None: none held). The checker proves from these
that no GPU was commanded by two owners at once and none stayed away past its lease.
"""

from __future__ import annotations

import time
from typing import Any

from zeus_agent.agent.gpu_agent import GpuAgent
from zeus_agent.history import History
from zeus_agent.wire import codec
from zeus_agent.wire.fencing import LEASE_HEADER, parse_lease_header
from zeus_agent.wire.messages import CommandEnvelope, Reply

__all__ = ["decoded", "gpu_state", "record_command", "record_renewal", "record_restore"]


def gpu_state(agent: GpuAgent) -> dict[str, Any]:
    """`node`, `gpu`, `away` and `deadline` of one GPU now."""
    held = agent.leases.held()
    deadline = None
    if held:
        left_s = (max(lease.deadline_ns for lease in held) - time.monotonic_ns()) / 1e9
        deadline = time.time() + left_s
    return {"node": agent.node, "gpu": agent.index, "away": bool(agent.changed),
            "deadline": deadline}


def record_command(history: History, agent: GpuAgent, cmd: dict[str, Any] | None,
                   headers: dict[str, str] | None, reply: Reply) -> None:
    """One command answered (info and energy reads are not recorded: they change nothing)."""
    op = (cmd or {}).get("op", "?")
    if op in ("info", "energy", "select"):
        return
    lease = parse_lease_header((headers or {}).get(LEASE_HEADER))
    history.record(
        "command", op=op, holder=(cmd or {}).get("holder") or (cmd or {}).get("job_id"),
        power_limit_w=(cmd or {}).get("power_limit_w"), ok=reply.ok, code=reply.code,
        owner=lease.owner if lease else None, inc=lease.incarnation if lease else None,
        revision=lease.revision if lease else None, until=lease.until if lease else None,
        **gpu_state(agent))


def record_renewal(history: History, agent: GpuAgent, holder: str, renewed: list[str]) -> None:
    """A lease renewal that renewed something on this GPU."""
    if renewed:
        history.record("renew", holder=holder, renewed=renewed, **gpu_state(agent))


def record_restore(history: History, agent: GpuAgent, restored: list[str]) -> None:
    """A restore of defaults, whatever restored them (the agent's `on_restored`).

    Recorded where the restore happens, not by one caller of it: the schedule's own expiry
    check (a trainer's instruction after a lapse) and a trainer's death restore too.
    """
    if restored:
        history.record("restore", restored=restored, **gpu_state(agent))


def decoded(data: bytes) -> dict[str, Any] | None:
    """The command object of a raw (msgpack) envelope, or None if it is not one (never raises)."""
    try:
        return codec.decode(data, CommandEnvelope).cmd.model_dump()
    except Exception:  # noqa: BLE001 - the handler already answered it as a bad request
        return None
