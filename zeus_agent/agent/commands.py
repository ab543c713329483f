"""The GPU command handlers: decode -> validate against the GPU -> apply -> `Reply`.

`handle_command(agent, data, headers)` is what the NATS endpoint of each GPU calls. Every
outcome is a `Reply`: domain errors answer with their stable code (`zeus_agent.errors.reply_for`),
unexpected exceptions with "internal" and no internals leaked (they are logged). Nothing
raised here reaches NATS.

A command carrying a `Zeus-Lease` header (a coordinator's, for a job) passes the GPU's
`CommandFence` first: one whose sender's lease is over is refused `stale_lease` before it is
run (reads, `info` and `energy`, change nothing and are not fenced).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from zeus_agent.agent.gpu_agent import GpuAgent
from zeus_agent.errors import (
    PayloadError,
    ReplyError,
    StaleLeaseError,
    TrainerLeftError,
    reply_for,
)
from zeus_agent.wire import codec
from zeus_agent.wire.fencing import LEASE_HEADER, parse_lease_header
from zeus_agent.wire.messages import (
    BindRankCmd,
    ClearScheduleCmd,
    CommandEnvelope,
    EnergyCmd,
    GpuCommand,
    InfoCmd,
    InstallScheduleCmd,
    LockClocksCmd,
    RenewLeasesCmd,
    Reply,
    ResetClocksCmd,
    ResetPowerLimitCmd,
    SelectCmd,
    SetPowerLimitCmd,
    UnbindRankCmd,
)
from zeus_agent.wire.node_cap import NodeCapCmd
from zeus_agent.wire.text import bounded
from zeus_agent.wire.trainer import SelectRequest

LOG = logging.getLogger(__name__)


async def handle_command(agent: GpuAgent, data: bytes,
                         headers: Mapping[str, str] | None = None) -> Reply:
    """Decode one command for `agent`, fence it, run it, and return the reply (never raises)."""
    try:
        cmd = codec.decode(data, CommandEnvelope).cmd
    except Exception as e:  # noqa: BLE001 - every failure becomes a reply
        return reply_for(e, f"internal error in the agent of GPU {agent.index}; see its log")
    return await handle_decoded(agent, cmd, headers)


async def handle_decoded(agent: GpuAgent, cmd: GpuCommand,
                         headers: Mapping[str, str] | None = None) -> Reply:
    """Fence and run one decoded command for `agent` (a GPU's request, or a node batch's item).

    The one path every command takes after decoding, so an item of a node's batch passes
    exactly the checks its GPU's own request would (never raises).
    """
    try:
        if not isinstance(cmd, InfoCmd | EnergyCmd):
            fence(agent, headers)
        return await run_command(agent, cmd)
    except Exception as e:  # noqa: BLE001 - every failure becomes a reply
        if not isinstance(e, ReplyError):
            LOG.exception("GPU %d: unexpected error in command", agent.index)
        return reply_for(e, f"internal error in the agent of GPU {agent.index}; see its log")


def fence(agent: GpuAgent, headers: Mapping[str, str] | None) -> None:
    """Refuse a command whose `Zeus-Lease` is over (`StaleLeaseError`); none: not fenced."""
    lease = parse_lease_header((headers or {}).get(LEASE_HEADER))
    if lease is None:
        return
    refused = agent.fence.admit(lease, time.time())
    if refused is not None:
        agent.count("fenced")
        raise StaleLeaseError(f"GPU {agent.index} on node {agent.node!r}: {refused.reason}")


async def run_command(agent: GpuAgent, cmd: GpuCommand) -> Reply:
    """Run a validated command."""
    match cmd:
        case InfoCmd():
            return Reply.success(**(await info(agent)))
        case SetPowerLimitCmd():
            old = await agent.set_power_limit(cmd.power_limit_w, cmd.holder, cmd.lease_s)
            applied = agent.cap.capped(cmd.power_limit_w)
            return Reply.success(power_limit_w=cmd.power_limit_w, previous_w=old,
                                 **({"capped_w": applied} if applied != cmd.power_limit_w else {}))
        case ResetPowerLimitCmd():
            return Reply.success(power_limit_w=await agent.reset_power_limit())
        case LockClocksCmd():
            await agent.lock_clocks(cmd.min_mhz, cmd.max_mhz, cmd.holder, cmd.lease_s)
            return Reply.success(min_mhz=cmd.min_mhz, max_mhz=cmd.max_mhz)
        case ResetClocksCmd():
            await agent.restore({"sm_clocks"}, reason="reset command")
            await agent.caller.call(agent.clocks.exclusive(agent.gpu.reset_sm_clocks),
                                    setter=True)
            return Reply.success()
        case InstallScheduleCmd():
            await agent.install_schedule(cmd.job_id, cmd.schedule, cmd.holder, cmd.lease_s,
                                         version=cmd.version, from_step=cmd.from_step)
            return Reply.success(instructions=len(cmd.schedule.frequencies))
        case ClearScheduleCmd():
            return Reply.success(restored=await agent.restore({"schedule"}, reason="clear command"))
        case BindRankCmd():
            agent.bind(cmd.job_id, cmd.rank, join_digest=cmd.join_digest)
            return Reply.success(job_id=cmd.job_id, rank=cmd.rank)
        case UnbindRankCmd():
            agent.unbind()
            return Reply.success()
        case EnergyCmd():
            if cmd.t1_ns < cmd.t0_ns:
                raise PayloadError("t1_ns must not precede t0_ns", "t1_ns")
            energy = agent.energy_between(cmd.t0_ns, cmd.t1_ns)  # at once: no read per request
            return Reply.success(energy_j=energy, time_s=(cmd.t1_ns - cmd.t0_ns) / 1e9)
        case RenewLeasesCmd():
            return Reply.success(renewed=agent.renew_leases(cmd.holder, cmd.lease_s))
        case SelectCmd():
            return ask_trainer(agent, cmd)
        case NodeCapCmd():
            held = await agent.set_node_cap(cmd.cap_w, cmd.holder, cmd.lease_s)
            return Reply.success(node_cap=agent.cap.describe(), power_limit_w=agent.power_limit_w,
                                 **({"lifted": held} if cmd.cap_w is None else {}))
    raise PayloadError(f"unsupported command {cmd!r}")  # pragma: no cover - union is exhaustive


def ask_trainer(agent: GpuAgent, cmd: SelectCmd) -> Reply:
    """Push a question to the job's trainer bound here; its answer comes as its rank's event.

    Raises:
        TrainerLeftError: No trainer of the job is bound to this GPU.
    """
    bound = agent.binding
    if bound is None or bound.job_id != cmd.job_id or not agent.reaches_trainer:
        raise TrainerLeftError(f"no trainer of job {cmd.job_id!r} is bound to GPU "
                               f"{agent.index} on node {agent.node!r}")
    agent.tell_trainer(SelectRequest(job_id=cmd.job_id, request=cmd.request,
                                     measurements=cmd.measurements))
    return Reply.success(asked=bound.rank)


async def info(agent: GpuAgent) -> dict:
    """The GPU's description, current settings, leases and bound rank."""
    desc = await agent.describe()
    now = time.monotonic_ns()
    s = agent.last_sample
    return {
        "node": agent.node,
        "gpu": desc.model_dump(),
        "sm_clock_mhz": s.sm_clock_mhz if s else None,
        "power_w": s.power_w if s else None,
        "leases": [
            {
                "kind": lease.kind,
                "holder": lease.holder,
                "remaining_s": (lease.deadline_ns - now) / 1e9,
            }
            for lease in agent.leases.held()
        ],
        "schedule_installed": agent.cursor.installed,
        "binding": (
            {
                "job_id": agent.binding.job_id,
                "rank": agent.binding.rank,
                "pid": agent.binding.pid,
                "uid": agent.binding.uid,
            }
            if agent.binding
            else None
        ),
        "counters": dict(agent.counters),
        "node_cap": agent.cap.describe(),
    }


async def answer(req: Any, data: bytes, before_reply: Callable[[], Awaitable[None]] | None,
                 who: str, what: str) -> None:
    """Answer a command request (a GPU's, or a node's batch) after `before_reply` (never raises).

    `before_reply`: the lease renewals' subjects follow the leases the command granted or
    released before the asker hears of it.
    """
    if before_reply is not None:
        await before_reply()
    try:
        await req.respond(data)
    except Exception as e:  # noqa: BLE001 - the asker left, or NATS is gone
        LOG.warning("%s: could not answer %s: %s", who, what, bounded(e, 300))
