"""Observe-only agents (issue "Observe-only agents, honest about privileges"): no NVML setter or
reset is ever called with `--observe-only`, commands that would change a setting get
`read_only`, and the announcement says the GPU cannot be controlled; an agent that finds it
lacks the privilege (NVML: NO_PERMISSION) becomes observe-only by itself. Against a real
nats-server, with the fake pynvml recording every call."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from typing import Any

import pytest

from tests.fakes.fake_pynvml import NVML_ERROR_NO_PERMISSION, FakeNVML, a40
from tests.shell.agent_kit import command
from zeus_agent.agent.server import AgentServer
from zeus_agent.config import AgentSettings
from zeus_agent.errors import ReadOnlyError
from zeus_agent.gpu.nvml import NVMLGPU
from zeus_agent.gpu.observe_only import ObserveOnlyGPU
from zeus_agent.models import FrequencySchedule
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import (
    AgentHello,
    ClearScheduleCmd,
    GpuDescription,
    InfoCmd,
    InstallScheduleCmd,
    LockClocksCmd,
    ResetClocksCmd,
    ResetPowerLimitCmd,
    SetPowerLimitCmd,
)
from zeus_demo.cluster import wait_for_async

SETTERS = ("nvmlDeviceSetPowerManagementLimit", "nvmlDeviceSetGpuLockedClocks",
           "nvmlDeviceResetGpuLockedClocks", "nvmlDeviceSetPersistenceMode")


def setter_calls(fake: FakeNVML) -> list[str]:
    return [name for name, _, _ in fake.calls
            if name.startswith(("nvmlDeviceSet", "nvmlDeviceReset", "nvmlDeviceClear"))]


async def start(url: str, fake: FakeNVML, node: str, tmp: str,
                **settings: Any) -> tuple[AgentServer, asyncio.Task]:
    values: dict[str, Any] = {"nats_url": url, "backend": "nvml", "node": node,
                              "sample_hz": 50.0, "heartbeat_s": 0.3,
                              "socket_path": f"{tmp}/agent.sock"}
    server = AgentServer(AgentSettings(**(values | settings)),
                         gpus=[NVMLGPU(i, nvml=fake) for i in range(len(fake.devices))])
    task = asyncio.create_task(server.serve())
    await asyncio.wait_for(server.started.wait(), 10)
    return server, task


async def hellos(nc: Any, node: str) -> list[AgentHello]:
    got: list[AgentHello] = []

    async def cb(msg: Any) -> None:
        got.append(codec.decode(msg.data, AgentHello))

    await nc.subscribe(subjects.agent_hello(node), cb=cb)
    return got


# ---------------------------------------------------------------------------- the wrapper
class Backend:
    """A backend that counts what it is asked."""

    index = 3
    calls_block = True

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> int:
            self.calls.append(name)
            return 7

        return call


@pytest.mark.parametrize("setter, args", [
    ("set_power_limit_w", (200,)), ("reset_power_limit", ()), ("lock_sm_clocks_mhz", (1, 2)),
    ("reset_sm_clocks", ()), ("set_persistence_mode", (True,)),
    ("lock_memory_clocks_mhz", (1, 2)), ("set_anything", ()), ("clear_accounting", ()),
])
def test_the_wrapper_refuses_every_setter_without_calling_the_backend(setter, args) -> None:
    backend = Backend()
    gpu = ObserveOnlyGPU(backend)  # type: ignore[arg-type]
    with pytest.raises(ReadOnlyError, match="--observe-only"):
        getattr(gpu, setter)(*args)
    assert backend.calls == []
    assert gpu.get_power_limit_w() == 7 and gpu.get_total_energy_j() == 7
    assert gpu.calls_block is True and gpu.index == 3
    assert backend.calls == ["get_power_limit_w", "get_total_energy_j"]


def test_the_wrapper_passes_the_backends_own_reads_through() -> None:
    """`read_status` and `read_telemetry` are the backend's, not the base class's per-getter
    version (the simulator reads its device file once for all of them)."""
    backend = Backend()
    gpu = ObserveOnlyGPU(backend)  # type: ignore[arg-type]
    assert gpu.read_status() == 7 and gpu.read_telemetry() == 7
    assert backend.calls == ["read_status", "read_telemetry"]


def test_controllable_is_sent_only_when_false() -> None:
    """Coordinators that predate the field keep accepting controllable GPUs' announcements."""
    desc = GpuDescription(index=0, uuid="u", name="n", architecture="a", min_power_limit_w=1,
                          max_power_limit_w=2, default_power_limit_w=2,
                          supported_memory_clocks_mhz=[], supported_graphics_clocks_mhz=[],
                          has_energy_counter=True, power_limit_w=2)
    assert "controllable" not in codec.unpack(codec.encode(desc))
    off = desc.model_copy(update={"controllable": False})
    assert codec.unpack(codec.encode(off))["controllable"] is False
    assert codec.validate(GpuDescription, codec.unpack(codec.encode(off))).controllable is False
    assert codec.validate(GpuDescription, codec.unpack(codec.encode(desc))).controllable is True


