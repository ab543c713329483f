"""`zeus-agent broker` and every child process the project starts die with their parent.

Real processes and a real nats-server: a bad `--port` is one line and exit 2; a port in use is
one line naming it and exit 3; SIGTERM or SIGINT, while the server runs or while it starts,
stop the server and remove its temporary JetStream store; SIGKILL of the parent leaves no
nats-server (the kernel's PR_SET_PDEATHSIG). The same holds for an `EmbeddedNats` started from
a worker thread (as `--embedded-nats` does) and for `zeus_agent.children.popen`, whatever thread
calls it. Every process started here carries a marker in its environment (`MARK_ENV`): that is
how the tests find a nats-server wherever it was reparented, and kill leftovers at teardown.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.repo_kit import REPO_ROOT
from zeus_agent.broker import EmbeddedNats
from zeus_demo.cluster import MARK_ENV, processes_with_mark, wait_for

BROKER = [sys.executable, "-m", "zeus_agent.cli", "broker"]
CONFIG_ERROR, STARTUP_FAILURE = 2, 3

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def mark() -> Iterator[str]:
    """A marker for the processes of one test; whatever carries it at the end is killed."""
    value = uuid.uuid4().hex
    yield value
    for pid in processes_with_mark(value):
        for sig in (signal.SIGCONT, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


@pytest.fixture
def tmpdir_env(tmp_path: Path) -> Path:
    """The TMPDIR of the processes a test starts: where their temporary directories go."""
    path = tmp_path / "tmp"
    path.mkdir()
    return path


def env_for(mark: str, tmpdir: Path) -> dict[str, str]:
    return {**os.environ, MARK_ENV: mark, "TMPDIR": str(tmpdir), "PYTHONUNBUFFERED": "1"}


def one_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def others(mark: str, *pids: int) -> list[int]:
    """Live processes carrying `mark`, other than `pids`."""
    return [pid for pid in processes_with_mark(mark) if pid not in pids]


def wait_until_gone(mark: str, *pids: int, within_s: float = 5.0) -> list[int]:
    """Wait (up to `within_s`) for the processes carrying `mark` to end; those left."""
    wait_for(lambda: not others(mark, *pids), within_s, interval_s=0.02, fail=False)
    return others(mark, *pids)


def read_line(proc: subprocess.Popen[str], timeout_s: float = 20.0) -> str:
    """The next line `proc` prints on stdout ("" if it ended first)."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            raise AssertionError(f"no output within {timeout_s} s")
    return proc.stdout.readline()


def children_of(pid: int) -> list[int]:
    """The direct children of `pid` (cheap enough to poll every half millisecond)."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            text = Path(f"/proc/{pid}/task/{tid}/children").read_text()
            found += [int(c) for c in text.split()]
    return found


def start_broker(mark: str, tmpdir: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*BROKER, *args], cwd=REPO_ROOT, env=env_for(mark, tmpdir), text=True,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


# ------------------------------------------------------------------------ usage errors
@pytest.mark.parametrize("port", ["70000", "65536", "-1", "-4222", "4222x"])
def test_a_bad_port_is_one_line_and_exit_2(port, mark, tmpdir_env):
    done = subprocess.run(
        [*BROKER, "--port", port], cwd=REPO_ROOT, env=env_for(mark, tmpdir_env),
        capture_output=True, text=True, timeout=20, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    line = one_line(done.stderr)
    assert done.returncode == CONFIG_ERROR, done
    assert line.startswith("zeus-agent broker: ") and "--port" in line, line
    assert port in line
    assert done.stdout == ""
    assert others(mark) == [] and list(tmpdir_env.iterdir()) == []


def test_a_busy_port_is_one_line_naming_it_and_exit_3(mark, tmpdir_env):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [*BROKER, "--port", str(port)], cwd=REPO_ROOT, env=env_for(mark, tmpdir_env),
            capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    line = one_line(done.stderr)
    assert done.returncode == STARTUP_FAILURE, done
    assert f"port {port} is already in use" in line, line
    assert "--port" in line  # what to do
    assert others(mark) == [] and list(tmpdir_env.iterdir()) == []


def test_embedded_nats_names_the_reason_a_start_failed(tmpdir_env, monkeypatch):
    """The reason is nats-server's own (it logs to a file, not to stderr): never empty."""
    from zeus_agent.broker import PortInUseError

    monkeypatch.setenv("TMPDIR", str(tmpdir_env))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PortInUseError, match=f"port {port} of 127.0.0.1") as raised:
            EmbeddedNats(port=port).start()
    assert raised.value.port == port
    with pytest.raises(ValueError, match="not a TCP port"):
        EmbeddedNats(port=-1)
    with pytest.raises(ValueError, match="not a TCP port"):
        EmbeddedNats(port=70000)
    assert list(tmpdir_env.iterdir()) == []


