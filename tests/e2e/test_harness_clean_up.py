"""The cluster harness leaves nothing running: a script using it, stopped by SIGTERM (what
systemd, Kubernetes and `docker stop` send) or killed by SIGKILL, takes its nats-server, agents
and coordinators with it; so does `bench/perseus_savings.py` stopped by SIGTERM.

Each script runs in a session of its own; once it has started its cluster, every process below
it is recorded (walking /proc by parent pid), the script alone gets the signal, and after it
ended none of those processes may be left (nor any carrying its registry's marker).
A group killed by the harness leaves none of its named semaphores in /dev/shm either.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.repo_kit import REPO_ROOT
from zeus_demo.cluster import processes_with_mark, wait_for

pytestmark = pytest.mark.timeout(120)

SCRIPT = textwrap.dedent("""
    import asyncio, json, sys
    from zeus_demo.cluster import SimCluster, sigterm_as_sigint

    async def main():
        c = SimCluster(nodes=("node-a", "node-b"), gpus_per_node=1)
        try:
            await c.start()
            print(json.dumps({"mark": c.procs.mark, "nats": c.nats.pid}), flush=True)
            await asyncio.Event().wait()
        finally:
            await c.close()

    with sigterm_as_sigint():
        try:
            asyncio.run(main())
        except KeyboardInterrupt:
            sys.exit(130)
""")


def _parents() -> dict[int, int]:
    """pid -> parent pid of every live (not zombie) process."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            out[int(entry)] = int(fields[1])
    return out


def descendants(pid: int) -> dict[int, str]:
    """Every live process below `pid`, with its command line."""
    parents = _parents()
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    out = {}
    for p in found:
        try:
            out[p] = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
    return out


def alive(pids: dict[int, str]) -> dict[int, str]:
    """Those of `pids` still running (a recycled pid would have another command line)."""
    parents = _parents()
    left = {}
    for pid, cmd in pids.items():
        if pid not in parents:
            continue
        try:
            now = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if now == cmd:
            left[pid] = cmd
    return left


def start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(argv, cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})


def kill_session(proc: subprocess.Popen[bytes], below: dict[int, str]) -> None:
    """Whatever happened, nothing the test started is left (the script, what it started)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)
    for pid in alive(below):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def stop(proc: subprocess.Popen[bytes], sig: int, log: Path) -> None:
    proc.send_signal(sig)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        raise AssertionError(f"the script ignored {sig!r} for 60 s\n"
                             f"{log.read_text(errors='replace')[-3000:]}") from None


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_harness_script_takes_its_cluster_with_it(tmp_path: Path, sig: int) -> None:
    script, log = tmp_path / "cluster.py", tmp_path / "cluster.log"
    script.write_text(SCRIPT)
    proc = start([sys.executable, str(script)], log)
    below: dict[int, str] = {}
    try:
        line = wait_for(lambda: next((ln for ln in log.read_text().splitlines()
                                      if ln.startswith("{")), None), 60,
                        lambda: f"the cluster did not start:\n{log.read_text()[-3000:]}")
        started = json.loads(line)
        below.update(descendants(proc.pid))
        commands = " ".join(below.values())
        assert started["nats"] in below and "nats-server" in commands, below
        assert commands.count("zeus_agent.cli") + commands.count("zeus-agent") >= 2, below
        stop(proc, sig, log)
        if sig == signal.SIGTERM:
            assert proc.returncode == 130, log.read_text()[-3000:]
        # SIGKILL: the children get SIGTERM from the kernel and stop on their own.
        wait_for(lambda: not alive(below) and not processes_with_mark(started["mark"]), 30,
                 lambda: f"left running: {alive(below)}")
    finally:
        kill_session(proc, below)


def test_the_savings_bench_stopped_by_sigterm_leaves_no_nats_server(tmp_path: Path) -> None:
    log = tmp_path / "bench.log"
    proc = start([sys.executable, str(REPO_ROOT / "bench" / "perseus_savings.py"), "--quick"],
                 log)
    below: dict[int, str] = {}
    try:
        def cluster() -> dict[int, str]:
            below = descendants(proc.pid)
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            return below if "nats-server" in " ".join(below.values()) else {}

        wait_for(cluster, 60, "the bench's nats-server")
        time.sleep(2)  # its agents and the first coordinator start meanwhile
        below.update(descendants(proc.pid))
        stop(proc, signal.SIGTERM, log)
        wait_for(lambda: not alive(below), 30, lambda: f"left running: {alive(below)}")
    finally:
        kill_session(proc, below)


SEMAPHORES = textwrap.dedent("""
    import json, multiprocessing as mp, time
    ctx = mp.get_context("spawn")
    q, barrier = ctx.Queue(), ctx.Barrier(2)
    child = ctx.Process(target=time.sleep, args=(600,))
    child.start()
    names = [q._rlock._semlock.name, barrier._cond._lock._semlock.name]
    print(json.dumps({"names": names, "child": child.pid}), flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("how", ["kill", "close"])
def test_a_killed_group_leaves_no_named_semaphore_behind(tmp_path: Path, how: str) -> None:
    """SIGKILL of a group spares its multiprocessing resource tracker, which unlinks the
    semaphores of the processes killed (`/dev/shm/sem.mp-*`), then ends by itself."""
    from zeus_demo.cluster import Processes

    procs = Processes(tmp_path)
    try:
        proc = procs.spawn("mp", [sys.executable, "-c", SEMAPHORES], stdout=subprocess.PIPE)
        assert proc.stdout is not None
        started = json.loads(proc.stdout.readline())
        paths = [Path("/dev/shm") / f"sem.{name.lstrip('/')}" for name in started["names"]]
        assert all(p.exists() for p in paths), paths
        if how == "kill":
            procs.kill("mp")
        strays = procs.close()
        assert strays == []
        wait_for(lambda: not any(p.exists() for p in paths), 5, "the semaphores unlinked")
        assert not os.path.exists(f"/proc/{started['child']}/stat") or _is_zombie(started["child"])
    finally:
        procs.close()


def _is_zombie(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    return True
