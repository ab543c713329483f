"""Prometheus metrics of a node agent, named in the style of dcgm-exporter.

A custom collector reads each `GpuAgent`'s latest sample at scrape time, so the sampling loop
does no metrics work. Labels: `Hostname`, `gpu` (index), `UUID`, `modelName`.

| metric | type | unit |
|---|---|---|
| `zeus_gpu_energy_joules_total` | counter | J since the driver started counting |
| `zeus_gpu_power_watts` | gauge | W |
| `zeus_gpu_power_limit_watts` | gauge | W |
| `zeus_gpu_sm_clock_mhz` | gauge | MHz |
| `zeus_gpu_memory_clock_mhz` | gauge | MHz |
| `zeus_agent_datagrams_total{outcome}` | counter | trainer datagrams by outcome |
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from zeus_agent.agent.gpu_agent import GpuAgent

LABELS = ["Hostname", "gpu", "UUID", "modelName"]


class AgentCollector(Collector):
    """Yields the metrics above from the agents' latest samples."""

    def __init__(self, agents: Mapping[int, GpuAgent], gateway_counters: Callable[[], Mapping[str, int]]):
        self.agents = agents
        self.gateway_counters = gateway_counters

    def collect(self) -> Iterable[Metric]:  # noqa: D102
        energy = CounterMetricFamily("zeus_gpu_energy_joules", "GPU energy counter (J)", labels=LABELS)
        power = GaugeMetricFamily("zeus_gpu_power_watts", "GPU power draw (W)", labels=LABELS)
        limit = GaugeMetricFamily("zeus_gpu_power_limit_watts", "GPU power limit (W)", labels=LABELS)
        sm = GaugeMetricFamily("zeus_gpu_sm_clock_mhz", "SM clock (MHz)", labels=LABELS)
        mem = GaugeMetricFamily("zeus_gpu_memory_clock_mhz", "Memory clock (MHz)", labels=LABELS)
        for agent in self.agents.values():
            s, info = agent.last_sample, agent.info
            if s is None or info is None:
                continue
            labels = [agent.node, str(agent.index), info.uuid, info.name]
            energy.add_metric(labels, s.energy_j)
            power.add_metric(labels, s.power_w)
            limit.add_metric(labels, s.power_limit_w)
            sm.add_metric(labels, s.sm_clock_mhz)
            mem.add_metric(labels, s.memory_clock_mhz)
        datagrams = CounterMetricFamily(
            "zeus_agent_datagrams", "Trainer datagrams by outcome", labels=["outcome"]
        )
        for outcome, count in self.gateway_counters().items():
            datagrams.add_metric([outcome], count)
        yield from (energy, power, limit, sm, mem, datagrams)


def make_registry(agents: Mapping[int, GpuAgent], gateway_counters: Callable[[], Mapping[str, int]]) -> CollectorRegistry:
    """A registry holding only the agent's metrics."""
    registry = CollectorRegistry()
    registry.register(AgentCollector(agents, gateway_counters))
    return registry