# --------------------------------------------------------------------- stop by signal
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_running_stops_nats_server_and_removes_its_store(sig, mark, tmpdir_env):
    broker = start_broker(mark, tmpdir_env, "--port", "0")
    try:
        assert read_line(broker).startswith("nats-server ready at nats://127.0.0.1:")
        [server] = others(mark, broker.pid)
        assert [p.name for p in tmpdir_env.iterdir()][0].startswith("zeus-nats-")
        broker.send_signal(sig)
        _, err = broker.communicate(timeout=20)
    finally:
        broker.kill()
    assert broker.returncode == 0, err
    assert "Traceback" not in err, err
    assert wait_until_gone(mark, broker.pid) == []
    assert list(tmpdir_env.iterdir()) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_nats_server_starts_leaves_nothing_behind(sig, mark, tmpdir_env):
    """The signal comes while the broker waits for its server: the child is held (SIGSTOP)
    the moment it exists, the broker signalled, the child released."""
    broker = start_broker(mark, tmpdir_env, "--port", "0")

    def hold_child() -> int | None:
        """The broker's child, stopped (SIGSTOP) the moment it is seen."""
        kids = children_of(broker.pid)
        if kids:
            os.kill(kids[0], signal.SIGSTOP)
            return kids[0]
        assert broker.poll() is None, "the broker started no child"
        return None

    try:
        child = wait_for(hold_child, 20, lambda: "the broker started no child",
                         interval_s=0.0005)
        broker.send_signal(sig)
        time.sleep(0.2)  # let the broker take the signal while its server cannot answer
        os.kill(child, signal.SIGCONT)
        out, err = broker.communicate(timeout=20)
    finally:
        broker.kill()
    assert broker.returncode == 0, err
    assert "Traceback" not in err, err
    assert wait_until_gone(mark, broker.pid) == []
    assert list(tmpdir_env.iterdir()) == []


def test_sigkill_of_the_broker_takes_nats_server_with_it(mark, tmpdir_env):
    broker = start_broker(mark, tmpdir_env, "--port", "0")
    try:
        assert read_line(broker).startswith("nats-server ready at")
        assert len(others(mark, broker.pid)) == 1
        broker.kill()
        broker.wait(10)
    finally:
        broker.kill()
    assert wait_until_gone(mark, broker.pid) == []


# ------------------------------------------------- children of other parents and threads
def test_a_server_started_from_a_thread_that_ends_keeps_running(tmpdir_env, monkeypatch):
    """PR_SET_PDEATHSIG follows the thread that forked: the server must not die with it."""
    monkeypatch.setenv("TMPDIR", str(tmpdir_env))
    server = EmbeddedNats(die_with_parent=True)
    starter = threading.Thread(target=server.start)
    starter.start()
    starter.join()
    try:
        assert server.running
        deadline = time.monotonic() + 0.5  # a SIGTERM would have ended it by then
        while time.monotonic() < deadline:
            assert server.running, "nats-server died with the thread that started it"
            time.sleep(0.02)
        with socket.create_connection(("127.0.0.1", server.port), timeout=2) as s:
            assert s.recv(4) == b"INFO"
    finally:
        server.stop()
    assert not server.running
    assert list(tmpdir_env.iterdir()) == []


PARENT = """
import asyncio, subprocess, sys, threading
from zeus_agent import children
from zeus_agent.broker import EmbeddedNats

async def main():
    # as the services' --embedded-nats do: started from an asyncio.to_thread worker
    server = await asyncio.to_thread(EmbeddedNats().start)
    sleeper = ["sleep", "300"]
    procs = [children.popen(sleeper, stdin=subprocess.DEVNULL)]
    done = []
    worker = threading.Thread(target=lambda: done.append(children.popen(sleeper)))
    worker.start()
    worker.join()
    procs += done
    procs.append(await children.create_subprocess_exec(*sleeper))
    print(server.url, *[p.pid for p in procs], flush=True)
    await asyncio.sleep(300)

asyncio.run(main())
"""


def test_sigkill_of_a_parent_takes_every_child_with_it(mark, tmpdir_env):
    """nats-server from a worker thread; `children.popen` from the main thread and from a
    thread that ended; `children.create_subprocess_exec`: all four die with the parent."""
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(PARENT)], cwd=REPO_ROOT,
        env=env_for(mark, tmpdir_env), text=True, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        line = read_line(parent).split()
        assert line and line[0].startswith("nats://"), line
        time.sleep(0.3)  # the thread that forked one sleeper has ended: it must live on
        assert len(others(mark, parent.pid)) == 4
        parent.kill()
        parent.wait(10)
    finally:
        parent.kill()
    assert wait_until_gone(mark, parent.pid) == []


SCRIPT = {
    "plain": """
import time
from zeus_agent import children
from zeus_agent.broker import EmbeddedNats

with children.sigterm_as_sigint():
    try:
        with EmbeddedNats() as server:
            print(server.url, flush=True)
            time.sleep(300)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
""",
    "asyncio": """
import asyncio
from zeus_agent import children
from zeus_agent.broker import EmbeddedNats

async def main():
    async with EmbeddedNats() as server:  # started and stopped from worker threads
        print(server.url, flush=True)
        await asyncio.sleep(300)

with children.sigterm_as_sigint():
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        print("interrupted", flush=True)
""",
}


@pytest.mark.parametrize("kind", sorted(SCRIPT))
def test_sigterm_as_sigint_lets_a_script_clean_up(kind, mark, tmpdir_env):
    """What the demo and the benchmarks do: SIGTERM runs their clean-up as Ctrl-C would."""
    script = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(SCRIPT[kind])], cwd=REPO_ROOT,
        env=env_for(mark, tmpdir_env), text=True, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert read_line(script).startswith("nats://")
        assert len(others(mark, script.pid)) == 1
        script.send_signal(signal.SIGTERM)
        out, err = script.communicate(timeout=20)
    finally:
        script.kill()
    assert script.returncode == 0 and out.strip() == "interrupted", (out, err)
    assert wait_until_gone(mark, script.pid) == []
    assert list(tmpdir_env.iterdir()) == []
