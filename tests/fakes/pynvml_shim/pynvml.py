"""A `pynvml` module for subprocesses, over `tests.fakes.fake_pynvml`.

Tests of `bench/real_gpu.py` put this directory first on `PYTHONPATH` (the repository root
after it), so the script and the agent it starts both import this as `pynvml`. The environment
selects what it plays:

* `FAKE_PYNVML=missing`: importing it fails, as without `nvidia-ml-py`;
* `FAKE_PYNVML=init_fails`: `nvmlInit` raises `NVML_ERROR_DRIVER_NOT_LOADED`;
* `FAKE_PYNVML=no_gpu`: NVML starts and sees 0 GPUs;
* `FAKE_PYNVML=a40` (default): one A40 whose energy counter advances every 100 ms at 250 W on
  the monotonic clock's 100 ms grid (so every process reads the same counter), with the getters
  the script reads besides the agent's (driver and NVML versions, temperature, utilisation,
  enforced limit; application clocks are not supported);
* `FAKE_PYNVML=p100`: one P100 (Pascal: no energy counter);
* `FAKE_PYNVML_LIMIT_DRIFT=N`: from the N-th power-limit read of a process on, the limit reads
  50 W lower (a setting that changed during the run).
* `FAKE_PYNVML_CONTEXT_CLOCKS_AT=N`: the first N-1 SM clock reads of a process give the idle
  clock (210 MHz), the later ones the device's (1,740 MHz), as when a CUDA context made in
  between holds an idle GPU's clocks up.
* `FAKE_PYNVML_SETTER_IN_AGENT=1`: the agent's process (`zeus_agent/cli.py`) calls
  `nvmlDeviceSetPersistenceMode` through whatever `pynvml` it imported, once, at `nvmlInit`
  (a stand-in for code that should not; a guard first on `PYTHONPATH` refuses and logs it).

As in nvidia-ml-py: `nvmlDeviceGetMigMode` raises `NOT_SUPPORTED` (neither preset has MIG),
`nvmlDeviceGetHandleByUUID` takes the full UUID, `nvmlDeviceGetIndex` gives a handle's index.

Calls are not recorded (`FakeNVML.calls` stays empty): the script reads the counter back to back.
The functions and `NVML_*` constants are module attributes, as in pynvml.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from types import SimpleNamespace
from typing import Any

from tests.fakes import fake_pynvml as _f

_MODE = os.environ.get("FAKE_PYNVML", "a40")
if _MODE == "missing":
    raise ImportError("fake pynvml: no NVML bindings here (FAKE_PYNVML=missing)")

NVMLError = _f.NVMLError
NVML_TEMPERATURE_GPU = 0
POWER_W = 250
UPDATE_NS = 100_000_000


class _ShimNVML(_f.FakeNVML):
    def __init__(self, devices: list[_f.FakeDevice]) -> None:
        super().__init__(devices)
        self.limit_reads = 0
        self.drift_after = int(os.environ.get("FAKE_PYNVML_LIMIT_DRIFT", "0") or 0)
        self.sm_reads = 0
        self.context_at = int(os.environ.get("FAKE_PYNVML_CONTEXT_CLOCKS_AT", "0") or 0)
        self.setter_in_agent = os.environ.get("FAKE_PYNVML_SETTER_IN_AGENT") == "1"

    def _enter(self, function: str, handle: Any, *args: Any) -> None:
        super()._enter(function, handle, *args)
        self.calls.clear()

    def nvmlInit(self) -> None:  # noqa: N802
        if _MODE == "init_fails":
            raise NVMLError(_f.NVML_ERROR_DRIVER_NOT_LOADED)
        super().nvmlInit()
        if self.setter_in_agent and sys.argv[0].endswith(os.path.join("zeus_agent", "cli.py")):
            self.setter_in_agent = False
            with contextlib.suppress(Exception):  # a guard refuses it
                sys.modules["pynvml"].nvmlDeviceSetPersistenceMode(self.devices[0], 1)

    def nvmlDeviceGetClockInfo(self, handle: Any, clock_type: int) -> int:  # noqa: N802
        clock = int(super().nvmlDeviceGetClockInfo(handle, clock_type))
        if clock_type == _f.NVML_CLOCK_SM and self.context_at:
            self.sm_reads += 1
            if self.sm_reads < self.context_at:
                return 210
        return clock

    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:  # noqa: N802
        self._enter("nvmlDeviceGetMigMode", handle)
        raise NVMLError(_f.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> Any:  # noqa: N802
        self._enter("nvmlDeviceGetHandleByUUID", None, uuid)
        wanted = uuid.decode() if isinstance(uuid, bytes) else uuid
        for device in self.devices:
            if device.uuid == wanted:
                return device
        raise NVMLError(_f.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetIndex(self, handle: Any) -> int:  # noqa: N802
        self._enter("nvmlDeviceGetIndex", handle)
        return self.devices.index(handle)

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:  # noqa: N802
        self._enter("nvmlDeviceGetTotalEnergyConsumption", handle)
        if handle.energy_mj is None:
            raise NVMLError(_f.NVML_ERROR_NOT_SUPPORTED)
        updates = time.monotonic_ns() // UPDATE_NS
        return int(handle.energy_mj + updates * POWER_W * UPDATE_NS // 1_000_000)

    def nvmlDeviceGetPowerManagementLimit(self, handle: Any) -> int:  # noqa: N802
        limit = int(super().nvmlDeviceGetPowerManagementLimit(handle))
        self.limit_reads += 1
        if self.drift_after and self.limit_reads >= self.drift_after:
            return limit - 50_000
        return limit

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:  # noqa: N802
        self._enter("nvmlDeviceGetEnforcedPowerLimit", handle)
        return int(handle.limit_mw)

    def nvmlDeviceGetApplicationsClock(self, handle: Any, clock_type: int) -> int:  # noqa: N802
        self._enter("nvmlDeviceGetApplicationsClock", handle, clock_type)
        raise NVMLError(_f.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetMaxClockInfo(self, handle: Any, clock_type: int) -> int:  # noqa: N802
        self._enter("nvmlDeviceGetMaxClockInfo", handle, clock_type)
        if clock_type == _f.NVML_CLOCK_MEM:
            return max(handle.memory_clocks_mhz)
        return max(handle.graphics_clocks_mhz[max(handle.memory_clocks_mhz)])

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:  # noqa: N802
        self._enter("nvmlDeviceGetTemperature", handle, sensor)
        return 41

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> SimpleNamespace:  # noqa: N802
        self._enter("nvmlDeviceGetUtilizationRates", handle)
        return SimpleNamespace(gpu=0, memory=0)

    def nvmlDeviceGetComputeMode(self, handle: Any) -> int:  # noqa: N802
        self._enter("nvmlDeviceGetComputeMode", handle)
        return 0

    def nvmlSystemGetDriverVersion(self) -> str:  # noqa: N802
        self._enter("nvmlSystemGetDriverVersion", None)
        return "0.0.fake"

    def nvmlSystemGetNVMLVersion(self) -> str:  # noqa: N802
        self._enter("nvmlSystemGetNVMLVersion", None)
        return "0.fake"

    def nvmlSystemGetCudaDriverVersion(self) -> int:  # noqa: N802
        self._enter("nvmlSystemGetCudaDriverVersion", None)
        return 13000


_fake = _ShimNVML({"no_gpu": [], "p100": [_f.p100(0)]}.get(_MODE, [_f.a40(0)]))
# Module-level names, as pynvml has them (a wrapper that copies a module's names sees them).
globals().update({name: getattr(_fake, name) for name in dir(_fake)
                  if name.startswith(("nvml", "NVML_")) and name not in globals()})
