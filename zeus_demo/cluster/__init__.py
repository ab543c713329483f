"""The cluster harness: what the end-to-end tests, the demo and the benchmarks start and stop.

* `free_port()`, `free_ports(n)`: loopback ports free now.
* `wait_for(predicate, timeout_s, what)` and `wait_for_async(...)`: poll until a condition
  holds; past the timeout, an `AssertionError` that says what was awaited (`fail=False`: the
  predicate's last value, for a caller that reports the timeout itself).
* `Processes`: the process registry. Every child is a session leader with its own log and a
  marker in its environment; `close()` kills every group and whatever still carries the marker;
  each child also dies with the harness process (`zeus_agent.children`), and a script run under
  `sigterm_as_sigint()` closes its registries when stopped by SIGTERM. `processes_with_mark`,
  `console_script`, `kill_group`, `MARK_ENV`, `CODE_ROOT`.
* The broker: `zeus_agent.broker.EmbeddedNats` (the project's embedded server), `NatsServer`
  (one server from a configuration file: users, TLS...), `NatsCluster` (3 routed servers with
  JetStream), `Relay` (a TCP relay the harness holds or releases).
* `SimCluster`: NATS, coordinator replicas, one sim agent per node and a simulated job (data
  parallel, `python -m zeus_demo.cluster.trainer`, or the pipeline trainer), all processes
  (the end-to-end tests').
* `Replicas`: coordinator replicas with their `/healthz` ports and CPU time (`cpu_seconds`).
* `LocalCluster`: the same pieces as services on this process's event loop (the embedded
  nats-server or an external NATS, `AgentServer`s, `CoordinatorService`s): the demo's.
"""

from __future__ import annotations

from zeus_demo.cluster.inprocess import LocalCluster
from zeus_demo.cluster.nats import NatsCluster, NatsServer, Relay
from zeus_demo.cluster.ports import free_port, free_ports
from zeus_demo.cluster.processes import (
    CODE_ROOT,
    MARK_ENV,
    Processes,
    console_script,
    kill_group,
    processes_with_mark,
    sigterm_as_sigint,
)
from zeus_demo.cluster.replicas import Replicas, cpu_seconds
from zeus_demo.cluster.sim import SimCluster
from zeus_demo.cluster.waits import wait_for, wait_for_async

__all__ = [
    "CODE_ROOT",
    "LocalCluster",
    "MARK_ENV",
    "NatsCluster",
    "NatsServer",
    "Processes",
    "Relay",
    "Replicas",
    "SimCluster",
    "console_script",
    "cpu_seconds",
    "free_port",
    "free_ports",
    "kill_group",
    "processes_with_mark",
    "sigterm_as_sigint",
    "wait_for",
    "wait_for_async",
]
