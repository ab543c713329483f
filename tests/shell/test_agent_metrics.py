"""Telemetry over a real nats-server: batched samples, and the dcgm-style /metrics page."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.error
import urllib.request

import pytest

from tests.shell.agent_kit import Inbox, RawTrainer, command, running_agent, wait_for
from zeus_agent.errors import ZeusAgentError
from zeus_agent.wire.messages import SampleBatch, SetPowerLimitCmd


async def test_samples_are_published_in_batches(nats_server, nc):
    async with running_agent(nats_server.url, sim_count=2) as agent:
        node = agent.settings.node
        inbox = await Inbox.open(nc, f"zeus.gpu.{node}.*.sample")
        batches: dict[int, SampleBatch] = {}
        while len(batches) < 2:  # the first batch may hold only the sample taken at start
            batch = await inbox.next(SampleBatch)
            if len(batch.samples) >= 2:
                batches[batch.gpu] = batch
        for index, batch in batches.items():
            assert (batch.node, batch.uuid) == (node, agent.agents[index].info.uuid)
            samples = batch.samples
            assert all(a.t_ns < b.t_ns for a, b in zip(samples, samples[1:], strict=False))
            assert all(a.energy_j <= b.energy_j for a, b in zip(samples, samples[1:], strict=False))
            assert samples[-1].power_limit_w == 300
            assert samples[-1].memory_clock_mhz > 0 and samples[-1].sm_clock_mhz > 0


async def test_samples_follow_a_new_power_limit(nats_server, nc):
    async with running_agent(nats_server.url) as agent:
        node = agent.settings.node
        assert (await command(nc, node, 0, SetPowerLimitCmd(power_limit_w=180))).ok
        inbox = await Inbox.open(nc, f"zeus.gpu.{node}.0.sample")
        await inbox.until(SampleBatch, lambda b: b.samples[-1].power_limit_w == 180)


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def _value(page: str, name: str, gpu: str) -> float:
    match = re.search(rf'^{name}\{{[^}}]*gpu="{gpu}"[^}}]*\}} (\S+)$', page, re.MULTILINE)
    assert match, f"{name} for gpu {gpu} not found in:\n{page}"
    return float(match.group(1))


async def test_metrics_page_has_dcgm_style_names_and_labels(nats_server, nc):
    async with running_agent(
        nats_server.url, sim_count=2, metrics_port=0, metrics_host="127.0.0.1"
    ) as agent:
        node = agent.settings.node
        assert agent.metrics_port
        assert (await command(nc, node, 1, SetPowerLimitCmd(power_limit_w=220))).ok
        await wait_for(lambda: agent.agents[1].last_sample.power_limit_w == 220, what="sampled")
        trainer = RawTrainer(agent.settings.socket_path)
        trainer.send(b"\xc1garbage")
        trainer.close()
        await wait_for(lambda: agent.gateway.counters["malformed"] == 1, what="counted")
        page = await asyncio.to_thread(_scrape, agent.metrics_port)

    uuid1 = agent.agents[1].info.uuid
    (line,) = [
        x for x in page.splitlines() if x.startswith("DCGM_FI_DEV_POWER_USAGE{") and 'gpu="1"' in x
    ]
    labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
    assert labels == {
        "gpu": "1",
        "UUID": uuid1,
        "device": "nvidia1",
        "modelName": "NVIDIA A40",
        "Hostname": node,
    }
    assert _value(page, "DCGM_FI_DEV_POWER_MGMT_LIMIT", "1") == 220
    assert _value(page, "DCGM_FI_DEV_POWER_MGMT_LIMIT", "0") == 300
    assert _value(page, "zeus_gpu_power_limit_watts", "1") == 220
    energy_mj = _value(page, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "0")
    energy_j = _value(page, "zeus_gpu_energy_joules_total", "0")
    assert energy_mj == energy_j * 1000 and energy_j > 0
    assert _value(page, "DCGM_FI_DEV_POWER_USAGE", "0") > 0
    assert _value(page, "DCGM_FI_DEV_SM_CLOCK", "0") > 0
    assert _value(page, "DCGM_FI_DEV_MEM_CLOCK", "0") > 0
    assert _value(page, "zeus_gpu_power_watts", "0") > 0
    assert 'zeus_agent_datagrams_total{outcome="malformed"} 1.0' in page
    assert "# TYPE zeus_gpu_energy_joules_total counter" in page
    assert _value(page, "zeus_gpu_counter_reads_total", "0") >= 1
    assert 1 <= _value(page, "zeus_gpu_power_limit_reads_total", "0") <= _value(
        page, "zeus_gpu_counter_reads_total", "0"
    )
    assert _value(page, "zeus_gpu_counter_reads_idle", "0") in (0, 1)
    assert _value(page, "zeus_gpu_controllable", "1") == 1
    restores = [x for x in page.splitlines() if x.startswith("zeus_agent_gpu_events_total{")
                and 'gpu="1"' in x and 'event="restores"' in x]
    assert len(restores) == 1  # each GPU's event counters are exported, zeros included
    assert "zeus_agent_nats_connected 1.0" in page


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_status_server_serves_healthz_metrics_and_404():
    """`zeus_agent.status_http`, the server both services use for /healthz and /metrics."""
    from prometheus_client import CollectorRegistry, Counter

    from zeus_agent import status_http

    registry = CollectorRegistry()
    Counter("demo_things", "Things.", registry=registry).inc(3)
    state = {"ok": True}

    def health() -> tuple[bool, dict]:
        if state["ok"] is None:
            raise RuntimeError("check broke")
        return bool(state["ok"]), {"status": "ok" if state["ok"] else "disconnected"}

    server = status_http.start("127.0.0.1", 0, health, registry=registry)
    try:
        base = server.url
        assert _json(_get(f"{base}/healthz")) == (200, {"ok": True, "status": "ok"})
        state["ok"] = False
        assert _json(_get(f"{base}/healthz")) == (503, {"ok": False, "status": "disconnected"})
        state["ok"] = None
        code, body = _json(_get(f"{base}/healthz"))
        assert (code, body["status"], body["reason"]) == (503, "error", "check broke")
        code, page = _get(f"{base}/metrics")
        assert code == 200 and "demo_things_total 3.0" in page
        assert _get(f"{base}/nothing")[0] == 404
        with pytest.raises(ZeusAgentError, match="already in use"):
            status_http.start("127.0.0.1", server.port, health)
    finally:
        server.close()
        server.close()  # idempotent


def _json(answer: tuple[int, str]) -> tuple[int, dict]:
    return answer[0], json.loads(answer[1])