# ---------------------------------------------------------------------------- the agent
async def test_an_observe_only_agent_never_calls_a_setter(nats_server, nc) -> None:
    fake = FakeNVML([a40(0)])
    fake.devices[0].limit_mw = 250_000  # Someone else's setting: it must stay.
    tmp = tempfile.mkdtemp(prefix="zoo-", dir="/tmp")
    node = "observed-node"
    heard = await hellos(nc, node)
    # reset_on_start stays at its default (True): observe-only wins over it.
    server, task = await start(nats_server.url, fake, node, tmp, observe_only=True)
    try:
        schedule = FrequencySchedule(rank=0, frequencies=[("forward", 1740)])
        for cmd in (SetPowerLimitCmd(power_limit_w=200, holder="j", lease_s=5),
                    SetPowerLimitCmd(power_limit_w=300), ResetPowerLimitCmd(),
                    LockClocksCmd(min_mhz=1740, max_mhz=1740), ResetClocksCmd(),
                    InstallScheduleCmd(job_id="j", schedule=schedule, holder="j", lease_s=5),
                    ClearScheduleCmd()):
            reply = await command(nc, node, 0, cmd)
            if cmd.op in ("clear_schedule", "reset_clocks", "reset_power_limit"):
                # Nothing to undo (nothing was set): answered, and still no setter called.
                assert reply.ok or reply.code == "read_only", (cmd, reply)
            else:
                assert (reply.ok, reply.code) == (False, "read_only"), (cmd, reply)
                assert "--observe-only" in reply.error
        info = (await command(nc, node, 0, InfoCmd())).result
        assert info["gpu"]["controllable"] is False
        sampled = server.agents[0].counters.get("sample_errors", 0)
        await asyncio.sleep(0.3)
        assert server.agents[0].counters.get("sample_errors", 0) == sampled
        await wait_for_async(lambda: heard, 5, fail=False)  # (100 x 0.05 s before)
        assert heard and heard[-1].gpus[0].controllable is False
        assert server.agents[0].last_sample is not None  # Sampling works.
    finally:
        server.handle_exit()
        await asyncio.wait_for(task, 10)
        shutil.rmtree(tmp, ignore_errors=True)
    assert setter_calls(fake) == []  # Not at start, not for a command, not at shutdown.
    assert fake.devices[0].limit_mw == 250_000


async def test_no_permission_makes_the_agent_observe_only_and_says_so(nats_server, nc,
                                                                      caplog) -> None:
    fake = FakeNVML([a40(0)])
    for name in SETTERS:
        fake.inject_error(name, NVML_ERROR_NO_PERMISSION)
    fake.inject_error("nvmlDeviceResetGpuLockedClocks", NVML_ERROR_NO_PERMISSION)
    tmp = tempfile.mkdtemp(prefix="zoo-", dir="/tmp")
    node = "unprivileged-node"
    heard = await hellos(nc, node)
    server, task = await start(nats_server.url, fake, node, tmp)  # Resets at start: refused.
    try:
        info = (await command(nc, node, 0, InfoCmd())).result
        assert info["gpu"]["controllable"] is False
        tried = len(setter_calls(fake))
        assert tried >= 1  # The reset at start found it out.
        for _ in range(3):
            reply = await command(nc, node, 0, SetPowerLimitCmd(power_limit_w=200, holder="j",
                                                                lease_s=5))
            assert (reply.ok, reply.code) == (False, "read_only"), reply
            assert "CAP_SYS_ADMIN" in reply.error
        assert len(setter_calls(fake)) == tried  # Refused at once, not command by command.
        await wait_for_async(lambda: heard, 5, fail=False)  # (100 x 0.05 s before)
        assert heard and not heard[-1].gpus[0].controllable
        said = [r for r in caplog.records if "observe-only from now on" in r.getMessage()]
        assert len(said) == 1 and "CAP_SYS_ADMIN" in said[0].getMessage()
    finally:
        server.handle_exit()
        await asyncio.wait_for(task, 10)
        shutil.rmtree(tmp, ignore_errors=True)


