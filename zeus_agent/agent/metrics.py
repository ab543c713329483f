"""Prometheus metrics of a node agent, in the style of dcgm-exporter.

A custom collector reads each `GpuAgent`'s latest sample at scrape time, so the sampling loop
does no metrics work. GPU labels are dcgm-exporter's: `gpu` (index), `UUID`, `device`
("nvidia<index>"), `modelName`, `Hostname`.

Two families describe the same samples:

* dcgm-exporter's own names and units, so its dashboards and alerts work unchanged:

  | metric | type | unit |
  |---|---|---|
  | `DCGM_FI_DEV_POWER_USAGE` | gauge | W |
  | `DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION` | counter-like gauge | mJ since the driver started |
  | `DCGM_FI_DEV_POWER_MGMT_LIMIT` | gauge | W |
  | `DCGM_FI_DEV_SM_CLOCK` | gauge | MHz |
  | `DCGM_FI_DEV_MEM_CLOCK` | gauge | MHz |

* Prometheus-convention names with the unit in the name:

  | metric | type | unit |
  |---|---|---|
  | `zeus_gpu_energy_joules_total` | counter | J since the driver started counting |
  | `zeus_gpu_power_watts` | gauge | W |
  | `zeus_gpu_power_limit_watts` | gauge | W |
  | `zeus_gpu_sm_clock_mhz` | gauge | MHz |
  | `zeus_gpu_memory_clock_mhz` | gauge | MHz |
  | `zeus_gpu_counter_reads_total` | counter | energy-counter reads (each ~3 ms of the driver) |
  | `zeus_gpu_power_limit_reads_total` | counter | power-limit reads with a status (~1/s) |
  | `zeus_gpu_counter_reads_idle` | gauge | 1 while only ~1 update a second is read |
  | `zeus_agent_datagrams_total{outcome}` | counter | trainer datagrams by outcome |
  | `zeus_agent_bus_messages_dropped_total{reason}` | counter | bus messages the agent dropped |
  | `zeus_gpu_controllable` | gauge | 1 if settings may be changed, 0 observe-only |
  | `zeus_agent_gpu_events_total{event}` | counter | per GPU: mismatches, gaps, failed clocks, |
  |  |  | the doorbell's datagrams, changes taken, changes claimed by the loop, |
  |  |  | windows spun, changes found spinning |
  | `zeus_agent_doorbell_spin_seconds_total` | counter | per GPU: CPU time its doorbell spun |
  | `zeus_agent_nats_connected` | gauge | 1 while connected to NATS |

* The CPU packages' RAPL counters (`zeus_agent.agent.rapl`), labelled `cpu` (the package's
  index, Zeus's CPU index), `domain` (`package` or `dram`) and `Hostname`:

  | metric | type | unit |
  |---|---|---|
  | `zeus_rapl_energy_joules_total` | counter | J counted since the agent started (wraps undone) |
  | `zeus_rapl_wraps_total` | counter | times the counter wrapped at `max_energy_range_uj` |
  | `zeus_rapl_read_errors_total` | counter | readings of the counter that failed |
  | `zeus_rapl_packages` | gauge | CPU packages whose counters are read (0: none, see the log) |
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from zeus_agent.agent.gpu_agent import GpuAgent
from zeus_agent.agent.rapl import RaplReader
from zeus_agent.wire.messages import Sample

LABELS = ["gpu", "UUID", "device", "modelName", "Hostname"]
RAPL_LABELS = ["cpu", "domain", "Hostname"]


class AgentCollector(Collector):
    """Yields the metrics above from the agents' latest samples."""

    def __init__(
        self,
        agents: Mapping[int, GpuAgent],
        gateway_counters: Callable[[], Mapping[str, int]],
        bus_counters: Callable[[], Mapping[str, int]] = dict,
        bus_connected: Callable[[], bool] | None = None,
        rapl: RaplReader | None = None,
        node: str = "",
    ):
        self.agents = agents
        self.gateway_counters = gateway_counters
        self.bus_counters = bus_counters
        self.bus_connected = bus_connected
        self.rapl = rapl
        self.node = node

    def collect(self) -> Iterable[Metric]:  # noqa: D102
        samples = _sample_families()
        reads, limit_reads, idle, controllable, events, spun = _agent_families()
        for agent in self.agents.values():
            info = agent.info
            if info is None:
                continue
            labels = [str(agent.index), info.uuid, f"nvidia{agent.index}", info.name, agent.node]
            controllable.add_metric(labels, 1.0 if agent.controllable else 0.0)
            for event, count in sorted(agent.counters.items()):
                events.add_metric([*labels, event], count)
            if agent.doorbell is not None:
                for event, count in sorted(agent.doorbell.counters.items()):
                    events.add_metric([*labels, f"doorbell_{event}"], count)
                spun.add_metric(labels, agent.doorbell.spun_ns / 1e9)
            reads.add_metric(labels, agent.counter.reads)
            limit_reads.add_metric(labels, agent.counter.limit_reads)
            idle.add_metric(labels, 1.0 if agent.counter.policy.idle else 0.0)
            if agent.last_sample is not None:
                _add_sample(samples, labels, agent.last_sample)
        datagrams = CounterMetricFamily(
            "zeus_agent_datagrams", "Trainer datagrams by outcome", labels=["outcome"]
        )
        for outcome, count in self.gateway_counters().items():
            datagrams.add_metric([outcome], count)
        dropped = CounterMetricFamily(
            "zeus_agent_bus_messages_dropped",
            "Bus messages the agent dropped (e.g. malformed lease renewals)",
            labels=["reason"],
        )
        for reason, count in self.bus_counters().items():
            dropped.add_metric([reason], count)
        yield from samples
        yield from (reads, limit_reads, idle, datagrams, dropped)
        yield from (controllable, events, spun)
        if self.bus_connected is not None:
            yield GaugeMetricFamily(
                "zeus_agent_nats_connected", "1 while the agent is connected to NATS",
                value=1.0 if self.bus_connected() else 0.0)
        if self.rapl is not None:
            yield from self._rapl(self.rapl)

    def _rapl(self, rapl: RaplReader) -> Iterable[Metric]:
        """The RAPL counters: energy (wraps undone), wraps and failed readings per domain."""
        energy = CounterMetricFamily(
            "zeus_rapl_energy_joules",
            "CPU package or DRAM energy counted from RAPL since the agent started (J)",
            labels=RAPL_LABELS)
        wraps = CounterMetricFamily(
            "zeus_rapl_wraps", "Times a RAPL counter wrapped at max_energy_range_uj",
            labels=RAPL_LABELS)
        errors = CounterMetricFamily(
            "zeus_rapl_read_errors", "Readings of a RAPL counter that failed", labels=RAPL_LABELS)
        for index, package in sorted(rapl.packages.items()):
            for domain, meter in (("package", package.cpu), ("dram", package.dram)):
                if meter is None:
                    continue
                labels = [str(index), domain, self.node]
                energy.add_metric(labels, meter.energy_j)
                wraps.add_metric(labels, meter.counter.wraps)
                errors.add_metric(labels, rapl.read_errors.get((index, domain), 0))
        yield from (energy, wraps, errors)
        yield GaugeMetricFamily(
            "zeus_rapl_packages", "CPU packages whose RAPL counters are read (0: none)",
            value=len(rapl.packages))


