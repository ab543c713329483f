"""A fake `pynvml` for testing the NVML backend without a GPU.

* `NVMLError`: like pynvml's, carries the NVML return code in `.value`.
* `FakeDevice`: per-device state (limits in mW, clocks in MHz, energy in mJ, ...), with the
  presets `a40()` (Ampere, energy counter, instant power) and `p100()` (Pascal, neither).
* `FakeNVML`: the module stand-in. Same function names and constants (values copied from
  nvidia-ml-py; `tests/core/test_nvml_backend.py` checks them against the installed `pynvml`).
  It checks arguments the way the driver does, records every call in `calls`, and
  `inject_error(function, code)` makes a function raise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_MEMORY = 20
NVML_ERROR_NO_DATA = 21
NVML_ERROR_FREQ_NOT_SUPPORTED = 24
NVML_ERROR_NOT_READY = 27
NVML_ERROR_GPU_NOT_FOUND = 28
NVML_ERROR_UNKNOWN = 999

NVML_CLOCK_GRAPHICS = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_CLOCK_VIDEO = 3

NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1

NVML_FI_DEV_POWER_AVERAGE = 185
NVML_FI_DEV_POWER_INSTANT = 186

NVML_VALUE_TYPE_UNSIGNED_INT = 1

NVML_DEVICE_ARCH_KEPLER = 2
NVML_DEVICE_ARCH_MAXWELL = 3
NVML_DEVICE_ARCH_PASCAL = 4
NVML_DEVICE_ARCH_VOLTA = 5
NVML_DEVICE_ARCH_TURING = 6
NVML_DEVICE_ARCH_AMPERE = 7
NVML_DEVICE_ARCH_ADA = 8
NVML_DEVICE_ARCH_HOPPER = 9
NVML_DEVICE_ARCH_BLACKWELL = 10
NVML_DEVICE_ARCH_UNKNOWN = 0xFFFFFFFF

CONSTANT_NAMES = sorted(name for name in list(globals()) if name.startswith("NVML_"))


class NVMLError(Exception):
    """An NVML failure; `.value` is the NVML return code, as in pynvml."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return f"fake NVML error {self.value}"