async def test_a_permission_found_out_by_a_command_is_announced_at_once(nats_server, nc) -> None:
    """Without a reset at start, the first refused setter finds it out; the announcement
    comes at once (not at the next heartbeat), and what was set before is still undone."""
    fake = FakeNVML([a40(0)])
    tmp = tempfile.mkdtemp(prefix="zoo-", dir="/tmp")
    node = "half-privileged-node"
    heard = await hellos(nc, node)
    server, task = await start(nats_server.url, fake, node, tmp, reset_on_start=False,
                               heartbeat_s=60)
    try:
        ok = await command(nc, node, 0, SetPowerLimitCmd(power_limit_w=200, holder="j",
                                                         lease_s=0.5))
        assert ok.ok and fake.devices[0].limit_mw == 200_000
        fake.inject_error("nvmlDeviceSetGpuLockedClocks", NVML_ERROR_NO_PERMISSION)
        denied = await command(nc, node, 0, LockClocksCmd(min_mhz=1740, max_mhz=1740))
        assert (denied.ok, denied.code) == (False, "permission"), denied
        await wait_for_async(lambda: heard and not heard[-1].gpus[0].controllable, 5,
                             fail=False)
        assert heard and not heard[-1].gpus[0].controllable
        again = await command(nc, node, 0, SetPowerLimitCmd(power_limit_w=150))
        assert again.code == "read_only"
        # The 0.5 s lease of the limit set before lapses: it is put back, never left throttled.
        await wait_for_async(lambda: fake.devices[0].limit_mw == 300_000, 5, fail=False)
        assert fake.devices[0].limit_mw == 300_000
    finally:
        server.handle_exit()
        await asyncio.wait_for(task, 10)
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------- the coordinator
async def test_a_job_on_an_observe_only_gpu_is_refused_at_rank_registration(
        nats_server, nc, tmp_path) -> None:
    from tests.shell.coordinator_kit import (
        JOIN_TOKENS,
        NODE,
        ask,
        rank_request,
        register_job,
        start,
        stop,
    )
    from zeus_agent.gpu.sim import SimGPU

    agent = AgentServer(AgentSettings(
        nats_url=nats_server.url, backend="sim", sim_count=2, sim_preset="A40",
        sim_energy_update_ms=0, sim_state_dir=str(tmp_path / "gpus"),
        socket_path=str(tmp_path / "agent.sock"), node=NODE, sample_hz=20, observe_only=True))
    agent_task = asyncio.create_task(agent.serve())
    await asyncio.wait_for(agent.started.wait(), 10)
    coord, task = await start(nats_server, tmp_path / "coord")
    try:
        job_id = await register_job(nc, dp=2)
        assert JOIN_TOKENS[job_id]
        reply = await ask(nc, subjects.coord_register_rank(NODE), rank_request(job_id, 0))
        assert (reply.ok, reply.code) == (False, "read_only"), reply
        assert f"GPU 0 on node {NODE!r} is observe-only" in reply.error
        assert "--observe-only" in reply.error and "CAP_SYS_ADMIN" in reply.error
        assert not coord.registry.jobs[job_id].ranks  # Nothing half registered.
        assert SimGPU.open(str(tmp_path / "gpus"), 0).get_power_limit_w() == 300
    finally:
        await stop(coord, task)
        agent.handle_exit()
        await asyncio.wait_for(agent_task, 10)


def test_watch_says_which_gpus_are_observe_only() -> None:
    from coordinator.watch import control_changes

    def hello(*controllable: bool) -> AgentHello:
        gpus = [GpuDescription(index=i, uuid=f"u{i}", name="n", architecture="a",
                               min_power_limit_w=1, max_power_limit_w=2,
                               default_power_limit_w=2, supported_memory_clocks_mhz=[],
                               supported_graphics_clocks_mhz=[], has_energy_counter=True,
                               power_limit_w=2, controllable=c)
                for i, c in enumerate(controllable)]
        return AgentHello(node="n1", agent_id="a", backend="sim", heartbeat_s=5,
                          socket_path="/s", gpus=gpus)

    known: dict[tuple[str, int], bool] = {}
    first = control_changes(hello(True, False), known)
    assert len(first) == 1 and "n1/gpu1 [observe-only]" in first[0]
    assert control_changes(hello(True, False), known) == []  # Once, not every heartbeat.
    back = control_changes(hello(True, True), known)
    assert len(back) == 1 and "n1/gpu1 [controllable]" in back[0]
