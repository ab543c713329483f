"""`AgentSettings`: every knob of `zeus-agent run`, defined once (flags and ZEUS_AGENT_* env).

The NATS connection's fields (URL, credentials, TLS files, connect timeout, embedded server,
prefix) come from `zeus_agent.bus.NatsSettings`, shared with the coordinator's settings.

pydantic-settings builds both the command-line flags (`--nats-url`, `--backend`, ...) and the
environment variables (`ZEUS_AGENT_NATS_URL`, ...) from the fields below; flags win over the
environment. Construction does no I/O.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from zeus_agent.agent.core.fencing import DEFAULT_SKEW_S
from zeus_agent.agent.core.formats import ColumnsMode
from zeus_agent.agent.rapl import DEFAULT_RAPL_PERIOD_S, DEFAULT_RAPL_ROOT
from zeus_agent.bus import NatsSettings
from zeus_agent.models import MAX_NAME_CHARS
from zeus_agent.wire.messages import MAX_LEASE_S
from zeus_agent.wire.trainer import DEFAULT_SOCKET_PATH

OLD_FLAGS = {"--measurement-columns": "on", "--no-measurement-columns": "off"}
"""`--measurement-columns` as a yes/no flag, as it was until 2026-12-07 (`old_flags`)."""
MAX_SOCKET_PATH_BYTES = 107
"""Longest Unix socket path Linux binds (`sun_path` is 108 bytes with the final NUL)."""


class AgentSettings(NatsSettings):
    """Configuration of one node agent.

    Every flag is also an environment variable: ZEUS_AGENT_ and the flag's name in capitals with
    underscores (--nats-url: ZEUS_AGENT_NATS_URL). Flags win over the environment.

    Exit codes: 0 stopped by SIGTERM/SIGINT (GPU settings restored); 2 invalid configuration;
    3 startup failure (NATS unreachable, socket or metrics port unusable); 4 the NATS server
    closed the connection for good (settings restored; let the supervisor restart the agent,
    e.g. systemd Restart=on-failure). With --metrics-port, GET /healthz answers 200 while the
    agent is connected and serving, else 503 with the reason.
    """

    model_config = SettingsConfigDict(
        env_prefix="ZEUS_AGENT_", cli_kebab_case=True, cli_implicit_flags=True, extra="ignore"
    )

    node: str = Field(
        default_factory=socket.gethostname,
        min_length=1,
        max_length=MAX_NAME_CHARS,
        description="Node name used in subjects",
    )
    backend: Literal["nvml", "sim"] = Field(
        "nvml", description="GPU backend: 'nvml' (real GPUs) or 'sim' (simulated GPUs)"
    )
    gpus: list[int] | None = Field(
        None, description="GPU indices to manage, e.g. '0,1'; default: all (nvml) or sim-count"
    )
    sim_count: int = Field(1, ge=1, description="Number of simulated GPUs (backend sim)")
    sim_preset: str = Field(
        "A40", description="Simulated GPU model: A40, V100, A100, A100-SXM, H100"
    )
    sim_energy_update_ms: float | None = Field(
        None,
        ge=0,
        le=10_000,
        description="How often a simulated GPU's energy counter advances (ms), as NVML's does "
        "on real GPUs (~100 ms); default: the preset's (100 ms); 0: continuous",
    )
    sim_nvml_timing: Literal["h200", "none"] = Field(
        "h200",
        description="What a simulated GPU's NVML calls cost: 'h200' charges what they cost on "
        "a real H200 (energy-counter read ~3 ms, p99 24 ms; power-limit read 146 us; other "
        "getters 1-5 us; setters --sim-set-latency-ms), runs the counter read, power-limit read "
        "and setters one at a time per GPU as the driver does, and jitters the energy counter's "
        "100 ms updates as recorded; 'none' charges nothing (fast tests only)",
    )
    sim_set_latency_ms: float = Field(
        1.0,
        ge=0,
        le=1000,
        allow_inf_nan=False,
        description="Cost of a simulated setter (lock clocks, set a power limit) under "
        "--sim-nvml-timing h200 (ms): setters could not be timed on the real GPU",
    )
    sim_state_dir: str = Field(
        "/tmp/zeus-sim", description="Directory of the simulated GPUs' shared state files"
    )
    sim_attach: bool = Field(
        False, description="Open existing simulated GPU files instead of creating them"
    )
    sample_hz: float = Field(10.0, gt=0, le=1000, description="GPU sampling rate (Hz)")
    publish_interval_s: float = Field(
        1.0, ge=0.01, le=3600, description="How often samples are published (s)"
    )
    measurement_flush_s: float = Field(
        0.05, ge=0, le=1.0, allow_inf_nan=False,
        description="How long after a GPU's marks or measurements are ready the node's batch "
        "goes out (s): the node's GPUs' are sent together, one message per job on "
        "<p>.job.<job>.meas.<node>. 0: at once, as before node batches (about a message per GPU "
        "and counter read); with 8 GPUs, 0.05 sends ~4.5 times fewer messages and a mark "
        "arrives ~30 ms later (bench/node_batches.py)",
    )
    measurement_columns: ColumnsMode = Field(
        "auto",
        description="The layout of the node's batches of marks and measurements and of the "
        "ranks' trainer events: 'auto' sends a job's in columns (NodeColumnBatch, "
        "TrainerEventColumns: an array per field, not a map per item, which coordinators decode "
        "several times faster) while the job's owner says in its lease renewals that it reads "
        "them and no coordinator heard says otherwise, rows otherwise (an older coordinator "
        "drops columns as malformed; a job that holds no lease on the node has an owner the "
        "agent does not hear); 'on': always columns (every coordinator of this version or "
        "newer); 'off': always rows. A node's rank registrations follow it too "
        "(RegisterRankColumns): 'auto' and 'on' try columns, 'auto' unless a coordinator "
        "heard does not read them, and a coordinator that refuses them gets the batch again "
        "in rows; 'off': rows. The yes/no flag of before still works (bare: on, "
        "--no-measurement-columns: off)",
    )
    heartbeat_s: float = Field(
        5.0, ge=0.1, le=3600, description="Announcement/heartbeat interval (s)"
    )
    default_lease_s: float = Field(
        60.0,
        gt=0,
        le=MAX_LEASE_S,
        allow_inf_nan=False,
        description="Lease of a setting whose command names none (s): every non-default "
        "setting is restored unless renewed within its lease",
    )
    fence_skew_s: float = Field(
        DEFAULT_SKEW_S,
        ge=0,
        le=60,
        allow_inf_nan=False,
        description="How far this node's clock may lag the coordinators' (s): a command whose "
        "sender's ownership lease (its Zeus-Lease header) ends within this of the agent's clock "
        "is refused (stale_lease); fencing by time assumes the clocks agree this closely (NTP), "
        "and it must stay well below a third of the coordinators' --ownership-lease-s",
    )
    labels: list[str] = Field(
        default=[],
        max_length=64,
        description="The node's labels, key=value (e.g. rack=a7), announced to the coordinator: "
        "power budgets select nodes by them (zeus-coordinator budget set --label rack=a7)",
    )
    history: str | None = Field(
        default=None,
        description="Append every GPU command answered (with its sender's ownership lease), "
        "lease renewal and restore of defaults to this file, one JSON object a line: what the "
        "chaos checker reads (zeus_demo.chaos)",
    )
    observe_only: bool = Field(
        default=False,
        description="Never change a GPU's settings: no power limit, clock, reset or persistence "
        "call, not at start, not for a command, not at shutdown. Sampling, windows, step and "
        "instruction measurements, metrics and health work as usual; a command that would "
        "change a setting gets the error code read_only. For measurement without privileges, "
        "or on a GPU that is lent or shared",
    )
    reset_on_start: bool = Field(
        default=True,
        description="Reset power limits and clocks at start (a previous agent may have been "
        "killed before it could restore them)",
    )
    socket_path: str = Field(
        DEFAULT_SOCKET_PATH, description="Unix datagram socket where trainers send events"
    )
    socket_mode: str = Field(
        "0666", description="Octal file mode of the socket (who may send events)"
    )
    socket_group: str | None = Field(
        None, description="Group owning the socket (with mode 0660: only its members may send)"
    )
    doorbell_spin_us: float = Field(
        500.0,
        ge=0,
        le=5_000,
        allow_inf_nan=False,
        description="During a frequency schedule, the GPU's doorbell thread polls without "
        "sleeping from this long before each clock change's forecast instant to twice this "
        "long after it (us): a sleeping thread takes 100-400 us to wake on a VM, a spinning "
        "one microseconds. Costs at most three times this in CPU time of one core per "
        "scheduled clock change, spent only on changes forecast at least 30 times this away "
        "(at most a tenth of a core per GPU); 0 never spins",
    )
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Serve Prometheus /metrics and /healthz on this port (0: any free)",
    )
    metrics_host: str = Field("0.0.0.0", description="Address /metrics and /healthz listen on")
    ring_seconds: float = Field(
        600.0, gt=0, description="How much sample history answers energy windows (s)"
    )
    rapl_root: str = Field(
        DEFAULT_RAPL_ROOT,
        description="Powercap sysfs tree whose RAPL counters (its intel-rapl zones, AMD's too) "
        "give windows their CPU package and DRAM energy; in a container, the host's "
        "/sys/class/powercap mounted somewhere; 'none': do not read RAPL (windows then answer "
        "CPU and DRAM energy as None, as on a node without RAPL)",
    )
    rapl_period_s: float = Field(
        DEFAULT_RAPL_PERIOD_S,
        ge=0.01,
        le=10.0,
        allow_inf_nan=False,
        description="How often every RAPL counter is read (s): a counter that wraps twice "
        "between two readings loses a wrap (at 0.1 s, only above 43 kW on a 4.3 kJ counter); "
        "a window's start is interpolated between two readings, its end bracketed by a "
        "reading made when the window is answered",
    )
    request_timeout_s: float = Field(
        5.0, gt=0, description="Timeout of requests relayed to the coordinator (s)"
    )
    log_level: str = Field("INFO", description="Log level")

    @field_validator("measurement_columns", mode="before")
    @classmethod
    def _columns_mode(cls, value: object) -> object:
        """Yes/no as the flag was before `auto` (true: on, false: off)."""
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return "on" if value.lower() in ("true", "1", "yes") else "off"
        return value

    @field_validator("socket_mode")
    @classmethod
    def _octal(cls, value: str) -> str:
        try:
            int(value, 8)
        except ValueError:
            raise ValueError(
                f"socket_mode must be an octal mode like 0660, got {value!r}"
            ) from None
        return value

    @field_validator("socket_path")
    @classmethod
    def _socket_path(cls, value: str) -> str:
        size = len(os.fsencode(value))
        if not value or size > MAX_SOCKET_PATH_BYTES:
            raise ValueError(
                f"the socket path is {size} bytes long; Linux binds Unix socket paths of 1 to "
                f"{MAX_SOCKET_PATH_BYTES} bytes: choose a shorter --socket-path"
            )
        return value

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: list[str]) -> list[str]:
        from zeus_agent.wire.budget import LABEL

        labels = [item.strip() for entry in value for item in entry.split(",") if item.strip()]
        for label in labels:
            if not LABEL.match(label):
                raise ValueError(
                    f"label {label[:80]!r} is not key=value (letters, digits, '_', '-', '.'; "
                    "key up to 63 characters, '/' allowed in it; value up to 63)"
                )
        return labels

    @field_validator("log_level")
    @classmethod
    def _upper(cls, value: str) -> str:
        return value.upper()


def old_flags(argv: Sequence[str]) -> list[str]:
    """`argv` with `--measurement-columns` given as the yes/no flag it was, as its value now.

    Bare (`--measurement-columns`: on) or negated (`--no-measurement-columns`: off), as the
    deploy guide said to pass it: an agent's unit file from before starts as it did instead of
    stopping on a usage error. A value given (`auto`, `on`, `off`) is left alone.
    """
    out = []
    for i, arg in enumerate(argv):
        bare = i + 1 == len(argv) or argv[i + 1].startswith("-")
        if arg in OLD_FLAGS and (bare or arg.startswith("--no-")):
            arg = f"--measurement-columns={OLD_FLAGS[arg]}"
        out.append(arg)
    return out
