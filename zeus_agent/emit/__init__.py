"""The trainer publisher: what a training script imports to talk to its node's agent.

Tiny and unprivileged: one non-blocking Unix datagram socket (autobound to an abstract address,
so the agent can answer with `sendto`), no thread, no NATS. Events are stamped with
`time.monotonic_ns()` on the caller's thread and sent at once; they never block and never raise.
Once the HELLO reply names the bound GPU's doorbell (`zeus_agent.agent.doorbell`), events (and
the goodbye) go there through a second socket connected to it, so a scheduled clock change is
applied one wake-up sooner; requests stay on the first.

Pieces:

* `Publisher`: the socket, the rank's running counters and the hot-path event methods
  (`epoch_begin`, `epoch_end`, `step_begin`, `step_end`, `instruction_begin`,
  `instruction_end`); requests with a reply (`register_job`, `hello`, `register_rank`,
  `measure`, `measure_window`); profiling windows (`push_window`/`pop_window`/`window`, as
  in Zeus 0.16); `stats()`; `close()`.
* `ProfilingResult`: time (s) and per-GPU energy (J) of one window (Zeus 0.16's dataclass).
* `WindowEnergy`: what `Publisher.measure_window` measured: per-GPU energy, and the CPU
  packages' and their DRAM's energy (RAPL, read by the agent).
* `PublisherStats`: counters of emitted, sent, queued and dropped events.
* `RegistrationError`: the coordinator or agent refused a registration at `init`.
* `init(...)`: build the default publisher, register the job (rank 0) and the rank.
* Module-level `epoch_begin()` ... `instruction_end(name)`, `push_window`, `pop_window`,
  `window`, `stats`, `close`: delegate to the default publisher (`get_publisher()`).
* `physical_gpu_index(i)`: a CUDA device index -> the node's index, via `CUDA_VISIBLE_DEVICES`.
* `JobInfo`, `PowerLimitOptions`, `PowerLimitMeasurement`: what `init` takes (also importable
  from `zeus_agent`; they live in `zeus_agent.models` and `zeus_agent.wire.messages`).

Delivery: a datagram the agent's queue cannot take right now (`EAGAIN`; Linux queues only
`net.unix.max_dgram_qlen` datagrams per receiver, 10 by default) waits in a small bounded
backlog that the next calls flush first, in order; past the bound, events are dropped and
counted. Without an agent, events are dropped and counted, and the socket reconnects at most
once per `reconnect_interval_s` so an agent that starts later is picked up.

Modules, one concern each (this package only re-exports them): `publisher` (the constructor and
the event hot path; the rest of `Publisher` delegates to its three collaborators), `transport`
(`Transport`: socket, backlog, drops, reconnecting, close), `requests` (`Requests`: requests
with a reply: registrations, `measure`, schedule notices), `windows` (`Windows`: the stack of
profiling windows), `api` (the default publisher, `init` and the module-level calls),
`environment` (socket path and GPU index from the environment), `records` (results, stats,
`RegistrationError`). `Publisher` builds its `Transport`, then `Requests` over it, then
`Windows` over its `measure`, each from explicit constructor arguments.
"""

from __future__ import annotations

from zeus_agent.emit.api import (
    close,
    epoch_begin,
    epoch_end,
    get_publisher,
    init,
    instruction_begin,
    instruction_end,
    pop_window,
    push_window,
    stats,
    step_begin,
    step_end,
    window,
)
from zeus_agent.emit.environment import ENV_SOCKET, physical_gpu_index
from zeus_agent.emit.publisher import Publisher
from zeus_agent.emit.records import (
    ProfilingResult,
    PublisherStats,
    RegistrationError,
    WindowEnergy,
)
from zeus_agent.errors import ZeusAgentError as ZeusAgentError  # also `emit.ZeusAgentError`
from zeus_agent.models import JobInfo, PowerLimitMeasurement
from zeus_agent.wire.messages import PowerLimitOptions

__all__ = [
    "ENV_SOCKET",
    "JobInfo",
    "PowerLimitMeasurement",
    "PowerLimitOptions",
    "ProfilingResult",
    "Publisher",
    "PublisherStats",
    "RegistrationError",
    "WindowEnergy",
    "close",
    "epoch_begin",
    "epoch_end",
    "get_publisher",
    "init",
    "instruction_begin",
    "instruction_end",
    "physical_gpu_index",
    "pop_window",
    "push_window",
    "stats",
    "step_begin",
    "step_end",
    "window",
]
