"""The GPU interface every backend implements, and the description a GPU announces.

* `GPUInfo`: the static facts an agent announces (identity, power-limit range, clock tables).
* `Telemetry`: one reading of what an agent samples (energy, power, limit, clocks).
* `GPU`: one method per capability, units in the names (W, J, MHz). Backends:
  `zeus_agent.gpu.nvml` (real GPUs through pynvml) and `zeus_agent.gpu.sim` (the calibrated
  simulated GPU). Methods are synchronous and may block (NVML takes a driver lock): a backend
  says so with `GPU.calls_block`, and async callers then run them in a thread
  (`zeus_agent.gpu.threaded.GPUCaller`).

Power limits are integer watts; the NVML backend alone converts from milliwatts.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field

from zeus_agent.errors import GPUValueError


@dataclass(frozen=True, slots=True)
class GPUInfo:
    """Static description of one GPU.

    Attributes:
        index: Index of the GPU on its node (as NVML counts them).
        uuid: Globally unique id, e.g. "GPU-6a1c...".
        name: Marketing name, e.g. "NVIDIA A40".
        architecture: Lower-case architecture name, e.g. "ampere", "volta".
        min_power_limit_w: Lowest settable power limit (W).
        max_power_limit_w: Highest settable power limit (W).
        default_power_limit_w: Power limit after reset (W).
        supported_memory_clocks_mhz: Memory clocks, highest first (MHz).
        supported_graphics_clocks_mhz: SM clocks at the highest memory clock, highest first (MHz).
        has_energy_counter: Whether the GPU has a hardware energy counter (Volta and newer).
    """

    index: int
    uuid: str
    name: str
    architecture: str
    min_power_limit_w: int
    max_power_limit_w: int
    default_power_limit_w: int
    supported_memory_clocks_mhz: tuple[int, ...] = field(default_factory=tuple)
    supported_graphics_clocks_mhz: tuple[int, ...] = field(default_factory=tuple)
    has_energy_counter: bool = True

    def check_power_limit(self, power_limit_w: int) -> None:
        """Raise `GPUValueError` unless the limit is within this GPU's range."""
        lo, hi = self.min_power_limit_w, self.max_power_limit_w
        if not lo <= power_limit_w <= hi:
            raise GPUValueError(
                f"power limit {power_limit_w} W is outside the range of GPU {self.index} "
                f"({self.name}): [{lo}, {hi}] W"
            )

    def check_sm_clock(self, mhz: int) -> None:
        """Raise `GPUValueError` unless the GPU lists the SM clock (any, if it lists none)."""
        clocks = self.supported_graphics_clocks_mhz
        if clocks and mhz not in clocks:
            nearest = sorted(clocks, key=lambda c: abs(c - mhz))[:3]
            raise GPUValueError(
                f"SM clock {mhz} MHz is not supported by GPU {self.index} ({self.name}); "
                f"nearest supported: {sorted(nearest)} MHz (range {min(clocks)}-{max(clocks)})"
            )


@dataclass(frozen=True, slots=True)
class Telemetry:
    """One reading of a GPU.

    Attributes:
        energy_j: Energy counter (J); None when the GPU has none (integrate `power_w`).
        power_w: Power draw (W).
        power_limit_w: Power limit (W).
        sm_clock_mhz: SM clock (MHz).
        memory_clock_mhz: Memory clock (MHz).
    """

    energy_j: float | None
    power_w: float
    power_limit_w: int
    sm_clock_mhz: int
    memory_clock_mhz: int


