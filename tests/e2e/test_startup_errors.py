"""Start-up errors of the real `zeus-agent run` and `zeus-coordinator run` processes.

Each bad start ends with the documented exit code (2 configuration, 3 startup failure) and one
line on stderr that says what is wrong and where: never exit 1 with a traceback.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from zeus_demo.cluster import free_port

AGENT = [sys.executable, "-m", "zeus_agent.cli", "run"]
COORDINATOR = [sys.executable, "-m", "coordinator.cli", "run"]
CONFIG_ERROR, STARTUP_FAILURE = 2, 3

pytestmark = pytest.mark.timeout(120)


def run(args: list[str], cwd: Path) -> tuple[int, str]:
    """Run a CLI to its end; return (exit code, stderr)."""
    done = subprocess.run(
        args, cwd=cwd, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )
    return done.returncode, done.stderr


def one_line(stderr: str) -> str:
    """The single line of stderr (logging is set to CRITICAL, so nothing else is printed)."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.fixture
def short_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A directory with a short path (AF_UNIX paths are limited), removed afterwards."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="zse-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def agent_args(tmp: Path, *extra: str) -> list[str]:
    return [
        *AGENT, "--backend", "sim", "--sim-state-dir", str(tmp / "sim"),
        "--socket-path", str(tmp / "agent.sock"), "--nats-url", "nats://127.0.0.1:1",
        "--log-level", "CRITICAL", *extra,
    ]  # fmt: skip


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


# ---------------------------------------------------------------------------- the agent
def test_agent_socket_path_too_long(short_tmp):
    path = "/tmp/" + "s" * 110 + ".sock"
    code, err = run(agent_args(short_tmp, "--socket-path", path), short_tmp)
    line = one_line(err)
    assert code == CONFIG_ERROR
    assert line.startswith("zeus-agent run: invalid configuration: --socket-path:")
    assert "120 bytes" in line and "107" in line


def test_agent_file_where_the_socket_directory_should_be(short_tmp):
    (short_tmp / "run").write_text("not a directory")
    path = short_tmp / "run" / "agent.sock"
    code, err = run(agent_args(short_tmp, "--socket-path", str(path)), short_tmp)
    line = one_line(err)
    assert code == STARTUP_FAILURE
    assert f"cannot create the socket directory {short_tmp / 'run'}" in line
    assert "a file is in the way" in line


def test_agent_metrics_port_in_use(short_tmp, busy_port):
    args = agent_args(short_tmp, "--metrics-port", str(busy_port), "--metrics-host", "127.0.0.1")
    code, err = run(args, short_tmp)
    line = one_line(err)
    assert code == STARTUP_FAILURE
    assert f"127.0.0.1:{busy_port}" in line and "already in use" in line
    assert "--metrics-port" in line


def test_agent_bad_prefix(short_tmp):
    code, err = run(agent_args(short_tmp, "--prefix", "a b"), short_tmp)
    line = one_line(err)
    assert code == CONFIG_ERROR
    assert line.startswith("zeus-agent run: invalid configuration: --prefix:")
    assert "'a b'" in line


def test_agent_bad_default_lease(short_tmp):
    code, err = run(agent_args(short_tmp, "--default-lease-s", "inf"), short_tmp)
    assert code == CONFIG_ERROR
    assert "--default-lease-s" in one_line(err)


def test_agent_unreachable_nats_names_the_url_and_what_to_check(short_tmp):
    port = free_port()  # nothing listens there
    url = f"nats://agent:s3cret@127.0.0.1:{port}"
    code, err = run(agent_args(short_tmp, "--nats-url", url), short_tmp)
    line = one_line(err)
    assert code == STARTUP_FAILURE
    assert f"could not connect to NATS at nats://agent:***@127.0.0.1:{port}" in line
    assert "s3cret" not in line
    assert "Connection refused" in line or "Connect call failed" in line
    assert "check that a nats-server is running" in line
    assert not (short_tmp / "agent.sock").exists()  # the socket it opened first is gone


# ---------------------------------------------------------------------------- the coordinator
def coordinator_args(tmp: Path, *extra: str) -> list[str]:
    return [
        *COORDINATOR, "--nats-url", "nats://127.0.0.1:1", "--state-dir", str(tmp / "state"),
        "--connect-timeout-s", "1", "--log-level", "CRITICAL", *extra,
    ]  # fmt: skip


def test_coordinator_bad_prefix(tmp_path):
    code, err = run(coordinator_args(tmp_path, "--prefix", "a b"), tmp_path)
    line = one_line(err)
    assert code == CONFIG_ERROR
    assert "invalid configuration" in line and "--prefix" in line and "'a b'" in line


def test_coordinator_state_directory_that_cannot_be_created(tmp_path):
    (tmp_path / "state").write_text("a file, not a directory")
    code, err = run(coordinator_args(tmp_path), tmp_path)
    line = one_line(err)
    assert code == STARTUP_FAILURE
    assert str(tmp_path / "state") in line
    assert line.startswith("zeus-coordinator: ")


def test_coordinator_state_directory_below_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    args = coordinator_args(tmp_path, "--state-dir", str(tmp_path / "file" / "state"))
    code, err = run(args, tmp_path)
    line = one_line(err)
    assert code == STARTUP_FAILURE
    assert str(tmp_path / "file") in line


def test_coordinator_unreachable_nats(tmp_path):
    port = free_port()
    args = coordinator_args(tmp_path, "--nats-url", f"nats://coordinator:pw@127.0.0.1:{port}")
    code, err = run(args, tmp_path)
    line = one_line(err)
    assert code == STARTUP_FAILURE
    assert f"nats://coordinator:***@127.0.0.1:{port}" in line
    assert "check that a nats-server is running" in line


def test_coordinator_status_port_in_use(tmp_path, busy_port):
    args = coordinator_args(tmp_path, "--status-port", str(busy_port))
    code, err = run(args, tmp_path)
    line = one_line(err)
    assert code == STARTUP_FAILURE
    assert f"127.0.0.1:{busy_port}" in line and "already in use" in line
