"""The agent on the NVML backend (against the fake pynvml): calls go through the per-GPU thread,
settings are checked against NVML's tables, NVML errors become coded replies, leases restore."""

from __future__ import annotations

import asyncio
import shutil
import tempfile

from tests.fakes.fake_pynvml import NVML_ERROR_NO_PERMISSION, FakeNVML, a40, p100
from tests.shell.agent_kit import command
from zeus_agent.agent.server import AgentServer
from zeus_agent.config import AgentSettings
from zeus_agent.gpu.nvml import NVMLGPU
from zeus_agent.wire.messages import InfoCmd, LockClocksCmd, SetPowerLimitCmd
from zeus_demo.cluster import wait_for_async


async def start(
    url: str, fake: FakeNVML, node: str, tmp: str
) -> tuple[AgentServer, asyncio.Task]:
    settings = AgentSettings(nats_url=url, backend="nvml", node=node, sample_hz=50.0,
                             socket_path=f"{tmp}/agent.sock")
    gpus = [NVMLGPU(i, nvml=fake) for i in range(len(fake.devices))]
    server = AgentServer(settings, gpus=gpus)
    task = asyncio.create_task(server.serve())
    await asyncio.wait_for(server.started.wait(), 10)
    return server, task


async def test_commands_on_nvml_gpus(nats_server, nc):
    fake = FakeNVML([a40(0), p100(1)])
    tmp = tempfile.mkdtemp(prefix="zan-", dir="/tmp")  # short: AF_UNIX paths are limited
    server, task = await start(nats_server.url, fake, "nvml-node", tmp)
    try:
        info = (await command(nc, "nvml-node", 0, InfoCmd())).result
        assert info["gpu"]["name"] == "NVIDIA A40" and info["gpu"]["architecture"] == "ampere"
        ok = await command(nc, "nvml-node", 0,
                           SetPowerLimitCmd(power_limit_w=175, holder="j", lease_s=0.3))
        assert ok.ok and fake.devices[0].limit_mw == 175_000
        low = await command(nc, "nvml-node", 0, SetPowerLimitCmd(power_limit_w=99))
        assert (low.ok, low.code) == (False, "out_of_range") and "[100, 300] W" in low.error
        odd = await command(nc, "nvml-node", 0, LockClocksCmd(min_mhz=1000, max_mhz=1001))
        assert (odd.ok, odd.code) == (False, "out_of_range")
        fake.inject_error("nvmlDeviceSetGpuLockedClocks", NVML_ERROR_NO_PERMISSION)
        denied = await command(nc, "nvml-node", 0, LockClocksCmd(min_mhz=1005, max_mhz=1005))
        assert (denied.ok, denied.code) == (False, "permission")
        assert "CAP_SYS_ADMIN" in denied.error
        # The pre-Volta GPU has no energy counter: the agent still samples energy.
        blind = (await command(nc, "nvml-node", 1, InfoCmd())).result
        assert blind["gpu"]["has_energy_counter"] is False
        # The 0.3 s lease lapses: the default limit comes back through NVML.
        await wait_for_async(lambda: fake.devices[0].limit_mw == 300_000, 2.5,
                             fail=False)  # (50 x 0.05 s before)
        assert fake.devices[0].limit_mw == 300_000
    finally:
        server.handle_exit()
        try:
            await asyncio.wait_for(task, 10)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
