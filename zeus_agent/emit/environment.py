"""What the trainer's environment decides: the agent's socket and the node's GPU indices.

One place reads `ZEUS_AGENT_SOCKET`, `LOCAL_RANK` and `CUDA_VISIBLE_DEVICES`, so the rules that
map a process onto its node's agent and GPU are stated once and testable without a socket.
"""

from __future__ import annotations

import os
from typing import Any

from zeus_agent.wire.trainer import DEFAULT_SOCKET_PATH

ENV_SOCKET = "ZEUS_AGENT_SOCKET"
"""Environment variable naming the agent's socket (else `DEFAULT_SOCKET_PATH`)."""


def _visible_devices(env: Any = None) -> list[int] | None:
    value = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if value is None or not value.strip():
        return None
    try:
        return [int(part) for part in value.split(",") if part.strip()]
    except ValueError:  # UUIDs or MIG names: no integer mapping.
        return None


def physical_gpu_index(index: int, env: Any = None) -> int:
    """Map a CUDA device index of this process to the node's GPU index (what the agent uses).

    When `CUDA_VISIBLE_DEVICES` is a list of integers, CUDA index i is its i-th entry;
    otherwise (unset, or UUIDs) the index is returned unchanged. The agent numbers GPUs as
    NVML does (PCI bus order): set `CUDA_DEVICE_ORDER=PCI_BUS_ID` so both agree.

    Args:
        index: CUDA device index (as in `torch.device("cuda", index)`).
        env: Environment mapping to read (default `os.environ`).

    Raises:
        ValueError: `index` is negative or beyond the devices `CUDA_VISIBLE_DEVICES` lists.
    """
    if index < 0:
        raise ValueError(f"GPU index must be non-negative, got {index}")
    devices = _visible_devices(env)
    if devices is None:
        return index
    if index >= len(devices):
        value = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
        raise ValueError(
            f"GPU index {index} is not visible: CUDA_VISIBLE_DEVICES={value!r} lists "
            f"{len(devices)} device(s); use an index below {len(devices)}"
        )
    return devices[index]


def default_gpu_index() -> int:
    """The CUDA device index this process drives when none is given: `LOCAL_RANK`, else 0."""
    try:
        return int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        return 0


def resolve_socket_path(socket_path: str | None) -> str:
    """The agent's socket: `socket_path`, else `ZEUS_AGENT_SOCKET`, else the default path."""
    return socket_path or os.environ.get(ENV_SOCKET) or DEFAULT_SOCKET_PATH
