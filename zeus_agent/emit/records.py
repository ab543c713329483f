"""The values `zeus_agent.emit` hands back: window results, counters, and its one error.

Plain data, no I/O, so every other module of the package (and a user's type hints) can import
them without pulling in the socket code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zeus_agent.errors import ZeusAgentError


class RegistrationError(ZeusAgentError):
    """The agent or the coordinator refused a registration (`Reply.ok` False).

    Raised by `init` (never on the hot path). `code` is the reply's stable code
    (`bad_request`, `unknown_job`, `duplicate`, `unavailable`, ...).

    Attributes:
        code: The reply's error code.
        message: The reply's error message.
        what: What was being registered: "job", "hello" or "rank".
    """

    def __init__(self, what: str, code: str, message: str) -> None:
        super().__init__(f"registering the {what} failed: [{code}] {message}")
        self.what = what
        self.code = code
        self.message = message


@dataclass
class ProfilingResult:
    """Profiling result of one window (as in Zeus 0.16).

    Attributes:
        time: Time elapsed within the window (s).
        energy: Energy of each of the publisher's GPUs within the window (J), in the order of
            its `gpu_indices`; NaN when no agent answered.
    """

    time: float
    energy: list[float]


@dataclass(frozen=True)
class PublisherStats:
    """A snapshot of a publisher's counters.

    Attributes:
        events: Event calls so far.
        sent: Events handed to the kernel.
        queued: Events waiting in the local backlog (the agent's queue was full).
        dropped: Events lost, all reasons.
        dropped_by_reason: `no_agent` (nobody at the socket), `buffer_full` (backlog full
            too), `error` (anything else).
        windows_unanswered: Window requests without an answer (their energies are NaN).
        sync_failures: `torch.cuda.synchronize()` calls that raised (the event was sent).
        connected: Whether the socket is currently connected to an agent.
        detached: Whether `init` found no agent (or it did not answer).
    """

    events: int
    sent: int
    queued: int
    dropped: int
    dropped_by_reason: dict[str, int]
    windows_unanswered: int
    sync_failures: int
    connected: bool
    detached: bool


@dataclass
class WindowHandle:
    """What `Publisher.window` yields; `result` is set when the block exits."""

    name: str | None
    result: ProfilingResult | None = field(default=None)


@dataclass(frozen=True)
class WindowEnergy:
    """What the agent measured of one window (`Publisher.measure_window`).

    Attributes:
        gpu_energy: Each GPU's energy (J), in the order asked; NaN when no agent answered.
        cpu_energy: CPU index (a RAPL package, `intel-rapl:<index>`) -> its energy (J); None
            when CPU energy was not asked for or none could be measured (Zeus 0.16's
            `Measurement.cpu_energy`).
        dram_energy: CPU index -> its DRAM's energy (J), for packages with a DRAM domain;
            None when there is none (Zeus 0.16's `Measurement.dram_energy`).
        cpu_note: Why CPU energy asked for is missing, in full or in part ("" when nothing is).
    """

    gpu_energy: list[float]
    cpu_energy: dict[int, float] | None = None
    dram_energy: dict[int, float] | None = None
    cpu_note: str = ""