def _sample_families() -> tuple[GaugeMetricFamily | CounterMetricFamily, ...]:
    """The families of a GPU's latest sample, dcgm-exporter's five then Zeus's five."""
    dcgm_power = GaugeMetricFamily(
        "DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", labels=LABELS
    )
    dcgm_energy = GaugeMetricFamily(
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "Total energy consumption since boot (in mJ).",
        labels=LABELS,
    )
    dcgm_limit = GaugeMetricFamily(
        "DCGM_FI_DEV_POWER_MGMT_LIMIT", "Power management limit (in W).", labels=LABELS
    )
    dcgm_sm = GaugeMetricFamily(
        "DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", labels=LABELS
    )
    dcgm_mem = GaugeMetricFamily(
        "DCGM_FI_DEV_MEM_CLOCK", "Memory clock frequency (in MHz).", labels=LABELS
    )
    energy = CounterMetricFamily(
        "zeus_gpu_energy_joules", "GPU energy counter (J)", labels=LABELS
    )
    power = GaugeMetricFamily("zeus_gpu_power_watts", "GPU power draw (W)", labels=LABELS)
    limit = GaugeMetricFamily(
        "zeus_gpu_power_limit_watts", "GPU power limit (W)", labels=LABELS
    )
    sm = GaugeMetricFamily("zeus_gpu_sm_clock_mhz", "SM clock (MHz)", labels=LABELS)
    mem = GaugeMetricFamily("zeus_gpu_memory_clock_mhz", "Memory clock (MHz)", labels=LABELS)
    return (dcgm_power, dcgm_energy, dcgm_limit, dcgm_sm, dcgm_mem, energy, power, limit, sm, mem)


