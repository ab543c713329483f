"""deploy/kubernetes/: schemas (kubernetes-validate, strict, offline) and the settings the
issue asks for (an unprivileged-but-capable agent DaemonSet, a replicated coordinator, NATS)."""

from __future__ import annotations

import copy
import os
import posixpath
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from coordinator.config import CoordinatorSettings
from tests.deploy.deploy_kit import (
    DEPLOY,
    PENDING_COORDINATOR_SETTINGS,
    clean_env,
    documents,
    nats_check,
)
from zeus_agent import status_http
from zeus_agent.config import AgentSettings

K8S = DEPLOY / "kubernetes"
APPLIED = sorted(K8S.glob("*.yaml"))
"""What `kubectl apply -f deploy/kubernetes/` applies (it does not descend into folders)."""
ALL_MANIFESTS = (
    APPLIED + sorted((K8S / "secrets").glob("*.yaml")) + sorted((K8S / "monitoring").glob("*.yaml"))
)
OLDEST = "1.30.0"
"""The oldest Kubernetes the manifests are checked against (and the newest kubernetes-validate
bundles): policy/v1 PodDisruptionBudget, runtimeClassName, seccompProfile are all older."""
CRDS = {"ServiceMonitor"}


def by_kind(paths: list[Path]) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {}
    for path in paths:
        for doc in documents(path):
            found.setdefault(doc["kind"], []).append(doc)
    return found


KINDS = by_kind(ALL_MANIFESTS)


def one(kind: str) -> dict[str, Any]:
    (doc,) = KINDS[kind]
    return doc


def config_map(name: str) -> dict[str, str]:
    (cm,) = [c for c in KINDS["ConfigMap"] if c["metadata"]["name"] == name]
    return dict(cm["data"])


def container(workload: dict[str, Any]) -> dict[str, Any]:
    (c,) = workload["spec"]["template"]["spec"]["containers"]
    return dict(c)


def port(c: dict[str, Any], name: str) -> int:
    (p,) = [p["containerPort"] for p in c["ports"] if p["name"] == name]
    return int(p)


@pytest.mark.parametrize("version", [OLDEST, kubernetes_validate.latest_version()])
def test_manifests_match_their_schemas_strictly(version: str) -> None:
    checked = 0
    for path in ALL_MANIFESTS:
        for doc in documents(path):
            if doc["kind"] in CRDS:
                continue  # no schema bundled: test_service_monitor checks it
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                where = ".".join(str(p) for p in e.path)
                pytest.fail(f"{path.name}: {doc['kind']} {where}: {e.message}")
            checked += 1
    assert checked >= 8


def test_strict_validation_rejects_a_misspelled_field() -> None:
    """The check above would see a typo (an unknown field is silently dropped by a server)."""
    bad = copy.deepcopy(one("DaemonSet"))
    bad["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilites"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="capabilites"):
        kubernetes_validate.validate(bad, OLDEST, strict=True)


def test_the_top_folder_applies_in_order_without_crds() -> None:
    kinds = [doc["kind"] for path in APPLIED for doc in documents(path)]
    assert kinds[0] == "Namespace"  # kubectl applies the files in name order
    assert not CRDS & set(kinds)
    namespace = one("Namespace")["metadata"]["name"]
    for path in ALL_MANIFESTS:
        for doc in documents(path):
            if doc["kind"] != "Namespace":
                assert doc["metadata"]["namespace"] == namespace, (path.name, doc["kind"])