@dataclass
class FakeDevice:
    """State of one fake GPU. Units as NVML reports them: mW, mJ, MHz."""

    name: str
    uuid: str
    architecture: int
    min_limit_mw: int
    max_limit_mw: int
    default_limit_mw: int
    memory_clocks_mhz: list[int]
    graphics_clocks_mhz: dict[int, list[int]]
    power_mw: int = 100_000
    instant_power_mw: int | None = None
    energy_mj: int | None = None
    sm_clock_mhz: int = 1_000
    memory_clock_mhz: int = 0
    persistence: int = NVML_FEATURE_DISABLED
    limit_mw: int = 0
    locked_clocks_mhz: tuple[int, int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.limit_mw:
            self.limit_mw = self.default_limit_mw
        if not self.memory_clock_mhz and self.memory_clocks_mhz:
            self.memory_clock_mhz = max(self.memory_clocks_mhz)


A40_GRAPHICS_CLOCKS_MHZ = list(range(1740, 209, -15))  # 1740, 1725, ..., 210


def a40(index: int = 0) -> FakeDevice:
    """An NVIDIA A40: Ampere, 100-300 W, energy counter and instant power."""
    return FakeDevice(
        name="NVIDIA A40",
        uuid=f"GPU-a40a40a4-0000-0000-0000-00000000000{index}",
        architecture=NVML_DEVICE_ARCH_AMPERE,
        min_limit_mw=100_000,
        max_limit_mw=300_000,
        default_limit_mw=300_000,
        memory_clocks_mhz=[405, 7251],  # NVML does not promise an order.
        graphics_clocks_mhz={
            7251: list(A40_GRAPHICS_CLOCKS_MHZ),
            405: [420, 405, 390, 375, 360, 345, 330, 315, 300, 285, 270, 255, 240, 225, 210],
        },
        power_mw=250_500,
        instant_power_mw=263_250,
        energy_mj=123_456_789,
        sm_clock_mhz=1_740,
    )


def p100(index: int = 0) -> FakeDevice:
    """A Tesla P100: Pascal, 125.5-250 W, no energy counter, no instant-power field."""
    return FakeDevice(
        name="Tesla P100-PCIE-16GB",
        uuid=f"GPU-p100p100-0000-0000-0000-00000000000{index}",
        architecture=NVML_DEVICE_ARCH_PASCAL,
        min_limit_mw=125_500,
        max_limit_mw=250_000,
        default_limit_mw=250_000,
        memory_clocks_mhz=[715],
        graphics_clocks_mhz={715: [1328, 1303, 1278, 1253, 1227, 544]},
        power_mw=30_000,
        sm_clock_mhz=1_328,
    )


class FakeNVML:
    """A stand-in for the `pynvml` module over a list of `FakeDevice`s.

    Handles are the `FakeDevice` objects themselves. Before `nvmlInit` (and after the matching
    `nvmlShutdown`) every device call raises `NVML_ERROR_UNINITIALIZED`, as NVML does.

    Attributes:
        devices: The GPUs, by index.
        calls: Every call made, as (function name, args without the handle, device index or
            None).
        init_count: Current NVML initialisation count.
        errors: Injected errors: function name -> (code, device index or None for all, remaining
            count or None for forever).
    """

    NVMLError = NVMLError

    def __init__(self, devices: list[FakeDevice] | None = None) -> None:
        self.devices = devices if devices is not None else [a40(0), p100(1)]
        self.calls: list[tuple[str, tuple[Any, ...], int | None]] = []
        self.init_count = 0
        self.errors: dict[str, tuple[int, int | None, int | None]] = {}
        for name in CONSTANT_NAMES:
            setattr(self, name, globals()[name])

    # Test controls.
    def inject_error(
        self, function: str, code: int, index: int | None = None, times: int | None = None
    ) -> None:
        """Make `function` raise `NVMLError(code)` (for device `index`, `times` times)."""
        if not function.startswith("nvml") or not hasattr(self, function):
            raise AttributeError(f"FakeNVML has no function {function!r}")
        self.errors[function] = (code, index, times)

    def clear_errors(self) -> None:
        """Remove every injected error."""
        self.errors.clear()

    def called(self, function: str) -> list[tuple[Any, ...]]:
        """Return the arguments (after the handle) of every call to `function`."""
        return [args for name, args, _ in self.calls if name == function]

    def _enter(self, function: str, handle: FakeDevice | None, *args: Any) -> None:
        index = None
        if handle is not None:
            index = next(i for i, device in enumerate(self.devices) if device is handle)
        self.calls.append((function, args, index))
        if function in self.errors:
            code, only_index, times = self.errors[function]
            if only_index is None or only_index == index:
                if times is not None:
                    if times <= 1:
                        del self.errors[function]
                    else:
                        self.errors[function] = (code, only_index, times - 1)
                raise NVMLError(code)
        if function != "nvmlInit" and self.init_count <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)

    # Library.
    def nvmlInit(self) -> None:  # noqa: N802
        self._enter("nvmlInit", None)
        self.init_count += 1

    def nvmlShutdown(self) -> None:  # noqa: N802
        self._enter("nvmlShutdown", None)
        self.init_count -= 1

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        self._enter("nvmlDeviceGetCount", None)
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDevice:  # noqa: N802
        self._enter("nvmlDeviceGetHandleByIndex", None, index)
        if not 0 <= index < len(self.devices):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self.devices[index]

    # Identity.
    def nvmlDeviceGetName(self, handle: FakeDevice) -> str:  # noqa: N802
        self._enter("nvmlDeviceGetName", handle)
        return handle.name

    def nvmlDeviceGetUUID(self, handle: FakeDevice) -> str:  # noqa: N802
        self._enter("nvmlDeviceGetUUID", handle)
        return handle.uuid

    def nvmlDeviceGetArchitecture(self, handle: FakeDevice) -> int:  # noqa: N802
        self._enter("nvmlDeviceGetArchitecture", handle)
        return handle.architecture

    # Power limit.
    def nvmlDeviceGetPowerManagementLimitConstraints(  # noqa: N802
        self, handle: FakeDevice
    ) -> list[int]:
        self._enter("nvmlDeviceGetPowerManagementLimitConstraints", handle)
        return [handle.min_limit_mw, handle.max_limit_mw]

    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle: FakeDevice) -> int:  # noqa: N802
        self._enter("nvmlDeviceGetPowerManagementDefaultLimit", handle)
        return handle.default_limit_mw

    def nvmlDeviceGetPowerManagementLimit(self, handle: FakeDevice) -> int:  # noqa: N802
        self._enter("nvmlDeviceGetPowerManagementLimit", handle)
        return handle.limit_mw

    def nvmlDeviceSetPowerManagementLimit(self, handle: FakeDevice, limit_mw: int) -> None:  # noqa: N802
        self._enter("nvmlDeviceSetPowerManagementLimit", handle, limit_mw)
        if not handle.min_limit_mw <= limit_mw <= handle.max_limit_mw:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        handle.limit_mw = limit_mw

    # Clocks.
    def nvmlDeviceGetSupportedMemoryClocks(self, handle: FakeDevice) -> list[int]:  # noqa: N802
        self._enter("nvmlDeviceGetSupportedMemoryClocks", handle)
        return list(handle.memory_clocks_mhz)

    def nvmlDeviceGetSupportedGraphicsClocks(  # noqa: N802
        self, handle: FakeDevice, memory_clock_mhz: int
    ) -> list[int]:
        self._enter("nvmlDeviceGetSupportedGraphicsClocks", handle, memory_clock_mhz)
        if memory_clock_mhz not in handle.graphics_clocks_mhz:
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return list(handle.graphics_clocks_mhz[memory_clock_mhz])

    def nvmlDeviceSetGpuLockedClocks(  # noqa: N802
        self, handle: FakeDevice, min_mhz: int, max_mhz: int
    ) -> None:
        self._enter("nvmlDeviceSetGpuLockedClocks", handle, min_mhz, max_mhz)
        if min_mhz > max_mhz:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        handle.locked_clocks_mhz = (min_mhz, max_mhz)
        handle.sm_clock_mhz = max_mhz

    def nvmlDeviceResetGpuLockedClocks(self, handle: FakeDevice) -> None:  # noqa: N802
        self._enter("nvmlDeviceResetGpuLockedClocks", handle)
        handle.locked_clocks_mhz = None

    def nvmlDeviceGetClockInfo(self, handle: FakeDevice, clock_type: int) -> int:  # noqa: N802
        self._enter("nvmlDeviceGetClockInfo", handle, clock_type)
        if clock_type == NVML_CLOCK_SM:
            return handle.sm_clock_mhz
        if clock_type == NVML_CLOCK_MEM:
            return handle.memory_clock_mhz
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)

    # Energy and power.
    def nvmlDeviceGetTotalEnergyConsumption(self, handle: FakeDevice) -> int:  # noqa: N802
        self._enter("nvmlDeviceGetTotalEnergyConsumption", handle)
        if handle.energy_mj is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return handle.energy_mj

    def nvmlDeviceGetPowerUsage(self, handle: FakeDevice) -> int:  # noqa: N802
        self._enter("nvmlDeviceGetPowerUsage", handle)
        return handle.power_mw

    def nvmlDeviceGetFieldValues(  # noqa: N802
        self, handle: FakeDevice, field_ids: list[int]
    ) -> list[SimpleNamespace]:
        """Mimic `c_nvmlFieldValue_t`: per-field `nvmlReturn`, the value in `value.uiVal`."""
        self._enter("nvmlDeviceGetFieldValues", handle, list(field_ids))
        values = []
        for field_id in field_ids:
            if field_id == NVML_FI_DEV_POWER_INSTANT and handle.instant_power_mw is not None:
                ret, value = NVML_SUCCESS, handle.instant_power_mw
            else:
                ret, value = NVML_ERROR_NOT_SUPPORTED, 0
            values.append(
                SimpleNamespace(
                    fieldId=field_id,
                    scopeId=0,
                    timestamp=0,
                    latencyUsec=0,
                    valueType=NVML_VALUE_TYPE_UNSIGNED_INT,
                    nvmlReturn=ret,
                    value=SimpleNamespace(uiVal=value),
                )
            )
        return values

    # Persistence mode.
    def nvmlDeviceGetPersistenceMode(self, handle: FakeDevice) -> int:  # noqa: N802
        self._enter("nvmlDeviceGetPersistenceMode", handle)
        return handle.persistence

    def nvmlDeviceSetPersistenceMode(self, handle: FakeDevice, mode: int) -> None:  # noqa: N802
        self._enter("nvmlDeviceSetPersistenceMode", handle, mode)
        if mode not in (NVML_FEATURE_DISABLED, NVML_FEATURE_ENABLED):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        handle.persistence = mode