def _add_sample(
    families: tuple[GaugeMetricFamily | CounterMetricFamily, ...], labels: list[str], s: Sample
) -> None:
    """Add GPU `labels`' sample `s` to `_sample_families()`'s families, in their order."""
    values = (
        s.power_w,
        s.energy_j * 1000.0,
        s.power_limit_w,
        s.sm_clock_mhz,
        s.memory_clock_mhz,
        s.energy_j,
        s.power_w,
        s.power_limit_w,
        s.sm_clock_mhz,
        s.memory_clock_mhz,
    )
    for family, value in zip(families, values, strict=True):
        family.add_metric(labels, value)


def _agent_families() -> tuple[
    CounterMetricFamily,
    CounterMetricFamily,
    GaugeMetricFamily,
    GaugeMetricFamily,
    CounterMetricFamily,
    CounterMetricFamily,
]:
    """The families of a GPU's agent: reads, limit_reads, idle, controllable, events, spun."""
    reads = CounterMetricFamily(
        "zeus_gpu_counter_reads", "Energy-counter reads made", labels=LABELS
    )
    limit_reads = CounterMetricFamily(
        "zeus_gpu_power_limit_reads", "Power-limit reads made with a status", labels=LABELS
    )
    idle = GaugeMetricFamily(
        "zeus_gpu_counter_reads_idle",
        "1 while the counter is read ~once a second (nothing needs every update)",
        labels=LABELS,
    )
    controllable = GaugeMetricFamily(
        "zeus_gpu_controllable",
        "1 if the agent may change the GPU's settings, 0 if observe-only", labels=LABELS)
    events = CounterMetricFamily(
        "zeus_agent_gpu_events",
        "Per GPU: schedule mismatches, measurement gaps, failed clock changes, restores, "
        "sample errors, refused and unmeasured measurements; the doorbell's datagrams, the "
        "clock changes its thread took and those the event loop claimed first, the windows "
        "it spun in and the changes it found spinning",
        labels=[*LABELS, "event"])
    spun = CounterMetricFamily(
        "zeus_agent_doorbell_spin_seconds",
        "Per GPU: time its doorbell's thread polled without sleeping around forecast clock "
        "changes (CPU time of one core; --doorbell-spin-us)", labels=LABELS)
    return reads, limit_reads, idle, controllable, events, spun


def make_registry(
    agents: Mapping[int, GpuAgent],
    gateway_counters: Callable[[], Mapping[str, int]],
    bus_counters: Callable[[], Mapping[str, int]] = dict,
    bus_connected: Callable[[], bool] | None = None,
    rapl: RaplReader | None = None,
    node: str = "",
) -> CollectorRegistry:
    """A registry holding only the agent's metrics."""
    registry = CollectorRegistry()
    registry.register(
        AgentCollector(agents, gateway_counters, bus_counters, bus_connected, rapl, node))
    return registry
