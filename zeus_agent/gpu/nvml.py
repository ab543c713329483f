"""The NVML backend: real NVIDIA GPUs through `pynvml` (the `nvidia-ml-py` distribution).

* `NVMLGPU`: one GPU, implementing `zeus_agent.gpu.base.GPU`. It alone converts NVML's
  milliwatts and millijoules into the project's watts and joules, validates settings before
  calling NVML, caches the static facts (name, UUID, clock tables, power-limit range) and, on
  GPUs older than Volta, emulates the energy counter with a `PowerIntegrator`.
* `nvml_gpus`: initialise NVML once and build an `NVMLGPU` for every (or each listed) index.
* `ARCHITECTURES`: NVML architecture codes -> lower-case names.
* `_nvml_errors` with `_ERROR_MAP`: the one place where NVML error codes become
  `zeus_agent.errors` exceptions (chained `from e`, naming the call and the GPU index).

Every method is synchronous and may block on the NVML driver lock; async code calls them
through `zeus_agent.gpu.threaded.GPUCaller` (hence `NVMLGPU.calls_block = True`). The `nvml`
module is injected (tests pass a fake); by default `pynvml` is imported lazily, so importing this
module works on machines without the NVIDIA driver.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from zeus_agent.errors import (
    GPUError,
    GPUNotSupportedError,
    GPUPermissionError,
    GPUUnavailableError,
    GPUValueError,
)
from zeus_agent.gpu.base import GPU
from zeus_agent.gpu.power_integrator import PowerIntegrator

__all__ = ["ARCHITECTURES", "NVMLGPU", "nvml_gpus"]

# NVML constants, as defined by nvml.h and pynvml (checked against nvidia-ml-py 13.x in the
# tests). They are part of NVML's ABI, so hard-coding them lets this module import without pynvml.
_NVML_SUCCESS = 0
_NVML_ERROR_UNINITIALIZED = 1
_NVML_ERROR_INVALID_ARGUMENT = 2
_NVML_ERROR_NOT_SUPPORTED = 3
_NVML_ERROR_NO_PERMISSION = 4
_NVML_ERROR_NOT_FOUND = 6
_NVML_ERROR_DRIVER_NOT_LOADED = 9
_NVML_ERROR_TIMEOUT = 10
_NVML_ERROR_IRQ_ISSUE = 11
_NVML_ERROR_LIBRARY_NOT_FOUND = 12
_NVML_ERROR_FUNCTION_NOT_FOUND = 13
_NVML_ERROR_GPU_IS_LOST = 15
_NVML_ERROR_RESET_REQUIRED = 16
_NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
_NVML_ERROR_FREQ_NOT_SUPPORTED = 24
_NVML_ERROR_NOT_READY = 27
_NVML_ERROR_GPU_NOT_FOUND = 28
_NVML_CLOCK_SM = 1
_NVML_CLOCK_MEM = 2
_NVML_FI_DEV_POWER_INSTANT = 186
_NVML_FEATURE_DISABLED = 0
_NVML_FEATURE_ENABLED = 1
_NVML_DEVICE_ARCH_VOLTA = 5
_NVML_DEVICE_ARCH_UNKNOWN = 0xFFFFFFFF

ARCHITECTURES: dict[int, str] = {
    2: "kepler",
    3: "maxwell",
    4: "pascal",
    5: "volta",
    6: "turing",
    7: "ampere",
    8: "ada",
    9: "hopper",
    10: "blackwell",
    13: "rubin",
}
"""NVML architecture codes (`NVML_DEVICE_ARCH_*`) -> names. Others map to "unknown"."""

_PRIVILEGES_HELP = (
    "This operation needs CAP_SYS_ADMIN or root. Run the agent as root, or grant the "
    "capability: `sudo setcap cap_sys_admin+ep <path to the python binary>` on a host, "
    "`docker run --cap-add SYS_ADMIN ...` (Kubernetes: securityContext.capabilities.add: "
    '["SYS_ADMIN"]) in a container. See https://ml.energy/zeus/getting_started/#system-privileges'
)

_ERROR_MAP: dict[int, type[GPUError]] = {
    _NVML_ERROR_NO_PERMISSION: GPUPermissionError,
    _NVML_ERROR_NOT_SUPPORTED: GPUNotSupportedError,
    _NVML_ERROR_FUNCTION_NOT_FOUND: GPUNotSupportedError,
    _NVML_ERROR_INVALID_ARGUMENT: GPUValueError,
    _NVML_ERROR_FREQ_NOT_SUPPORTED: GPUValueError,
    _NVML_ERROR_NOT_FOUND: GPUValueError,
    _NVML_ERROR_UNINITIALIZED: GPUUnavailableError,
    _NVML_ERROR_DRIVER_NOT_LOADED: GPUUnavailableError,
    _NVML_ERROR_TIMEOUT: GPUUnavailableError,
    _NVML_ERROR_IRQ_ISSUE: GPUUnavailableError,
    _NVML_ERROR_LIBRARY_NOT_FOUND: GPUUnavailableError,
    _NVML_ERROR_GPU_IS_LOST: GPUUnavailableError,
    _NVML_ERROR_RESET_REQUIRED: GPUUnavailableError,
    _NVML_ERROR_LIB_RM_VERSION_MISMATCH: GPUUnavailableError,
    _NVML_ERROR_NOT_READY: GPUUnavailableError,
    _NVML_ERROR_GPU_NOT_FOUND: GPUUnavailableError,
}
"""NVML error code -> project exception. Codes not listed become a plain `GPUError`."""


def _load_pynvml() -> Any:
    """Import `pynvml` on first use.

    Raises:
        GPUUnavailableError: If `nvidia-ml-py` is not installed.
    """
    try:
        return importlib.import_module("pynvml")
    except ImportError as e:
        raise GPUUnavailableError(
            "The NVML backend needs the `nvidia-ml-py` package (module `pynvml`): "
            "`pip install nvidia-ml-py` (not the unofficial `pynvml` distribution)."
        ) from e


@contextlib.contextmanager
def _nvml_errors(nvml: Any, call: str, index: int | None) -> Iterator[None]:
    """Turn an `NVMLError` raised inside the block into a `zeus_agent.errors.GPUError`.

    Args:
        nvml: The pynvml module (or fake) whose `NVMLError` to catch.
        call: Name of the NVML function being called, for the message.
        index: GPU index, or None for calls not about one GPU (`nvmlInit`).

    Raises:
        GPUError: The subclass `_ERROR_MAP` gives for the NVML code, chained from the NVML error.
    """
    try:
        yield
    except nvml.NVMLError as e:
        code = getattr(e, "value", None)
        where = f"{call} on GPU {index}" if index is not None else call
        message = f"{where} failed: {e} (NVML error code {code})."
        exc_type = _ERROR_MAP.get(code, GPUError) if isinstance(code, int) else GPUError
        if exc_type is GPUPermissionError:
            message = f"{message} {_PRIVILEGES_HELP}"
        raise exc_type(message) from e


class NVMLGPU(GPU):
    """One NVIDIA GPU driven through NVML. Units: W, J, MHz (NVML's mW/mJ converted here).

    Static facts (name, UUID, architecture, power-limit range, default limit, clock tables) are
    read once and cached. Power limits in watts are rounded inward from NVML's milliwatt range
    (min up, max down), so every integer watt in the range can be set.

    GPUs older than Volta have no energy counter: `supports_energy_counter()` is False and
    `get_total_energy_j()` returns energy emulated by integrating the power NVML reports
    (trapezoids between polls). Each call to `get_total_energy_j()` or `get_power_w()` adds one
    sample, so the emulation is only as accurate as the caller's poll rate (the agent polls at
    its sampling rate); it counts from the first poll, not from boot.

    Attributes:
        index: NVML index of the GPU.
        calls_block: Always True: NVML calls block on the driver lock, so async callers run them
            in a thread (`zeus_agent.gpu.threaded.GPUCaller`).
    """

    calls_block = True

    def __init__(
        self,
        index: int,
        nvml: Any = None,
        *,
        init: bool = True,
        clock_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        """Get the NVML handle of GPU `index`.

        Args:
            index: NVML index of the GPU (not the CUDA index; see `nvml_gpus`).
            nvml: The pynvml module to use; None imports `pynvml`. Tests pass a fake.
            init: Call `nvmlInit` first. NVML counts initialisations, so this is safe to repeat;
                `nvml_gpus` initialises once and passes False.
            clock_ns: Monotonic clock (ns) timing the power samples of the pre-Volta emulation.

        Raises:
            GPUUnavailableError: If NVML cannot be loaded or initialised.
            GPUValueError: If there is no GPU `index`.
            GPUError: For any other NVML failure.
        """
        self._nvml: Any = nvml if nvml is not None else _load_pynvml()
        self.index = index
        self._clock_ns = clock_ns
        if init:
            with _nvml_errors(self._nvml, "nvmlInit", None):
                self._nvml.nvmlInit()
        self._handle: Any = self._call("nvmlDeviceGetHandleByIndex", index, handle=False)

        self._name: str | None = None
        self._uuid: str | None = None
        self._arch_code: int | None = None
        self._has_energy_counter: bool | None = None
        self._constraints_mw: tuple[int, int] | None = None
        self._default_limit_mw: int | None = None
        self._memory_clocks_mhz: tuple[int, ...] | None = None
        self._graphics_clocks_mhz: dict[int, tuple[int, ...]] = {}
        self._instant_power_supported = True
        self._integrator = PowerIntegrator()
        self._integrator_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"NVMLGPU(index={self.index})"

    def _call(self, function: str, *args: Any, handle: bool = True) -> Any:
        """Call `nvml.<function>(handle, *args)` with NVML errors mapped to project errors.

        Args:
            function: Name of the pynvml function.
            *args: Arguments after the device handle.
            handle: Pass this GPU's handle as the first argument.

        Returns:
            Whatever the pynvml function returns.

        Raises:
            GPUError: The mapped subclass when NVML fails (see `_ERROR_MAP`).
        """
        fn = getattr(self._nvml, function)
        with _nvml_errors(self._nvml, function, self.index):
            return fn(self._handle, *args) if handle else fn(*args)

    # Identity and static facts.
    def get_name(self) -> str:
        """Return the marketing name of the GPU, e.g. "NVIDIA A40"."""
        if self._name is None:
            self._name = _as_str(self._call("nvmlDeviceGetName"))
        return self._name

    def get_uuid(self) -> str:
        """Return the GPU's UUID, e.g. "GPU-6a1c...."."""
        if self._uuid is None:
            self._uuid = _as_str(self._call("nvmlDeviceGetUUID"))
        return self._uuid

    def _architecture_code(self) -> int:
        if self._arch_code is None:
            try:
                self._arch_code = int(self._call("nvmlDeviceGetArchitecture"))
            except GPUNotSupportedError:  # Drivers before R470 lack the call.
                self._arch_code = _NVML_DEVICE_ARCH_UNKNOWN
        return self._arch_code

    def get_architecture(self) -> str:
        """Return the lower-case architecture name, or "unknown" for codes not in the table."""
        return ARCHITECTURES.get(self._architecture_code(), "unknown")

    def get_power_limit_constraints_w(self) -> tuple[int, int]:
        """Return the (min, max) settable power limit, rounded inward to whole W. Units: W."""
        min_mw, max_mw = self._power_limit_constraints_mw()
        return -(-min_mw // 1000), max_mw // 1000

    def _power_limit_constraints_mw(self) -> tuple[int, int]:
        if self._constraints_mw is None:
            min_mw, max_mw = self._call("nvmlDeviceGetPowerManagementLimitConstraints")
            self._constraints_mw = (int(min_mw), int(max_mw))
        return self._constraints_mw

    def get_default_power_limit_w(self) -> int:
        """Return the default power limit, rounded to whole W. Units: W."""
        return round(self._default_power_limit_mw() / 1000)

    def _default_power_limit_mw(self) -> int:
        if self._default_limit_mw is None:
            self._default_limit_mw = int(self._call("nvmlDeviceGetPowerManagementDefaultLimit"))
        return self._default_limit_mw

    def get_supported_memory_clocks_mhz(self) -> Sequence[int]:
        """Return the supported memory clocks, highest first. Units: MHz."""
        if self._memory_clocks_mhz is None:
            clocks = self._call("nvmlDeviceGetSupportedMemoryClocks")
            self._memory_clocks_mhz = tuple(sorted((int(c) for c in clocks), reverse=True))
        return self._memory_clocks_mhz

    def get_supported_graphics_clocks_mhz(
        self, memory_clock_mhz: int | None = None
    ) -> Sequence[int]:
        """Return the SM clocks supported at a memory clock, highest first. Units: MHz.

        Args:
            memory_clock_mhz: Memory clock to ask about; None means the highest supported.

        Raises:
            GPUValueError: If `memory_clock_mhz` is not a supported memory clock.
        """
        memory_clocks = self.get_supported_memory_clocks_mhz()
        if memory_clock_mhz is None:
            if not memory_clocks:
                return ()
            memory_clock_mhz = memory_clocks[0]
        elif memory_clock_mhz not in memory_clocks:
            raise GPUValueError(
                f"GPU {self.index}: memory clock {memory_clock_mhz} MHz is not supported; "
                f"supported memory clocks are {list(memory_clocks)} MHz."
            )
        if memory_clock_mhz not in self._graphics_clocks_mhz:
            clocks = self._call("nvmlDeviceGetSupportedGraphicsClocks", memory_clock_mhz)
            self._graphics_clocks_mhz[memory_clock_mhz] = tuple(
                sorted((int(c) for c in clocks), reverse=True)
            )
        return self._graphics_clocks_mhz[memory_clock_mhz]

    def supports_energy_counter(self) -> bool:
        """Return whether the GPU has a hardware energy counter (Volta and newer).

        For an architecture code this module does not know, the counter is probed once.
        """
        if self._has_energy_counter is None:
            code = self._architecture_code()
            if code in ARCHITECTURES:
                self._has_energy_counter = code >= _NVML_DEVICE_ARCH_VOLTA
            else:
                try:
                    self._call("nvmlDeviceGetTotalEnergyConsumption")
                except GPUNotSupportedError:
                    self._has_energy_counter = False
                else:
                    self._has_energy_counter = True
        return self._has_energy_counter

    # Power limit.
    def get_power_limit_w(self) -> int:
        """Return the current power limit, rounded to whole W. Units: W."""
        return round(int(self._call("nvmlDeviceGetPowerManagementLimit")) / 1000)

    def set_power_limit_w(self, power_limit_w: int) -> None:
        """Set the power limit. Units: W. Needs CAP_SYS_ADMIN or root.

        Args:
            power_limit_w: New limit, within `get_power_limit_constraints_w()`.

        Raises:
            GPUValueError: If the limit is outside the GPU's range (checked before calling NVML).
            GPUPermissionError: If the process lacks CAP_SYS_ADMIN.
        """
        min_w, max_w = self.get_power_limit_constraints_w()
        if isinstance(power_limit_w, bool) or not isinstance(power_limit_w, int):
            raise GPUValueError(
                f"GPU {self.index}: power limit must be an integer number of watts, "
                f"got {power_limit_w!r}."
            )
        if not min_w <= power_limit_w <= max_w:
            raise GPUValueError(
                f"GPU {self.index}: power limit {power_limit_w} W is outside the supported "
                f"range [{min_w}, {max_w}] W."
            )
        self._call("nvmlDeviceSetPowerManagementLimit", power_limit_w * 1000)

    def reset_power_limit(self) -> None:
        """Restore the default power limit. Needs CAP_SYS_ADMIN or root."""
        self._call("nvmlDeviceSetPowerManagementLimit", self._default_power_limit_mw())

    # Clocks.
    def lock_sm_clocks_mhz(self, min_clock_mhz: int, max_clock_mhz: int) -> None:
        """Lock the SM clock into [min, max]. Units: MHz. Needs CAP_SYS_ADMIN or root.

        Args:
            min_clock_mhz: Lowest SM clock; must be a supported graphics clock.
            max_clock_mhz: Highest SM clock; a supported graphics clock >= `min_clock_mhz`.

        Raises:
            GPUValueError: If a clock is not supported or min > max (checked before NVML).
            GPUPermissionError: If the process lacks CAP_SYS_ADMIN.
        """
        supported = self.get_supported_graphics_clocks_mhz()
        bad = [c for c in (min_clock_mhz, max_clock_mhz) if c not in supported]
        if bad:
            span = f"[{min(supported)}, {max(supported)}]" if supported else "[]"
            raise GPUValueError(
                f"GPU {self.index}: SM clock(s) {bad} MHz not supported; pick from the "
                f"{len(supported)} supported clocks in {span} MHz "
                "(see get_supported_graphics_clocks_mhz())."
            )
        if min_clock_mhz > max_clock_mhz:
            raise GPUValueError(
                f"GPU {self.index}: min clock {min_clock_mhz} MHz is above max clock "
                f"{max_clock_mhz} MHz."
            )
        self._call("nvmlDeviceSetGpuLockedClocks", min_clock_mhz, max_clock_mhz)

    def reset_sm_clocks(self) -> None:
        """Undo `lock_sm_clocks_mhz`. Needs CAP_SYS_ADMIN or root."""
        self._call("nvmlDeviceResetGpuLockedClocks")

    def get_sm_clock_mhz(self) -> int:
        """Return the current SM clock. Units: MHz."""
        return int(self._call("nvmlDeviceGetClockInfo", _NVML_CLOCK_SM))

    def get_memory_clock_mhz(self) -> int:
        """Return the current memory clock. Units: MHz."""
        return int(self._call("nvmlDeviceGetClockInfo", _NVML_CLOCK_MEM))

    # Energy and power.
    def get_total_energy_j(self) -> float:
        """Return the energy counter. Units: J.

        Volta and newer: NVML's counter (mJ since driver load) in J. Older GPUs: the energy
        integrated from power polls so far (see the class docstring; this call adds a poll).
        """
        if self.supports_energy_counter():
            return int(self._call("nvmlDeviceGetTotalEnergyConsumption")) / 1000.0
        self.get_power_w()
        with self._integrator_lock:
            return self._integrator.energy_j

    def get_power_w(self) -> float:
        """Return the power draw NVML reports (a ~1 s average on Ampere and newer). Units: W.

        On GPUs without an energy counter the sample also feeds the energy emulation.
        """
        power_w = int(self._call("nvmlDeviceGetPowerUsage")) / 1000.0
        if not self.supports_energy_counter():
            with self._integrator_lock:
                self._integrator.add(self._clock_ns(), power_w)
        return power_w

    def get_instant_power_w(self) -> float:
        """Return the instantaneous power draw. Units: W.

        Reads the `NVML_FI_DEV_POWER_INSTANT` field; when the driver or GPU does not provide it,
        falls back to `get_power_w` (and stops asking for the field).
        """
        if self._instant_power_supported:
            try:
                values = self._call("nvmlDeviceGetFieldValues", [_NVML_FI_DEV_POWER_INSTANT])
            except (GPUNotSupportedError, GPUValueError):
                self._instant_power_supported = False
            else:
                field = values[0]
                if int(field.nvmlReturn) == _NVML_SUCCESS:
                    return int(field.value.uiVal) / 1000.0
                if int(field.nvmlReturn) in (
                    _NVML_ERROR_NOT_SUPPORTED,
                    _NVML_ERROR_INVALID_ARGUMENT,
                    _NVML_ERROR_FUNCTION_NOT_FOUND,
                ):
                    self._instant_power_supported = False
        return self.get_power_w()

    # Persistence mode.
    def get_persistence_mode(self) -> bool:
        """Return whether persistence mode is on."""
        return int(self._call("nvmlDeviceGetPersistenceMode")) == _NVML_FEATURE_ENABLED

    def set_persistence_mode(self, enabled: bool) -> None:
        """Turn persistence mode on or off. Needs root."""
        mode = _NVML_FEATURE_ENABLED if enabled else _NVML_FEATURE_DISABLED
        self._call("nvmlDeviceSetPersistenceMode", mode)


def nvml_gpus(indices: Sequence[int] | None = None, nvml: Any = None) -> list[NVMLGPU]:
    """Initialise NVML once and return one `NVMLGPU` per GPU.

    Args:
        indices: NVML indices to use, in this order (e.g. parsed from `CUDA_VISIBLE_DEVICES`,
            which must then hold indices, not UUIDs); None means every GPU NVML sees.
        nvml: The pynvml module to use; None imports `pynvml`. Tests pass a fake.

    Returns:
        The GPUs, in the order of `indices` (or 0..count-1).

    Raises:
        GPUValueError: If an index is out of range or listed twice.
        GPUUnavailableError: If NVML cannot be loaded or initialised.
        GPUError: For any other NVML failure.
    """
    nvml = nvml if nvml is not None else _load_pynvml()
    with _nvml_errors(nvml, "nvmlInit", None):
        nvml.nvmlInit()
    with _nvml_errors(nvml, "nvmlDeviceGetCount", None):
        count = int(nvml.nvmlDeviceGetCount())
    if indices is None:
        indices = range(count)
    else:
        missing = [i for i in indices if not 0 <= i < count]
        if missing:
            raise GPUValueError(
                f"GPU index(es) {missing} do not exist: NVML sees {count} GPU(s), "
                f"indices 0..{count - 1}. Check CUDA_VISIBLE_DEVICES / the configured indices."
            )
        if len(set(indices)) != len(indices):
            raise GPUValueError(f"GPU indices {list(indices)} list a GPU more than once.")
    return [NVMLGPU(i, nvml, init=False) for i in indices]


def _as_str(value: str | bytes) -> str:
    """Decode NVML strings (older pynvml versions return bytes)."""
    return value.decode() if isinstance(value, bytes) else value
