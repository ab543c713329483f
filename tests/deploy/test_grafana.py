"""deploy/grafana/ and deploy/prometheus/: the dashboard, its provisioning, the scrape config.

Static checks: the dashboard is a well-formed Grafana dashboard (unique panel ids, every panel
and query on the `${DS_PROMETHEUS}` datasource, only defined variables), the provisioning and
Prometheus files agree with the compose file (paths, ports, job names, profiles).

Live check: a real nats-server, an agent on two simulated GPUs and a coordinator, both with
their status ports; a power-limit job (its profile sent with it: done at once, 250 W chosen)
and a job still registering; then every metric name any dashboard query (panels and variables)
names must be exposed on the agent's `/metrics` or the coordinator's, and those a running job
and GPUs fill must have samples.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from coordinator.config import CoordinatorSettings
from coordinator.service import CoordinatorService
from tests.deploy.deploy_kit import DEPLOY, documents
from zeus_agent.agent.server import AgentServer
from zeus_agent.config import AgentSettings
from zeus_agent.models import JobInfo, PowerLimitMeasurement, RankInfo
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import (
    GpuBinding,
    PowerLimitOptions,
    RegisterJob,
    RegisterRank,
    Reply,
)
from zeus_demo.cluster import free_port, wait_for, wait_for_async

GRAFANA = DEPLOY / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
PROMETHEUS = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
COMPOSE = yaml.safe_load((DEPLOY / "docker" / "compose.yaml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}

MADE_BY_PROMETHEUS = {"up"}
"""Series Prometheus adds for every scrape target (no exporter exposes them)."""

# ------------------------------------------------------------------------ PromQL metric names
_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "atan2", "inf", "nan",
}


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (or a Grafana `label_values(...)` query).

    Strings, label matchers, ranges, numbers, Grafana variables and grouping label lists are
    removed first; what remains of identifiers, less functions (followed by '(') and keywords,
    are metric names.
    """
    found = re.fullmatch(r"\s*label_values\((?:(.*),)?\s*\w+\s*\)\s*", expr, re.DOTALL)
    if found:
        return metric_names(found.group(1)) if found.group(1) else set()
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    text = re.sub(r"\$\{[^}]*\}|\$\w+", " ", text)  # Grafana variables ($__range, ${node})
    text = re.sub(
        r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text
    )  # grouping label lists
    text = re.sub(r"(?<![\w:])(\d+(ms|s|m|h|d|w|y))+\b", " ", text)  # durations (offset 5m)
    text = re.sub(r"(?<![\w:])\d+(\.\d+)?([eE][+-]?\d+)?", " ", text)  # numbers
    names = set()
    for m in re.finditer(r"[A-Za-z_:][\w:]*", text):
        if text[m.end():].lstrip().startswith("(") or m.group(0).lower() in _KEYWORDS:
            continue
        names.add(m.group(0))
    return names


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("zeus_gpu_power_watts", {"zeus_gpu_power_watts"}),
        ('sum by (instance, reason) (rate(a_total{x="y", z=~"$node"}[$__rate_interval]))',
         {"a_total"}),
        ("sum(increase(e_total{Hostname=~\"$node\"}[$__range])) / 3.6e6", {"e_total"}),
        ("100 * max by (job_id) (m) / on(job_id) group_left(kind) n > bool 0", {"m", "n"}),
        ('up{job="zeus-agent"} offset 5m', {"up"}),
        ('label_values(zeus_gpu_power_watts{Hostname=~"$node"}, gpu)', {"zeus_gpu_power_watts"}),
        ("label_values(Hostname)", set()),
    ],
)
def test_metric_names_of_promql(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


# ------------------------------------------------------------------------ dashboard, static
def load(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def all_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row's panels


def queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression of the dashboard: its panels' targets and its variables."""
    exprs = [t["expr"] for p in all_panels(dashboard) for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def test_there_is_a_dashboard() -> None:
    assert [p.name for p in DASHBOARDS] == ["zeus.json"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_is_well_formed(path: Path) -> None:
    d = load(path)
    assert d["uid"] and d["title"] and isinstance(d["schemaVersion"], int)
    assert "__inputs" not in d  # An export for sharing: provisioning would not fill it in.
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    panels = list(all_panels(d))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    shown = [p for p in panels if p["type"] != "row"]
    assert {"timeseries", "stat", "table"} <= {p["type"] for p in shown}
    for p in shown:
        where = f"panel {p['id']} ({p['title']})"
        assert p["title"] and p.get("description"), where
        assert p["datasource"] == DS, where
        grid = p["gridPos"]
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] + grid["w"] <= 24, where
        assert p["targets"], where
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), where
        for t in p["targets"]:
            assert t["datasource"] == DS and t["expr"].strip(), where
            assert t["expr"].count("(") == t["expr"].count(")"), where
            assert metric_names(t["expr"]), f"{where}: {t['expr']!r} names no metric"
    for var in variables.values():
        if var["type"] == "query":
            assert var["datasource"] == DS, var["name"]
    # Only defined variables (besides Grafana's own $__range, $__rate_interval...).
    used = set(re.findall(r"\$\{?(\w+)", json.dumps(d)))
    assert {u for u in used if not u.startswith("__")} <= set(variables)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_covers_the_issue(path: Path) -> None:
    """Per GPU: power, energy rate, limit, SM clock; per job: phase, choice, saving; health."""
    names = set().union(*(metric_names(q) for q in queries(load(path))))
    assert {"zeus_gpu_power_watts", "zeus_gpu_energy_joules_total",
            "zeus_gpu_power_limit_watts", "zeus_gpu_sm_clock_mhz"} <= names
    assert {"zeus_job_phase", "zeus_job_optimal_power_limit_watts", "zeus_job_plan_index",
            "zeus_job_energy_saving_ratio"} <= names
    assert {"up", "zeus_agent_bus_messages_dropped_total", "zeus_agent_datagrams_total",
            "zeus_coordinator_messages_dropped_total",
            "zeus_coordinator_commands_fenced_total"} <= names
    exprs = " ".join(queries(load(path)))
    assert "rate(zeus_gpu_energy_joules_total" in exprs
    # The jobs a `job` matcher names are Prometheus's scrape jobs.
    jobs = {c["job_name"] for c in PROMETHEUS["scrape_configs"]}
    for matcher in re.findall(r'job=~?"([^"]+)"', exprs):
        assert set(matcher.split("|")) <= jobs, matcher


# ------------------------------------------------------------------------ provisioning, compose
def mounts(service: str) -> dict[str, str]:
    """Container path -> host path (relative to deploy/docker) or volume, of a service."""
    found = {}
    for v in SERVICES[service]["volumes"]:
        source, target = v.split(":")[:2]
        found[target] = source
    return found


def host_path(source: str) -> Path:
    return (DEPLOY / "docker" / source).resolve()


def test_monitoring_services_in_the_compose_file() -> None:
    for name in ("prometheus", "grafana"):
        service = SERVICES[name]
        assert {"gpu", "sim"} <= set(service["profiles"]), name
        image, _, tag = service["image"].rpartition(":")
        assert image and re.fullmatch(r"v?\d+\.\d+\.\d+", tag), service["image"]
        assert all(p.startswith("127.0.0.1:") for p in service["ports"]), name
        for target, source in mounts(name).items():
            if source.startswith("."):
                assert host_path(source).exists(), (name, source)
                assert f"{source}:{target}:ro" in service["volumes"], (name, target)
            else:
                assert source in COMPOSE["volumes"], (name, source)
    assert mounts("prometheus")["/etc/prometheus/prometheus.yml"] == "../prometheus/prometheus.yml"
    assert "--config.file=/etc/prometheus/prometheus.yml" in SERVICES["prometheus"]["command"]


def test_grafana_provisioning_matches_the_compose_file() -> None:
    grafana = mounts("grafana")
    assert host_path(grafana["/etc/grafana/provisioning"]) == GRAFANA / "provisioning"
    (source,) = yaml.safe_load(
        (GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text()
    )["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"] is True
    port = SERVICES["prometheus"]["ports"][0].rsplit(":", 1)[1]
    assert source["url"] == f"http://prometheus:{port}"
    (provider,) = yaml.safe_load(
        (GRAFANA / "provisioning" / "dashboards" / "zeus.yaml").read_text()
    )["providers"]
    assert host_path(grafana[provider["options"]["path"]]) == GRAFANA / "dashboards"
    home = SERVICES["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/zeus.json"


def test_prometheus_scrapes_the_coordinator_and_the_agents() -> None:
    jobs = {c["job_name"]: c for c in PROMETHEUS["scrape_configs"]}
    coordinator_port = SERVICES["coordinator"]["environment"]["ZEUS_PFO_STATUS_PORT"]
    assert SERVICES["coordinator"]["environment"]["ZEUS_PFO_STATUS_HOST"] == "0.0.0.0"
    (static,) = jobs["zeus-coordinator"]["static_configs"]
    assert static["targets"] == [f"coordinator:{coordinator_port}"]
    (dns,) = jobs["zeus-agent"]["dns_sd_configs"]
    agents = [n for n, s in SERVICES.items() if "zeus-agent" in " ".join(s.get("command", []))]
    assert sorted(dns["names"]) == sorted(agents) == ["agent", "agent-sim"]
    for name in agents:
        assert str(dns["port"]) == SERVICES[name]["environment"]["ZEUS_AGENT_METRICS_PORT"]
    for config in jobs.values():
        assert config.get("metrics_path", "/metrics") == "/metrics"


def test_kubernetes_scrapes_the_coordinator_and_names_the_agents_job() -> None:
    """The ServiceMonitor sets the agents' job name the dashboard selects on; the coordinator's
    pods carry scrape annotations for its status port."""
    k8s = DEPLOY / "kubernetes"
    (monitor,) = [d for d in documents(k8s / "monitoring" / "zeus-agent-servicemonitor.yaml")
                  if d["kind"] == "ServiceMonitor"]
    (endpoint,) = monitor["spec"]["endpoints"]
    rules = [r for r in endpoint["relabelings"] if r["targetLabel"] == "job"]
    assert [r["replacement"] for r in rules] == ["zeus-agent"]
    (deployment,) = [d for d in documents(k8s / "20-zeus-coordinator.yaml")
                     if d["kind"] == "Deployment"]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    (config,) = [d for d in documents(k8s / "10-config.yaml")
                 if d["metadata"]["name"] == "zeus-coordinator-config"]
    assert annotations["prometheus.io/port"] == config["data"]["ZEUS_PFO_STATUS_PORT"]
    assert annotations["prometheus.io/path"] == "/metrics"


# ------------------------------------------------------------------------ live scrape
NODE = "grafana-node"
PROFILE = [
    PowerLimitMeasurement(power_limit=300, energy=1000.0, time=10.0),
    PowerLimitMeasurement(power_limit=250, energy=700.0, time=10.5),
    PowerLimitMeasurement(power_limit=200, energy=800.0, time=13.0),
]


def scrape(port: int) -> dict[str, list[Any]]:
    """Family names (and counters' `_total` names) -> samples, of one `/metrics` page."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    found: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        found.setdefault(family.name, [])  # declared (`# TYPE`), with or without samples
        if family.type == "counter":
            found.setdefault(f"{family.name}_total", [])
        for sample in family.samples:
            found.setdefault(sample.name, []).append(sample)
    return found


async def ask(nc: Any, subject: str, payload: Any) -> Reply:
    msg = await nc.request(subject, codec.encode(payload), timeout=5)
    return codec.decode(msg.data, Reply)


def has(page: dict[str, list[Any]], name: str, **labels: str) -> bool:
    return any(s.labels.items() >= labels.items() for s in page.get(name, []))


@pytest.mark.timeout(60)
async def test_every_metric_the_dashboard_queries_is_exported(nats_server, nc, tmp_path,
                                                              monkeypatch) -> None:
    monkeypatch.setenv("ZEUS_AGENT_SIM_NVML_TIMING", "none")
    agent = AgentServer(AgentSettings(
        nats_url=nats_server.url, backend="sim", sim_count=2, sim_preset="A40",
        sim_energy_update_ms=0, sim_state_dir=str(tmp_path / "gpus"),
        socket_path=str(tmp_path / "agent.sock"), node=NODE, sample_hz=20,
        metrics_port=0, metrics_host="127.0.0.1",
    ))
    agent_task = asyncio.create_task(agent.serve())
    await asyncio.wait_for(agent.started.wait(), 10)
    status_port = free_port()
    coord = CoordinatorService(CoordinatorSettings(
        nats_url=nats_server.url, state_dir=str(tmp_path / "coord"), command_timeout_s=1.0,
        state_bucket="t-grafana", status_port=status_port, status_host="127.0.0.1",
    ))
    coord_task = asyncio.create_task(coord.serve())
    try:
        await asyncio.wait_for(coord.started.wait(), 10)
        assert agent.metrics_port
        # A power-limit job with its profile: done at once, 250 W chosen, on both GPUs.
        info = JobInfo(dp_degree=2, pp_degree=1, tp_degree=1, world_size=2)
        reply = await ask(nc, subjects.coord_register_job(NODE), RegisterJob(
            job=info, power_limit=PowerLimitOptions(selector="Energy", profile=PROFILE)))
        assert reply.ok, reply
        job_id, token = reply.result["job_id"], reply.result["join_token"]
        for rank in (0, 1):
            reply = await ask(nc, subjects.coord_register_rank(NODE), RegisterRank(
                job_id=job_id, join_token=token,
                rank_info=RankInfo(rank=rank, dp_rank=rank, pp_rank=0, tp_rank=0,
                                   available_frequencies=[1740, 210]),
                gpu=GpuBinding(node=NODE, gpu_index=rank)))
            assert reply.ok, reply
        # A pipeline job still registering, and a dropped message on each side.
        assert (await ask(nc, subjects.coord_register_job(NODE), RegisterJob(job=info))).ok
        await nc.publish(subjects.job_measurements(job_id, NODE), b"\xc1 not msgpack")
        # (The agent follows the renewals of its leases' holders: the job's, once pinned.)
        await wait_for_async(lambda: agent.agents[0].leases.get("power_limit") is not None, 10)
        await nc.publish(subjects.lease_renewal(job_id), b"\xc1 not msgpack")
        await nc.flush()

        def coordinator_ready() -> dict[str, list[Any]] | None:
            page = scrape(status_port)
            done = has(page, "zeus_job_phase", job_id=job_id, phase="done")
            return page if done and has(page, "zeus_coordinator_messages_dropped_total") else None

        def agent_ready() -> dict[str, list[Any]] | None:
            page = scrape(agent.metrics_port or 0)
            limits = [s.value for s in page.get("zeus_gpu_power_limit_watts", [])]
            dropped = has(page, "zeus_agent_bus_messages_dropped_total")
            return page if limits == [250.0, 250.0] and dropped else None

        # Polled in a thread: a scrape blocks, and the services run on this loop.
        coordinator_page = await asyncio.to_thread(
            wait_for, coordinator_ready, 10, "the coordinator's metrics", interval_s=0.1)
        agent_page = await asyncio.to_thread(
            wait_for, agent_ready, 10, "the agent's metrics", interval_s=0.1)
    finally:
        coord.should_exit.set()
        await asyncio.wait_for(coord_task, 10)
        agent.handle_exit()
        await asyncio.wait_for(agent_task, 10)

    exported = set(agent_page) | set(coordinator_page) | MADE_BY_PROMETHEUS
    for path in DASHBOARDS:
        for expr in queries(load(path)):
            missing = metric_names(expr) - exported
            assert not missing, f"{path.name}: {expr!r} queries {missing}, which nothing exports"

    # What a running job and its GPUs fill in has samples (the pipeline plan needs a pipeline
    # job being served; agents' datagram counters, a trainer).
    for name in ("zeus_gpu_power_watts", "zeus_gpu_energy_joules_total",
                 "zeus_gpu_power_limit_watts", "zeus_gpu_sm_clock_mhz"):
        assert {s.labels["gpu"] for s in agent_page[name]} == {"0", "1"}, name
        assert all(s.labels["Hostname"] == NODE for s in agent_page[name]), name
    assert has(agent_page, "zeus_agent_bus_messages_dropped_total", reason="bad_lease_renewal")
    page = coordinator_page
    assert has(page, "zeus_job_phase", job_id=job_id, kind="power_limit", phase="done")
    assert has(page, "zeus_job_phase", kind="pipeline", phase="registering")
    (limit,) = page["zeus_job_optimal_power_limit_watts"]
    (saving,) = page["zeus_job_energy_saving_ratio"]
    (slowdown,) = page["zeus_job_slowdown_ratio"]
    assert (limit.value, saving.value, slowdown.value) == (250, pytest.approx(0.3),
                                                           pytest.approx(0.05))
    assert has(page, "zeus_coordinator_messages_dropped_total", reason="malformed")
    assert page["zeus_coordinator_nats_connected"][0].value == 1
    assert page["zeus_coordinator_jobs"][0].value == 2