def test_agent_daemonset() -> None:
    ds = one("DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    c = container(ds)
    sc = c["securityContext"]
    # CAP_SYS_ADMIN only, never a privileged container.
    assert sc["privileged"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    # The API server refuses allowPrivilegeEscalation: false with SYS_ADMIN (the schema can't).
    assert sc.get("allowPrivilegeEscalation") is not False
    assert sc["readOnlyRootFilesystem"] is True
    # All GPUs without taking any from the scheduler.
    env = {e["name"]: e for e in c["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert "utility" in env["NVIDIA_DRIVER_CAPABILITIES"]["value"]
    assert pod["runtimeClassName"] == "nvidia"
    for section in ("requests", "limits"):
        assert not any("nvidia.com" in key for key in c["resources"].get(section, {}))
    assert "cpu" not in c["resources"]["limits"]  # CFS throttling would delay clock changes
    # GPU nodes only, tainted ones included; host PID.
    assert pod["hostPID"] is True
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert env["ZEUS_AGENT_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # The trainers' socket on a hostPath, at the path the agent binds.
    settings = config_map("zeus-agent-config")
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    socket_dir = posixpath.dirname(settings["ZEUS_AGENT_SOCKET_PATH"])
    assert volumes[mounts[socket_dir]]["hostPath"]["path"] == socket_dir
    # Each node's own credentials: a root-only file on the node, sourced before the agent runs.
    credentials = volumes[mounts["/etc/zeus/agent-nats.env"]]["hostPath"]
    assert credentials == {"path": "/etc/zeus/agent-nats.env", "type": "File"}
    assert ". /etc/zeus/agent-nats.env" in c["command"][-1]
    assert c["envFrom"] == [{"configMapRef": {"name": "zeus-agent-config"}}]
    # Probes on the health endpoint, metrics port with scrape annotations.
    metrics = port(c, "metrics")
    assert metrics == int(settings["ZEUS_AGENT_METRICS_PORT"])
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    annotations = ds["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(metrics)
    assert annotations["prometheus.io/path"] == "/metrics"
    assert pod["terminationGracePeriodSeconds"] >= 10  # time to restore the GPUs


def test_agent_configmap_is_agent_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = config_map("zeus-agent-config")
    for key in settings:
        assert key.startswith("ZEUS_AGENT_")
        assert key.removeprefix("ZEUS_AGENT_").lower() in AgentSettings.model_fields, key
    for key in [k for k in os.environ if k.startswith("ZEUS_AGENT_")]:
        monkeypatch.delenv(key)
    for key, value in {**settings, "ZEUS_AGENT_NODE": "gpu01"}.items():
        monkeypatch.setenv(key, value)
    parsed = AgentSettings()
    assert parsed.backend == "nvml" and parsed.metrics_port == int(
        settings["ZEUS_AGENT_METRICS_PORT"]
    )


def test_the_probed_paths_exist() -> None:
    """/healthz and /metrics are what zeus_agent.status_http serves (the agent's server)."""
    import urllib.request

    from prometheus_client import CollectorRegistry

    server = status_http.start("127.0.0.1", 0, lambda: (True, {}), registry=CollectorRegistry())
    try:
        for path in ("/healthz", "/metrics"):
            with urllib.request.urlopen(server.url + path, timeout=5) as r:
                assert r.status == 200
    finally:
        server.close()


def test_coordinator_deployment_and_disruption_budget() -> None:
    deployment, pdb = one("Deployment"), one("PodDisruptionBudget")
    pod = deployment["spec"]["template"]
    c = container(deployment)
    assert deployment["spec"]["replicas"] >= 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert pdb["spec"]["minAvailable"] == 1 < deployment["spec"]["replicas"]
    labels = pod["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # Nothing beyond Pod Security's restricted level.
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["readOnlyRootFilesystem"] is True
    # Health on the status port it is told to open.
    settings = config_map("zeus-coordinator-config")
    assert port(c, "health") == int(settings["ZEUS_PFO_STATUS_PORT"])
    assert settings["ZEUS_PFO_STATUS_HOST"] == "0.0.0.0"
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    # Its settings from the ConfigMap, its NATS URL with credentials from the Secret.
    refs = [next(iter(ref.values()))["name"] for ref in c["envFrom"]]
    assert refs == ["zeus-coordinator-config", "zeus-coordinator-nats"]
    (secret,) = [s for s in KINDS["Secret"] if s["metadata"]["name"] == "zeus-coordinator-nats"]
    assert list(secret["stringData"]) == ["ZEUS_PFO_NATS_URL"]
    state = {m["mountPath"] for m in c["volumeMounts"]}
    assert settings["ZEUS_PFO_STATE_DIR"] in state


def test_coordinator_configmap_is_coordinator_settings() -> None:
    fields = set(CoordinatorSettings.model_fields) | PENDING_COORDINATOR_SETTINGS
    settings = config_map("zeus-coordinator-config")
    for key in [*settings, "ZEUS_PFO_NATS_URL", "ZEUS_PFO_REPLICA_NAME"]:
        assert key.startswith("ZEUS_PFO_")
        assert key.removeprefix("ZEUS_PFO_").lower() in fields, key
    assert settings["ZEUS_PFO_STATE_REPLICAS"] == "3"  # the 3 servers of the Helm values


def test_service_monitor() -> None:
    """A CRD without a bundled schema: its structure, checked against the objects it scrapes.

    Fields as in the Prometheus Operator's monitoring.coreos.com/v1 ServiceMonitor: selector,
    namespaceSelector.matchNames, endpoints[].port/path/interval/scrapeTimeout/relabelings.
    """
    monitor, service = one("ServiceMonitor"), one("Service")
    ds = one("DaemonSet")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor["spec"]) == {"selector", "namespaceSelector", "endpoints"}
    namespace = ds["metadata"]["namespace"]
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [namespace]}
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    # The Service selects the agent's pods and names their metrics port.
    assert (
        service["spec"]["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    )
    assert service["spec"]["clusterIP"] == "None"
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "relabelings"}
        assert service_ports[endpoint["port"]]["targetPort"] == "metrics"
        assert endpoint["path"] == "/metrics"
        for rule in endpoint.get("relabelings", []):
            assert set(rule) <= {"sourceLabels", "targetLabel", "action", "regex", "replacement"}
            assert rule.get("action", "replace") in {"replace", "keep", "drop", "labelmap"}


HELM = K8S / "helm" / "nats-values.yaml"


def test_nats_helm_values() -> None:
    values = yaml.safe_load(HELM.read_text())
    config = values["config"]
    assert config["cluster"] == {"enabled": True, "replicas": 3}
    js = config["jetstream"]
    assert js["enabled"] is True
    assert js["fileStore"]["enabled"] is True and js["fileStore"]["pvc"]["enabled"] is True
    assert js["memoryStore"]["enabled"] is False
    assert js["merge"] == {"sync_interval": "always"}  # acknowledged = on disk
    includes = {k: v for k, v in config["merge"].items() if k.endswith("$include")}
    assert list(includes.values()) == ["./auth.conf"]
    assert "auth.conf" in values["configMap"]["merge"]["data"]
    env_from = values["container"]["merge"]["envFrom"]
    assert env_from == [{"secretRef": {"name": "zeus-nats-passwords"}}]
    assert any(s["metadata"]["name"] == "zeus-nats-passwords" for s in KINDS["Secret"])
    # The NATS URL of the services is this release's client Service in the same namespace.
    assert config_map("zeus-agent-config")["ZEUS_AGENT_NATS_URL"] == "nats://nats.zeus.svc:4222"


def test_helm_placeholder_auth_conf_is_valid_nats_config(tmp_path: Path) -> None:
    """Until --set-file replaces it, the placeholder is a valid include that admits nobody."""
    values = yaml.safe_load(HELM.read_text())
    (tmp_path / "auth.conf").write_text(values["configMap"]["merge"]["data"]["auth.conf"])
    (tmp_path / "nats.conf").write_text(
        f'port: 4222\njetstream {{ store_dir: "{tmp_path / "js"}" }}\ninclude ./auth.conf\n'
    )
    proc: subprocess.CompletedProcess[str] = nats_check(tmp_path / "nats.conf", clean_env())
    assert proc.returncode == 0, proc.stderr