class GPU(abc.ABC):
    """One GPU. Units: W, J, MHz. Raise `zeus_agent.errors.GPUError` subclasses on failure."""

    index: int

    calls_block: bool = True
    """Whether a call may block its thread (on a driver lock, or hung with a GPU gone).

    True (the default, and NVML's): async callers run the methods in threads of their own
    (`zeus_agent.gpu.threaded.GPUCaller`), and the agent gives the GPU a doorbell thread.
    False: every call returns in microseconds, so it runs inline on the event loop (the
    simulated GPU without call costs). Each backend states its value; it may set it per
    instance (the simulated GPU does, from its cost model)."""

    # Identity and static facts.
    @abc.abstractmethod
    def get_name(self) -> str:
        """Return the marketing name of the GPU."""

    @abc.abstractmethod
    def get_uuid(self) -> str:
        """Return the GPU's UUID."""

    @abc.abstractmethod
    def get_architecture(self) -> str:
        """Return the lower-case architecture name (e.g. "ampere")."""

    @abc.abstractmethod
    def get_power_limit_constraints_w(self) -> tuple[int, int]:
        """Return the (min, max) settable power limit. Units: W."""

    @abc.abstractmethod
    def get_default_power_limit_w(self) -> int:
        """Return the default power limit. Units: W."""

    @abc.abstractmethod
    def get_supported_memory_clocks_mhz(self) -> Sequence[int]:
        """Return the supported memory clocks, highest first. Units: MHz."""

    @abc.abstractmethod
    def get_supported_graphics_clocks_mhz(
        self, memory_clock_mhz: int | None = None
    ) -> Sequence[int]:
        """Return the SM clocks supported at a memory clock (default: the highest). Units: MHz."""

    @abc.abstractmethod
    def supports_energy_counter(self) -> bool:
        """Return whether the GPU has a hardware energy counter (Volta and newer)."""

    # Power limit.
    @abc.abstractmethod
    def get_power_limit_w(self) -> int:
        """Return the current power limit. Units: W."""

    @abc.abstractmethod
    def set_power_limit_w(self, power_limit_w: int) -> None:
        """Set the power limit. Units: W. Raises `GPUValueError` when out of range."""

    @abc.abstractmethod
    def reset_power_limit(self) -> None:
        """Restore the default power limit."""

    # Clocks.
    @abc.abstractmethod
    def lock_sm_clocks_mhz(self, min_clock_mhz: int, max_clock_mhz: int) -> None:
        """Lock the SM clock into [min, max]. Units: MHz."""

    @abc.abstractmethod
    def reset_sm_clocks(self) -> None:
        """Undo `lock_sm_clocks_mhz`."""

    @abc.abstractmethod
    def get_sm_clock_mhz(self) -> int:
        """Return the current SM clock. Units: MHz."""

    @abc.abstractmethod
    def get_memory_clock_mhz(self) -> int:
        """Return the current memory clock. Units: MHz."""

    # Energy and power.
    @abc.abstractmethod
    def get_total_energy_j(self) -> float:
        """Return the energy counter. Units: J.

        GPUs older than Volta have no counter: the NVML backend emulates one by integrating
        the power it polls; other backends may raise `GPUNotSupportedError`.
        """

    @abc.abstractmethod
    def get_power_w(self) -> float:
        """Return the power draw as the driver averages it. Units: W."""

    @abc.abstractmethod
    def get_instant_power_w(self) -> float:
        """Return the instantaneous power draw (falls back to `get_power_w`). Units: W."""

    # Persistence mode.
    @abc.abstractmethod
    def get_persistence_mode(self) -> bool:
        """Return whether persistence mode is on."""

    @abc.abstractmethod
    def set_persistence_mode(self, enabled: bool) -> None:
        """Turn persistence mode on or off."""

    def read_telemetry(self) -> Telemetry:
        """Read everything an agent samples; backends may override to read it in one go."""
        from zeus_agent.errors import GPUNotSupportedError

        try:
            energy: float | None = self.get_total_energy_j()
        except GPUNotSupportedError:
            energy = None
        return Telemetry(
            energy_j=energy,
            power_w=self.get_power_w(),
            power_limit_w=self.get_power_limit_w(),
            sm_clock_mhz=self.get_sm_clock_mhz(),
            memory_clock_mhz=self.get_memory_clock_mhz(),
        )

    def read_status(self, power_limit_w: int | None = None) -> Telemetry:
        """Everything an agent samples but the energy counter (`energy_j` is None).

        On a real GPU the counter read costs milliseconds and holds the driver (the agent reads
        it on its own schedule); these getters cost microseconds, but for the power limit's
        (~146 us on an H200, and it waits behind a counter read). Backends may override it to
        read them in one go.

        Args:
            power_limit_w: The limit the caller read recently: then it is not read again.
        """
        return Telemetry(
            energy_j=None,
            power_w=self.get_power_w(),
            power_limit_w=self.get_power_limit_w() if power_limit_w is None else power_limit_w,
            sm_clock_mhz=self.get_sm_clock_mhz(),
            memory_clock_mhz=self.get_memory_clock_mhz(),
        )

    def info(self) -> GPUInfo:
        """Collect the static facts of this GPU into a `GPUInfo`."""
        min_w, max_w = self.get_power_limit_constraints_w()
        mem = tuple(sorted(self.get_supported_memory_clocks_mhz(), reverse=True))
        gfx = tuple(
            sorted(self.get_supported_graphics_clocks_mhz(mem[0] if mem else None), reverse=True)
        )
        return GPUInfo(
            index=self.index,
            uuid=self.get_uuid(),
            name=self.get_name(),
            architecture=self.get_architecture(),
            min_power_limit_w=min_w,
            max_power_limit_w=max_w,
            default_power_limit_w=self.get_default_power_limit_w(),
            supported_memory_clocks_mhz=mem,
            supported_graphics_clocks_mhz=gfx,
            has_energy_counter=self.supports_energy_counter(),
        )
