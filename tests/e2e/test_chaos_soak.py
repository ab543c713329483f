"""The short chaos soak: real partitions, a paused owner, an isolated agent and a power loss.

Runs `python -m zeus_demo.chaos.soak` (namespaces, veth pairs, a bridge: root is required and
this machine's CI runs as root) for about a minute and holds it to the checker's verdict: no
violation, nothing acknowledged lost, both jobs registered, commands recorded, and nothing of
the run left behind (namespaces, processes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.repo_kit import REPO_ROOT

CLASSES = "replica_cut,agent_isolated,replica_pause,power_loss"


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.split()}


def test_short_chaos_soak_breaks_no_guarantee() -> None:
    assert os.geteuid() == 0, "the chaos soak makes network namespaces: run the suite as root"
    before = namespaces()
    proc = subprocess.run(
        [sys.executable, "-m", "zeus_demo.chaos.soak", "--seconds", "30", "--seed", "1",
         "--classes", CLASSES], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    report = json.loads(lines[-1])
    context = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert report["violations"] == 0, context
    assert report["lost_acknowledged"] == 0, context
    assert report["faults"] >= 4, context
    assert set(report["fault_classes"]) == set(CLASSES.split(",")), context
    assert report["jobs_registered"] == 2 and report["commands"] > 0, context
    assert proc.returncode == 0, context
    assert {n for n in namespaces() - before if n.startswith("zc")} == set()
