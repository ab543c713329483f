"""`zeus-coordinator watch`: follow jobs from a terminal.

Subscribes to `<prefix>.job.<job>.status` (all jobs, or one) and prints each state change and
progress report as it comes, with the power-limit progress when there is one, and which GPUs
are observe-only (from the agents' announcements, `<prefix>.agent.*.hello`: a line when a GPU is
first seen observe-only, and when that changes), and each governing power budget
(`<prefix>.budget.*.status`, from the replica applying it: its cap, measured draw and each job's
share and slowdown, when a share changes and every `BUDGET_EVERY_S` otherwise). With `--once`,
it asks the coordinator for the job's current state instead (`<prefix>.coord.jobs.query`) and
exits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import signal
from collections.abc import Sequence
from typing import Any

from zeus_agent.broker import confirm_subscriptions, connect
from zeus_agent.errors import PayloadError, ZeusAgentError
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.budget import BudgetStatus
from zeus_agent.wire.messages import AgentHello, JobQuery, JobStatus, Reply

BUDGET_EVERY_S = 10.0
"""A budget whose shares did not change is shown this often (its status comes every second)."""


def describe(status: JobStatus) -> str:
    """One line for a status event."""
    when = dt.datetime.now().strftime("%H:%M:%S")
    line = f"{when} {status.job_id} [{status.state}] {status.message}"
    p = status.progress
    if "candidates" in p:
        line += f"  ({p.get('measured', 0)}/{p['candidates']} limits measured"
        if p.get("power_limit_w") is not None:
            line += f", now {p['power_limit_w']} W"
        if p.get("optimal_power_limit_w") is not None:
            line += f", optimal {p['optimal_power_limit_w']} W"
        line += ")"
    elif "phase" in p:  # A pipeline job: discovering, profiling k/n, serving plan n.
        phase = p["phase"]
        rounds = p.get("rounds")
        if phase == "profiling" and rounds:
            line += f"  (profiling {rounds[0]}/{rounds[1]}, schedule {p.get('schedule')})"
        elif phase == "serving":
            line += f"  (serving plan {p.get('schedule')})"
        else:
            line += f"  ({phase})"
    return line


def describe_budget(status: BudgetStatus, max_jobs: int = 12) -> str:
    """Lines for a budget's status: cap, measured and expected draw, each job's share."""
    when = dt.datetime.now().strftime("%H:%M:%S")
    measured = "?" if status.measured_w is None else f"{status.measured_w:.0f}"
    over = (status.measured_w or 0) > status.cap_w
    lines = [f"{when} budget {status.budget_id} [{'OVER' if over else 'under'} cap] cap "
             f"{status.cap_w:.0f} W, measured {measured} W, expected {status.expected_w:.0f} W "
             f"(room {status.room_w:.0f} W, floor {status.floor_w:.0f} W; {status.gpus} GPUs, "
             f"{status.idle_gpus} idle; applied by {status.replica})"]
    for share in sorted(status.shares, key=lambda s: -s.expected_w)[:max_jobs]:
        slow = ("proportional: no profile yet" if share.slowdown is None
                else f"slowdown {100 * share.slowdown:.1f}%")
        lines.append(f"    {share.job_id}: {share.gpus} GPU(s) at {share.limit_w} W, "
                     f"{share.expected_w:.0f} W, {slow}")
    if len(status.shares) > max_jobs:
        lines.append(f"    ... and {len(status.shares) - max_jobs} more job(s)")
    return "\n".join(lines)


class BudgetLines:
    """Which budget statuses to show: a change of shares at once, the rest now and then."""

    def __init__(self, every_s: float = BUDGET_EVERY_S) -> None:
        self.every_s = every_s
        self.last: dict[str, tuple[float, tuple[tuple[str, int], ...]]] = {}

    def show(self, status: BudgetStatus, now_s: float) -> bool:
        """Whether to print `status` now (and remember that it was)."""
        shares = tuple(sorted((s.job_id, s.limit_w) for s in status.shares))
        before = self.last.get(status.budget_id)
        if before is not None and before[1] == shares and now_s - before[0] < self.every_s:
            return False
        self.last[status.budget_id] = (now_s, shares)
        return True


def control_changes(hello: AgentHello, known: dict[tuple[str, int], bool]) -> list[str]:
    """Lines for the GPUs of an announcement whose control changed (`known` is updated).

    A GPU first seen controllable says nothing (the usual case); one first seen observe-only,
    or whose control changed, gets a line.
    """
    when = dt.datetime.now().strftime("%H:%M:%S")
    lines = []
    for gpu in hello.gpus:
        key = (hello.node, gpu.index)
        before = known.get(key)
        known[key] = gpu.controllable
        if before == gpu.controllable or (before is None and gpu.controllable):
            continue
        if gpu.controllable:
            lines.append(f"{when} {hello.node}/gpu{gpu.index} [controllable] its agent may "
                         "change its settings again (it restarted with the privilege)")
        else:
            lines.append(f"{when} {hello.node}/gpu{gpu.index} [observe-only] measured, never "
                         "set: jobs that optimise it are refused (its agent runs with "
                         "--observe-only or lacks CAP_SYS_ADMIN)")
    return lines


async def watch(url: str, prefix: str, job_id: str | None, once: bool) -> int:
    """Print a job's status (or every job's) until interrupted."""
    nc = await connect(url, "zeus-coordinator-watch",
                       inbox_prefix=subjects.inbox_prefix("observer", "", prefix))
    try:
        if once:
            msg = await nc.request(
                subjects.coord_job_query(prefix), codec.encode(JobQuery(job_id=job_id)), timeout=5
            )
            reply = codec.decode(msg.data, Reply)
            if not reply.ok:
                print(f"{reply.code}: {reply.error}")
                return 1
            print(json.dumps(reply.result, indent=2, default=str))
            return 0
        subject = subjects.job_status(job_id, prefix) if job_id else subjects.all_job_status(prefix)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)

        async def on_status(msg: Any) -> None:
            try:
                print(describe(codec.decode(msg.data, JobStatus)), flush=True)
            except PayloadError as e:
                print(f"(unreadable status on {msg.subject}: {e})", flush=True)

        known: dict[tuple[str, int], bool] = {}

        async def on_hello(msg: Any) -> None:
            with contextlib.suppress(PayloadError):  # (Not ours to judge: the coordinator's.)
                for line in control_changes(codec.decode(msg.data, AgentHello), known):
                    print(line, flush=True)

        budget_lines = BudgetLines()

        async def on_budget(msg: Any) -> None:
            try:
                status = codec.decode(msg.data, BudgetStatus)
            except PayloadError as e:
                print(f"(unreadable budget status on {msg.subject}: {e})", flush=True)
                return
            if budget_lines.show(status, loop.time()):
                print(describe_budget(status), flush=True)

        await nc.subscribe(subject, cb=on_status)
        await nc.subscribe(subjects.all_agent_hellos(prefix), cb=on_hello)
        if not job_id:
            await nc.subscribe(subjects.all_budget_status(prefix), cb=on_budget)
        await confirm_subscriptions(nc)
        print(f"watching {subject} on {url}; Ctrl-C to stop", flush=True)
        await stop.wait()
        return 0
    finally:
        await nc.drain()


def main(argv: Sequence[str]) -> int:
    """Entry point of `zeus-coordinator watch`."""
    parser = argparse.ArgumentParser(
        prog="zeus-coordinator watch",
        description="Follow job status events (state changes, profiling progress, the pinned "
        "power limit), which GPUs are observe-only and each power budget (cap, measured draw, "
        "each job's share and slowdown), or print a job's current state with --once.",
    )
    parser.add_argument("job_id", nargs="?", help="a job id (default: every job)")
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222", help="NATS server URL")
    parser.add_argument("--prefix", default=subjects.DEFAULT_PREFIX, help="subject prefix")
    parser.add_argument(
        "--once", action="store_true", help="ask the coordinator once (the job list without a job)"
    )
    args = parser.parse_args(list(argv))
    try:
        return asyncio.run(watch(args.nats_url, args.prefix, args.job_id, args.once))
    except ZeusAgentError as e:
        print(f"zeus-coordinator watch: {e}")
        return 3
    except Exception as e:  # noqa: BLE001 - NATS timeouts and no-responders, for people
        print(f"zeus-coordinator watch: {type(e).__name__}: {e}; is a coordinator running?")
        return 1
