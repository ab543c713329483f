"""The old home of the e2e cluster, now the cluster harness `zeus_demo.cluster`: these names
are aliases of it, kept only until the tests still written against them import it directly."""

from __future__ import annotations

from tests.repo_kit import REPO_ROOT
from zeus_demo.cluster import MARK_ENV, console_script, processes_with_mark
from zeus_demo.cluster import SimCluster as FaultCluster

__all__ = ["MARK_ENV", "REPO_ROOT", "FaultCluster", "console_script", "processes_with_mark"]
