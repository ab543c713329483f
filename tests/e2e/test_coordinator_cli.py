"""`zeus-coordinator` as a user runs it: help, a dead NATS, a real run answering a
registration and exiting cleanly on SIGTERM, and the log level from the environment."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from typing import Any

import pytest

from coordinator.state import records
from zeus_agent.broker import connect
from zeus_agent.models import JobInfo
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import JobQuery, RegisterJob, Reply
from zeus_demo.cluster import Processes, console_script, wait_for_async


def exe() -> list[str]:
    return console_script("zeus-coordinator", "coordinator.cli")


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 30):
    return subprocess.run([*exe(), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--help"], ["run", "power-limit", "--nats-url"]),
        (["run", "--help"], ["--nats-url", "--state-dir", "--max-job-idle-time", "--log-level"]),
    ],
)
def test_help_exits_0_and_explains(args, words):
    result = run(*args)
    assert result.returncode == 0, result.stderr
    for word in words:
        assert word in result.stdout


def test_unknown_command_is_a_usage_error():
    result = run("serve")
    assert result.returncode == 2
    assert "invalid choice" in result.stderr


def test_unreachable_nats_fails_fast_with_advice(tmp_path):
    start = time.monotonic()
    result = run("run", "--nats-url", "nats://127.0.0.1:1", "--state-dir", str(tmp_path),
                 "--connect-timeout-s", "1")
    assert result.returncode == 3, result.stderr
    assert time.monotonic() - start < 15
    assert "could not connect to NATS at nats://127.0.0.1:1" in result.stderr
    assert "--embedded-nats" in result.stderr


def test_bad_configuration_is_exit_2(tmp_path):
    result = run("run", "--state-dir", str(tmp_path), env={"ZEUS_PFO_LOG_LEVEL": "loud"})
    assert result.returncode == 2
    assert "log_level must be one of" in result.stderr


async def until_up(procs: Processes, nc: Any, subject: str, payload: Any) -> Reply:
    """The coordinator's reply to a request sent until it is up (30 s: 100 tries of up to 0.3 s
    each, as before); its log in the failure if it exits first."""
    async def answered() -> Reply | None:
        assert procs.alive("coordinator"), procs.text("coordinator")
        try:
            msg = await nc.request(subject, codec.encode(payload), timeout=0.2)
        except Exception:  # noqa: BLE001 - not up yet
            return None
        return codec.decode(msg.data, Reply)

    return await wait_for_async(answered, 30, lambda: "the coordinator did not answer:\n"
                                + procs.text("coordinator"), interval_s=0.1)


async def test_runs_answers_and_exits_0_on_sigterm(nats_server, tmp_path):
    bucket = f"cli-{os.getpid()}"
    env = {"ZEUS_PFO_LOG_LEVEL": "debug", "ZEUS_PFO_STATE_BUCKET": bucket}
    procs = Processes(tmp_path)  # its stderr: procs.text("coordinator")
    procs.spawn("coordinator", [*exe(), "run", "--nats-url", nats_server.url, "--state-dir",
                                str(tmp_path / "st")], env=env)
    nc = await connect(nats_server.url, "cli-test")
    try:
        job = RegisterJob(job=JobInfo(dp_degree=1, pp_degree=1, tp_degree=1, world_size=1))
        reply = await until_up(procs, nc, subjects.coord_register_job("n0"), job)
        assert reply is not None and reply.ok, reply
        job_id = reply.result["job_id"]
        msg = await nc.request(subjects.coord_job_query(), codec.encode(JobQuery()), timeout=2)
        assert job_id in codec.decode(msg.data, Reply).result["jobs"]
    finally:
        code = await asyncio.to_thread(procs.stop, "coordinator", 15)  # SIGTERM
        procs.close()
    err = procs.text("coordinator")
    try:
        assert code == 0, err
        assert " DEBUG " in err  # ZEUS_PFO_LOG_LEVEL=debug, upper-cased.
        assert "coordinator stopped" in err
        # The job outlives the process, in JetStream.
        kv = await nc.jetstream().key_value(bucket)
        entry = await kv.get(records.job_key(job_id))
        assert json.loads(entry.value)["job_id"] == job_id
    finally:
        await nc.drain()


async def test_watch_prints_status_events_and_once_prints_the_job(nats_server, tmp_path):
    from coordinator.config import CoordinatorSettings
    from coordinator.service import CoordinatorService

    coord = CoordinatorService(
        CoordinatorSettings(nats_url=nats_server.url, state_dir=str(tmp_path / "state"))
    )
    task = asyncio.create_task(coord.serve())
    await asyncio.wait_for(coord.started.wait(), 10)
    procs = Processes(tmp_path)  # the watchers' stdout comes here, read in a thread
    watcher = procs.spawn("watch", [*exe(), "watch", "--nats-url", nats_server.url],
                          stdout=subprocess.PIPE)
    assert watcher.stdout is not None

    async def line(timeout_s: float) -> bytes:
        return await asyncio.wait_for(asyncio.to_thread(watcher.stdout.readline), timeout_s)

    nc = await connect(nats_server.url, "watch-test")
    try:
        first = await line(20)
        assert b"watching zeus.job.*.status" in first
        job = RegisterJob(job=JobInfo(pp_degree=1, dp_degree=2, tp_degree=1, world_size=2))
        msg = await nc.request(subjects.coord_register_job("n0"), codec.encode(job), timeout=5)
        job_id = codec.decode(msg.data, Reply).result["job_id"]
        got = await line(10)
        assert job_id.encode() in got and b"[registered]" in got
        once = procs.spawn("watch-once", [*exe(), "watch", job_id, "--once", "--nats-url",
                                          nats_server.url], stdout=subprocess.PIPE)
        out, _ = await asyncio.to_thread(once.communicate, timeout=30)
        assert once.returncode == 0 and job_id.encode() in out and b'"world_size": 2' in out
    finally:
        watcher.send_signal(signal.SIGINT)
        assert await asyncio.to_thread(watcher.wait, 10) == 0, procs.log("watch")
        procs.close()
        watcher.stdout.close()
        await nc.drain()
        coord.should_exit.set()
        await task


async def test_a_zeus_configuration_naming_only_a_plan_starts(nats_server, tmp_path):
    # Zeus 0.16 runs PointSolution when ZEUS_PFO_SCHEDULER is unset; its log levels include
    # notset (and warn, fatal), in any case.
    plan = tmp_path / "freqs_pipeline_00000.py"
    plan.write_text(repr([[("forward", 1410), ("backward", 1410)]]))
    env = {"ZEUS_PFO_LOG_LEVEL": "notset",
           "ZEUS_PFO_SCHEDULER_ARGS": json.dumps({"solution_path": str(plan)}),
           "ZEUS_PFO_STATE_BUCKET": f"cli-plan-{os.getpid()}", "ZEUS_PFO_SCHEDULER": None}
    procs = Processes(tmp_path)  # its stderr: procs.text("coordinator")
    procs.spawn("coordinator", [*exe(), "run", "--nats-url", nats_server.url, "--state-dir",
                                str(tmp_path / "st")], env=env)
    nc = await connect(nats_server.url, "cli-plan-test")
    try:
        await until_up(procs, nc, subjects.coord_job_query(), JobQuery())
    finally:
        await nc.drain()
        code = await asyncio.to_thread(procs.stop, "coordinator", 15)  # SIGTERM
        procs.close()
    err = procs.text("coordinator")
    assert code == 0, err
    assert ("pipeline jobs: no scheduler named and scheduler_args hold a solution_path: "
            "running PointSolution (Zeus 0.16's default) on that plan") in err
    assert " DEBUG " in err  # notset: everything is logged.
