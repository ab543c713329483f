"""nats-server SIGKILLed (not stopped: no goodbye to its clients) and started again.

Real processes (`zeus_demo.cluster.SimCluster`): nats-server, `zeus-coordinator run`, two
agents with one simulated A40 each (`--metrics-port`), a simulated one-GPU job bound to
node-a's GPU only; node-b's agent has no trainer, so it reads its energy counter in idle mode
(~once a second, `zeus_gpu_counter_reads_idle` 1). The server is SIGKILLed, left down until
both agents say (`zeus_agent_nats_connected` 0) they lost it, and started again on the same
port and JetStream directory. A killed server closed nothing: nats-py reconnects (the agents'
exit code 4 is for a server that closed the connection for good), so both agents keep running,
report the bus connected again, their samples flow again, node-b's reads stay idle and node-a's
(its trainer still bound) stay at every update, and the counters keep counting.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import urllib.request
from typing import Any

import pytest

from tests.e2e.job_kit import SCALE, WORKLOAD, options
from tests.repo_kit import REPO_ROOT
from zeus_agent.wire import subjects
from zeus_demo.cluster import SimCluster, free_port, processes_with_mark, wait_for_async


class MetricsCluster(SimCluster):
    """A `SimCluster` whose agents each serve Prometheus `/metrics` on a port of their own."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.metrics_ports: dict[str, int] = {}

    def start_agent(self, node: str, attach: bool = False) -> None:
        port = self.metrics_ports.setdefault(node, free_port())
        common = self.agent_args
        self.agent_args = [*common, "--metrics-port", str(port)]
        try:
            super().start_agent(node, attach)
        finally:
            self.agent_args = common

    async def metrics(self, node: str) -> dict[str, float]:
        """The agent's metrics without labels other than the GPU's (one GPU per agent)."""
        def get() -> str:
            url = f"http://127.0.0.1:{self.metrics_ports[node]}/metrics"
            with urllib.request.urlopen(url, timeout=2) as r:
                return str(r.read().decode())
        out: dict[str, float] = {}
        for line in (await asyncio.to_thread(get)).splitlines():
            if line and not line.startswith("#") and "event=" not in line:
                name, value = line.split("{", 1)[0].split(" ", 1)[0], line.rsplit(" ", 1)[1]
                out[name] = float(value)
        return out

    async def wait_metrics(self, node: str, predicate: Any, timeout_s: float,
                           what: str) -> dict[str, float]:
        last: dict[str, float] = {}

        async def reached() -> dict[str, float] | None:
            try:
                values = await self.metrics(node)
            except OSError:
                values = {}
            last.clear()
            last.update(values)
            return values if values and predicate(values) else None

        return await wait_for_async(
            reached, timeout_s, lambda: f"{node}: {what} not within {timeout_s} s: {last}\n"
            + self.procs.log(f"agent-{node}"), interval_s=0.1)


@pytest.mark.timeout(120)
async def test_a_killed_nats_server_restarted_agents_reconnect_and_read_rates_resume() -> None:
    c = MetricsCluster(gpus_per_node=1)
    samples: list[tuple[float, str]] = []
    try:
        await c.start()

        async def on_sample(msg: Any) -> None:
            samples.append((time.monotonic(), msg.subject.split(".")[2]))

        await c.nc.subscribe(f"{subjects.DEFAULT_PREFIX}.gpu.*.*.sample", cb=on_sample)
        spec = {
            "placements": [{"node": "node-a", "socket_path": str(c.socket_path("node-a")),
                            "sim_state_dir": str(c.sim_dir("node-a")), "gpu_index": 0}],
            "options": {"workload": WORKLOAD, "steps_per_epoch": 500, "scale": SCALE,
                        "power_limit": options(6), "job_metadata": c.tag, "seed": 0,
                        "noise": True},
            "timeout_s": 100, "out": str(c.trainer_out)}
        c.procs.spawn("trainer", [sys.executable, "-m", "zeus_demo.cluster.trainer",
                                  json.dumps(spec)], cwd=REPO_ROOT)
        await c.wait_status(lambda s: s.state == "profiling", 30, "profiling")
        active = "zeus_gpu_counter_reads_idle"
        await c.wait_metrics("node-a", lambda m: m[active] == 0, 20, "reads at every update")
        await c.wait_metrics("node-b", lambda m: m[active] == 1, 20, "idle reads")

        server = c.nats._proc  # The nats-server process EmbeddedNats started.
        os.kill(server.pid, signal.SIGKILL)
        await asyncio.to_thread(server.wait, 10)
        killed_at = time.monotonic()
        for node in c.nodes:
            await c.wait_metrics(node, lambda m: m["zeus_agent_nats_connected"] == 0, 20,
                                 "the bus seen lost")
        await c.stop_nats()  # (Its files only: the process is gone.)
        await c.start_nats()  # Same port, same JetStream directory.
        await c.wait(lambda: c.nc.is_connected, 20)

        before = {n: await c.metrics(n) for n in c.nodes}
        for node in c.nodes:
            await c.wait_metrics(node, lambda m: m["zeus_agent_nats_connected"] == 1, 30,
                                 "reconnected")
            await c.wait(lambda node=node: any(t > killed_at and n == node
                                               for t, n in samples), 20)
        assert all(c.procs.alive(f"agent-{n}") for n in c.nodes), c.procs.all_logs()
        assert c.procs.alive("trainer"), c.procs.log("trainer")
        reads = "zeus_gpu_counter_reads_total"
        after_a = await c.wait_metrics(
            "node-a", lambda m: m[active] == 0 and m[reads] > before["node-a"][reads] + 20, 20,
            "reads at every update again")
        after_b = await c.wait_metrics(
            "node-b", lambda m: m[active] == 1 and m[reads] > before["node-b"][reads], 20,
            "idle reads again")
        print(f"reads since the restart: node-a {after_a[reads] - before['node-a'][reads]:.0f}"
              f", node-b {after_b[reads] - before['node-b'][reads]:.0f}")
        # The coordinator is back too (its state in JetStream recovered from the kill), and the
        # job chose its limit (before or after the kill).
        await c.wait_coordinator()
        _, done = await c.wait_status(lambda s: s.state == "done", 40, "done")
        assert (await c.query(done.job_id))["power_limit"]["optimal_power_limit_w"] == \
            done.progress["optimal_power_limit_w"]
    finally:
        await c.close()
    assert processes_with_mark(c.procs.mark) == []
