"""Failsafe over a real nats-server: leases expire and restore defaults; renewals keep them;
shutdown and a dead trainer restore the GPU."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

from tests.shell.agent_kit import (
    Inbox,
    RawTrainer,
    command,
    running_agent,
    stop_agent,
    wait_for,
)
from zeus_agent.models import FrequencySchedule
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import (
    ErrorEvent,
    InfoCmd,
    InstallScheduleCmd,
    LeaseRenewal,
    LockClocksCmd,
    SetPowerLimitCmd,
)
from zeus_agent.wire.trainer import Kind
from zeus_demo.cluster import Processes


async def test_lease_expiry_restores_the_power_limit_and_reports_it(nats_server, nc):
    async with running_agent(nats_server.url) as agent:
        node, gpu = agent.settings.node, agent.agents[0].gpu
        errors = await Inbox.open(nc, f"zeus.gpu.{node}.0.error")
        cmd = SetPowerLimitCmd(power_limit_w=150, holder="coordX", lease_s=0.3)
        assert (await command(nc, node, 0, cmd)).ok
        assert gpu.get_power_limit_w() == 150
        event = await errors.until(ErrorEvent, lambda e: e.code == "lease_expired", timeout_s=2)
        assert "coordX" in event.message and event.detail == {"restored": ["power_limit"]}
        assert gpu.get_power_limit_w() == 300
        assert (await command(nc, node, 0, InfoCmd())).result["leases"] == []


async def test_lease_expiry_unlocks_clocks_and_drops_the_schedule(nats_server, nc):
    async with running_agent(nats_server.url) as agent:
        node, gpu = agent.settings.node, agent.agents[0].gpu
        lock = LockClocksCmd(min_mhz=900, max_mhz=900, holder="c", lease_s=0.2)
        assert (await command(nc, node, 0, lock)).ok
        schedule = FrequencySchedule(rank=0, frequencies=[("forward", 1200)])
        install = InstallScheduleCmd(job_id="j", schedule=schedule, holder="c", lease_s=0.2)
        assert (await command(nc, node, 0, install)).ok
        await wait_for(lambda: not agent.agents[0].cursor.installed, 2, "schedule dropped")
        await wait_for(lambda: gpu.get_locked_sm_clocks_mhz() is None, 2, "clocks unlocked")


async def test_renewal_on_the_lease_subject_keeps_settings_until_it_stops(nats_server, nc):
    async with running_agent(nats_server.url, sim_count=2) as agent:
        node = agent.settings.node
        for i in (0, 1):
            cmd = SetPowerLimitCmd(power_limit_w=175, holder="job-9", lease_s=0.3)
            assert (await command(nc, node, i, cmd)).ok
        # a bad renewal is ignored, and another holder's renewal does not help
        await nc.publish(subjects.lease_renewal("job-9"), b"\xc1junk")
        for _ in range(8):  # 0.8 s, well past the 0.3 s lease
            renewal = LeaseRenewal(holder="job-9", lease_s=0.3)
            await nc.publish(subjects.lease_renewal("job-9"), codec.encode(renewal))
            await asyncio.sleep(0.1)
        assert [a.gpu.get_power_limit_w() for a in agent.agents.values()] == [175, 175]
        await asyncio.sleep(0.6)  # renewals stopped: the leases lapse
        assert [a.gpu.get_power_limit_w() for a in agent.agents.values()] == [300, 300]


async def test_shutdown_restores_everything_it_changed(nats_server, nc):
    async with running_agent(nats_server.url, sim_count=2) as agent:
        node = agent.settings.node
        set_pl = SetPowerLimitCmd(power_limit_w=120, holder="h", lease_s=60)
        assert (await command(nc, node, 0, set_pl)).ok
        lock = LockClocksCmd(min_mhz=1005, max_mhz=1005, holder="h", lease_s=60)
        assert (await command(nc, node, 1, lock)).ok
        gpus = [a.gpu for a in agent.agents.values()]
        await stop_agent(agent)  # what SIGTERM/SIGINT do (install_signal_handlers)
        assert [g.get_power_limit_w() for g in gpus] == [300, 300]
        assert [g.get_locked_sm_clocks_mhz() for g in gpus] == [None, None]


async def test_signal_handlers_start_a_graceful_shutdown(nats_server, nc):
    async with running_agent(nats_server.url) as agent:
        agent.install_signal_handlers()
        try:
            set_pl = SetPowerLimitCmd(power_limit_w=110, holder="h", lease_s=60)
            assert (await command(nc, agent.settings.node, 0, set_pl)).ok
            os.kill(os.getpid(), signal.SIGINT)
            await asyncio.wait_for(agent.serve_task, 10)
        finally:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        assert agent.agents[0].gpu.get_power_limit_w() == 300


TRAINER = textwrap.dedent(
    """
    import os, socket, sys, time
    from zeus_agent.wire import trainer as dg
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(""); s.connect(sys.argv[1]); s.settimeout(5)
    hello = dg.TrainerHello(job_id="doomed", rank=0, gpu_index=0)
    s.send(dg.encode_request(dg.Kind.HELLO, os.getpid(), 1, hello))
    assert dg.decode_datagram(s.recv(65536)).reply.ok
    print("bound", flush=True)
    time.sleep(60)
    """
)


async def test_a_trainer_killed_with_sigkill_gets_its_gpu_restored(nats_server, nc, tmp_path):
    async with running_agent(nats_server.url) as agent:
        node, gpu = agent.settings.node, agent.agents[0].gpu
        errors = await Inbox.open(nc, f"zeus.gpu.{node}.0.error")
        procs = Processes(tmp_path)
        proc = procs.spawn("trainer", [sys.executable, "-c", TRAINER, agent.settings.socket_path],
                           stdout=subprocess.PIPE)
        try:
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 10)
            assert line == b"bound\n", procs.log("trainer")
            set_pl = SetPowerLimitCmd(power_limit_w=140, holder="doomed", lease_s=60)
            assert (await command(nc, node, 0, set_pl)).ok
            binding = (await command(nc, node, 0, InfoCmd())).result["binding"]
            assert binding["pid"] == proc.pid
        finally:
            await asyncio.to_thread(procs.close)  # SIGKILL: no goodbye; reaped
            proc.stdout.close()
        event = await errors.until(ErrorEvent, lambda e: e.code == "trainer_gone", timeout_s=2)
        assert str(proc.pid) in event.message
        assert gpu.get_power_limit_w() == 300
        assert (await command(nc, node, 0, InfoCmd())).result["binding"] is None


async def test_a_trainer_that_says_bye_releases_without_waiting(nats_server):
    async with running_agent(nats_server.url) as agent:
        trainer = RawTrainer(agent.settings.socket_path)
        try:
            assert (await trainer.hello("polite")).ok
            await agent.agents[0].set_power_limit(200, "polite", 60)
            reply = await trainer.request(Kind.BYE, {})
            assert reply.ok and reply.result["restored"] == ["gpu0:power_limit"]
            assert agent.agents[0].gpu.get_power_limit_w() == 300
        finally:
            trainer.close()


async def test_an_agent_resets_what_a_killed_predecessor_left(nats_server, nc, tmp_path):
    """A SIGKILLed agent restores nothing; the next agent on the node resets at start."""
    state_dir = str(tmp_path / "sim")
    async with running_agent(nats_server.url, sim_count=1, sim_state_dir=state_dir) as first:
        gpu = first.agents[0].gpu
    # Leave the device throttled, as a killed agent would.
    gpu.set_power_limit_w(150)
    gpu.lock_sm_clocks_mhz(900, 900)
    async with running_agent(
        nats_server.url, sim_count=1, sim_state_dir=state_dir, sim_attach=True
    ) as second:
        assert second.agents[0].gpu.get_power_limit_w() == 300
        assert second.agents[0].gpu.get_locked_sm_clocks_mhz() is None
    gpu.set_power_limit_w(150)
    async with running_agent(
        nats_server.url, sim_count=1, sim_state_dir=state_dir, sim_attach=True,
        reset_on_start=False,
    ) as third:  # fmt: skip
        assert third.agents[0].gpu.get_power_limit_w() == 150
