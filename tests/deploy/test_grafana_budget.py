"""The dashboard's power-budget panels: cap, measured draw and each job's share and slowdown."""

from __future__ import annotations

import json
import re

from coordinator.metrics import METRIC_NAMES
from tests.deploy.deploy_kit import DEPLOY

DASHBOARD = DEPLOY / "grafana" / "dashboards" / "zeus.json"


def test_the_dashboard_shows_each_budget_and_each_jobs_share() -> None:
    d = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
    used = {n for e in exprs for n in re.findall(r"\bzeus_budget_\w+", e)}
    assert {"zeus_budget_cap_watts", "zeus_budget_measured_watts",
            "zeus_budget_job_limit_watts", "zeus_budget_job_slowdown_ratio"} <= used
    assert used <= set(METRIC_NAMES), "a panel names a metric the coordinator does not export"
    # Only the replica applying the budgets exports them: every query takes one series a key.
    for e in exprs:
        if "zeus_budget_" in e:
            assert e.startswith("max by (budget_id"), e
