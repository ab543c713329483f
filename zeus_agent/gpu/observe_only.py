"""`ObserveOnlyGPU`: a GPU whose settings this process never changes, by construction.

An agent run with `--observe-only` (a lent or shared GPU, an operator who grants measurement
before control, an ML engineer without admin rights) wraps each backend in this class: every
getter goes to the backend, every setter (power limit, clocks, persistence, resets, and any
backend method whose name says it changes something) raises `ReadOnlyError` without calling
the backend. So the promise holds whatever path reaches a setter: a command, a lease that
lapses, a trainer that dies, the agent's shutdown.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zeus_agent.errors import ReadOnlyError
from zeus_agent.gpu.base import GPU, GPUInfo, Telemetry

__all__ = ["CHANGING_PREFIXES", "OBSERVE_ONLY_HELP", "ObserveOnlyGPU"]

OBSERVE_ONLY_HELP = (
    "this agent runs with --observe-only (ZEUS_AGENT_OBSERVE_ONLY): it measures but never "
    "changes a GPU's settings; run it without the flag, as root or with CAP_SYS_ADMIN, to let "
    "jobs control the GPU"
)
CHANGING_PREFIXES = ("set", "reset", "lock", "unlock", "clear", "enable", "disable")
"""Backend methods whose names start with one of these change the GPU: refused here."""


class ObserveOnlyGPU(GPU):
    """Wrap a backend: read everything, change nothing (setters raise `ReadOnlyError`).

    Attributes:
        index: The backend's.
        calls_block: The backend's: its reads block as they did unwrapped.
    """

    def __init__(self, gpu: GPU, why: str = OBSERVE_ONLY_HELP) -> None:
        """Wrap `gpu`; `why` is the refusal's explanation (names the flag or the privilege)."""
        self._gpu = gpu
        self._why = why
        self.index = gpu.index
        self.calls_block = gpu.calls_block

    @property
    def wrapped(self) -> GPU:
        """The backend (for its getters and tests; never call its setters)."""
        return self._gpu

    def _refuse(self, what: str) -> ReadOnlyError:
        return ReadOnlyError(f"GPU {self.index}: {what} refused: {self._why}")

    def __getattr__(self, name: str) -> Any:
        # Backend extras (a simulator's `run_work`...): getters pass, anything
        # whose name says it changes the GPU is refused.
        if name.lower().lstrip("_").startswith(CHANGING_PREFIXES):
            def refused(*_args: Any, **_kwargs: Any) -> None:
                raise self._refuse(name)

            return refused
        return getattr(self._gpu, name)

    # Getters: the backend's.
    def get_name(self) -> str:
        """The backend's."""
        return self._gpu.get_name()

    def get_uuid(self) -> str:
        """The backend's."""
        return self._gpu.get_uuid()

    def get_architecture(self) -> str:
        """The backend's."""
        return self._gpu.get_architecture()

    def get_power_limit_constraints_w(self) -> tuple[int, int]:
        """The backend's."""
        return self._gpu.get_power_limit_constraints_w()

    def get_default_power_limit_w(self) -> int:
        """The backend's."""
        return self._gpu.get_default_power_limit_w()

    def get_supported_memory_clocks_mhz(self) -> Sequence[int]:
        """The backend's."""
        return self._gpu.get_supported_memory_clocks_mhz()

    def get_supported_graphics_clocks_mhz(
        self, memory_clock_mhz: int | None = None
    ) -> Sequence[int]:
        """The backend's."""
        return self._gpu.get_supported_graphics_clocks_mhz(memory_clock_mhz)

    def supports_energy_counter(self) -> bool:
        """The backend's."""
        return self._gpu.supports_energy_counter()

    def get_power_limit_w(self) -> int:
        """The backend's."""
        return self._gpu.get_power_limit_w()

    def get_sm_clock_mhz(self) -> int:
        """The backend's."""
        return self._gpu.get_sm_clock_mhz()

    def get_memory_clock_mhz(self) -> int:
        """The backend's."""
        return self._gpu.get_memory_clock_mhz()

    def get_total_energy_j(self) -> float:
        """The backend's."""
        return self._gpu.get_total_energy_j()

    def get_power_w(self) -> float:
        """The backend's."""
        return self._gpu.get_power_w()

    def get_instant_power_w(self) -> float:
        """The backend's."""
        return self._gpu.get_instant_power_w()

    def get_persistence_mode(self) -> bool:
        """The backend's."""
        return self._gpu.get_persistence_mode()

    def read_telemetry(self) -> Telemetry:
        """The backend's (it may read everything in one go)."""
        return self._gpu.read_telemetry()

    def read_status(self, power_limit_w: int | None = None) -> Telemetry:
        """The backend's (it may read everything in one go).

        The simulator charges one read of its device file as NVML's four getters; the base
        class's four calls would charge four.
        """
        if power_limit_w is None:
            return self._gpu.read_status()
        return self._gpu.read_status(power_limit_w)

    def info(self) -> GPUInfo:
        """The backend's."""
        return self._gpu.info()

    # Setters: refused, the backend never called.
    def set_power_limit_w(self, power_limit_w: int) -> None:
        """Refused."""
        raise self._refuse(f"setting the power limit to {power_limit_w} W")

    def reset_power_limit(self) -> None:
        """Refused."""
        raise self._refuse("resetting the power limit")

    def lock_sm_clocks_mhz(self, min_clock_mhz: int, max_clock_mhz: int) -> None:
        """Refused."""
        raise self._refuse(f"locking the SM clock to {min_clock_mhz}-{max_clock_mhz} MHz")

    def reset_sm_clocks(self) -> None:
        """Refused."""
        raise self._refuse("resetting the SM clocks")

    def set_persistence_mode(self, enabled: bool) -> None:
        """Refused."""
        raise self._refuse("changing persistence mode")
