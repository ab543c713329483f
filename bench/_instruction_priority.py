"""`bench/instruction_latency.py --contend N`: the agent's raised priority and CPU contention.

The methods of raising the agent's priority (`--raise-method`; the script's docstring says
what each does and what it needs), the check that this process may use one, and the CPU-bound
contender processes. Every child starts at the normal policy and at its own nice value
(`child_priority`), not at the priority of the thread that forks it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from zeus_agent import children

RAISED_NICE = -10
"""The agent's nice value at raised priority (the systemd unit's `Nice=-10`)."""
OTHERS_NICE = 10
"""Without privilege: the contenders' and the trainer's nice value (same difference)."""
SPINNER = "while True:\n    sum(range(100))\n"


def child_priority(nice: int) -> Any:
    """A `preexec_fn` giving the child the normal policy at nice `nice`.

    A child inherits the nice value (and policy) of the thread that forks it: without this,
    the trainer and the contenders would share the agent's raised priority.
    """

    def preexec() -> None:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, 0, nice)

    return preexec


def set_agent_priority(method: str) -> None:
    """Give every thread of this process (the agent's) the priority of `method`.

    Linux scheduling attributes are per thread: each thread listed in /proc/self/task is set.
    "nice": nice `RAISED_NICE`; "rr": SCHED_RR priority 1; anything else: SCHED_OTHER, nice 0.

    Raises:
        PermissionError: Raising a priority needs CAP_SYS_NICE (or RLIMIT_NICE/RLIMIT_RTPRIO).
    """
    for tid in map(int, os.listdir("/proc/self/task")):
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            if method == "rr":
                os.sched_setscheduler(tid, os.SCHED_RR, os.sched_param(1))
            else:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                os.setpriority(os.PRIO_PROCESS, tid, RAISED_NICE if method == "nice" else 0)


def permitted(method: str) -> bool:
    """Whether this process may raise its priority with `method` ("others" always may)."""
    if method == "others":
        return True
    try:
        if method == "rr":
            os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))
        else:
            os.setpriority(os.PRIO_PROCESS, 0, RAISED_NICE)
    except PermissionError:
        return False
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    os.setpriority(os.PRIO_PROCESS, 0, 0)
    return True


@contextlib.contextmanager
def contenders(count: int, nice: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`count` CPU-bound Python processes at nice `nice`, killed on exit."""
    procs = [
        children.popen(
            [sys.executable, "-c", SPINNER],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            preexec_fn=child_priority(nice),
        )
        for _ in range(count)
    ]
    try:
        time.sleep(0.2)  # let them start spinning
        yield procs
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait()


RAISE_METHODS = {
    "nice": f"every thread of the agent's process at nice {RAISED_NICE} (setpriority; "
    f"systemd Nice={RAISED_NICE})",
    "rr": "every thread of the agent's process in SCHED_RR at priority 1 (sched_setscheduler; "
    "systemd CPUSchedulingPolicy=rr, CPUSchedulingPriority=1)",
    "others": f"the agent at nice 0, the contenders and the trainer at nice +{OTHERS_NICE}: "
    "the same difference as 'nice', without privilege",
}


def raise_methods(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The `--raise-method`s to measure, `auto` resolved: an error names one not permitted."""
    methods: list[str] = []
    for m in args.raise_method or ["auto"]:
        if m == "auto":
            privileged = [x for x in ("nice", "rr") if permitted(x)]
            methods += privileged or ["others"]
        elif not permitted(m):
            parser.error(
                f"--raise-method {m}: this process may not raise its priority that way (needs "
                "CAP_SYS_NICE or root); use --raise-method others"
            )
        else:
            methods.append(m)
    return list(dict.fromkeys(methods))
