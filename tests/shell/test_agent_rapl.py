"""CPU and DRAM energy through a real agent: a `ZeusMonitor` window on a fake powercap tree."""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.shell.agent_kit import running_agent
from zeus_agent import emit
from zeus_agent.integrations import ZeusMonitor

WRAP_UJ = 30_000_000  # package 0's counter wraps at 30 J: several times a second at 100 W
POWER_W = {"intel-rapl:0": 100.0, "intel-rapl:0/intel-rapl:0:0": 10.0, "intel-rapl:1": 40.0}
RANGE_UJ = {"intel-rapl:0": WRAP_UJ, "intel-rapl:0/intel-rapl:0:0": 65_712_999_613,
            "intel-rapl:1": 262_143_328_850}
NAMES = {"intel-rapl:0": "package-0", "intel-rapl:0/intel-rapl:0:0": "dram",
         "intel-rapl:1": "package-1"}


class PoweredTree:
    """A powercap tree whose counters advance at constant power (a thread writes them)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.start = time.monotonic()
        for zone, name in NAMES.items():
            path = root / zone
            path.mkdir(parents=True)
            (path / "name").write_text(name + "\n")
            (path / "max_energy_range_uj").write_text(f"{RANGE_UJ[zone]}\n")
        self.write()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def write(self) -> None:
        elapsed = time.monotonic() - self.start
        for zone, power in POWER_W.items():
            raw = int((1_000 + power * elapsed) * 1e6) % RANGE_UJ[zone]
            tmp = self.root / zone / "energy_uj.tmp"
            tmp.write_text(f"{raw}\n")
            os.replace(tmp, self.root / zone / "energy_uj")  # never a half-written counter

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.write()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[PoweredTree]:
    powered = PoweredTree(tmp_path / "powercap")
    yield powered
    powered.stop()


def _window(socket_path: str, cpu_indices: list[int] | None, seconds: float):
    """One ZeusMonitor window in a trainer's thread (requests block their caller)."""
    pub = emit.Publisher(socket_path=socket_path, gpu_index=0)
    try:
        monitor = ZeusMonitor(gpu_indices=[0], cpu_indices=cpu_indices, publisher=pub)
        monitor.begin_window("w")
        time.sleep(seconds)
        return monitor.end_window("w")
    finally:
        pub.close()


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


async def test_a_monitor_window_has_cpu_and_dram_energy(nats_server, tree: PoweredTree) -> None:
    async with running_agent(nats_server.url, rapl_root=str(tree.root), rapl_period_s=0.02,
                             metrics_port=0, metrics_host="127.0.0.1") as agent:
        await asyncio.sleep(0.1)  # a few readings before the window begins
        m = await asyncio.to_thread(_window, agent.settings.socket_path, None, 1.0)
        assert m.gpu_energy[0] > 0  # the simulated GPU's, as before
        assert m.cpu_energy is not None and set(m.cpu_energy) == {0, 1}
        # Package 0 wrapped about three times in the window: every wrap was caught.
        assert m.cpu_energy[0] == pytest.approx(100.0 * m.time, rel=0.1)
        assert m.cpu_energy[1] == pytest.approx(40.0 * m.time, rel=0.1)
        assert m.dram_energy is not None and set(m.dram_energy) == {0}  # 1 has no DRAM
        assert m.dram_energy[0] == pytest.approx(10.0 * m.time, rel=0.1)
        assert agent.rapl.packages[0].cpu.counter.wraps >= 3

        one = await asyncio.to_thread(_window, agent.settings.socket_path, [1], 0.2)
        assert one.cpu_energy is not None and set(one.cpu_energy) == {1}
        assert one.dram_energy is None

        assert agent.metrics_port
        page = await asyncio.to_thread(_scrape, agent.metrics_port)
        node = agent.settings.node
        match = re.search(rf'^zeus_rapl_energy_joules_total\{{Hostname="{node}",cpu="0",'
                          r'domain="package"\} (\S+)$', page, re.MULTILINE)
        assert match and float(match.group(1)) > 100.0
        assert re.search(r'^zeus_rapl_wraps_total\{[^}]*cpu="0",domain="package"\} [1-9]',
                         page, re.MULTILINE)
        assert "zeus_rapl_packages 2.0" in page


async def test_a_node_without_rapl_answers_none(nats_server, tmp_path: Path) -> None:
    async with running_agent(nats_server.url, rapl_root=str(tmp_path / "none")) as agent:
        assert not agent.rapl.available
        m = await asyncio.to_thread(_window, agent.settings.socket_path, None, 0.05)
        assert m.gpu_energy[0] >= 0
        assert (m.cpu_energy, m.dram_energy) == (None, None)
