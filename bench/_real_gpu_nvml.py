"""The GPU under test for `bench/real_gpu.py`, through NVML getters only (no setter anywhere).

Its facts, the cost of each getter the agent calls, the energy counter's update period, and the
end's check that the settings and clocks are as they were: the parts of the check that need
neither torch nor the agent, so `--no-train` and a GPU without a counter run only these.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from zeus_demo.cluster import wait_for

SETTLE_S = 10.0
"""How long the current clocks get to come back to their values before the run."""

# NVML constants (nvml.h), used when a pynvml lacks the name.
_CLOCK_SM, _CLOCK_MEM, _TEMPERATURE_GPU, _FI_POWER_INSTANT = 1, 2, 0, 186


def quantile(values: Sequence[float], q: float) -> float:
    """The `q` quantile of `values` (nearest rank); NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def spread(values: Sequence[float]) -> dict[str, Any]:
    """n, p50, p90 and max."""
    return {"n": len(values), "p50": quantile(values, 0.5), "p90": quantile(values, 0.9),
            "max": max(values) if values else None}


def text(value: Any) -> str | None:
    """NVML strings (older pynvml versions return bytes); None stays None."""
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)



# ---------------------------------------------------------------------------------- NVML
class Nvml:
    """The GPU under test through pynvml getters only (this class has no setter)."""

    def __init__(self, nvml: Any, index: int) -> None:
        self.nvml = nvml
        self.index = index
        self.handle = nvml.nvmlDeviceGetHandleByIndex(index)
        self.clock_sm = getattr(nvml, "NVML_CLOCK_SM", _CLOCK_SM)
        self.clock_mem = getattr(nvml, "NVML_CLOCK_MEM", _CLOCK_MEM)

    def get(self, function: str, *args: Any, device: bool = True) -> Any:
        """`nvml.<function>([handle,] *args)`, or None when NVML lacks or refuses it."""
        fn = getattr(self.nvml, function, None)
        if fn is None:
            return None
        try:
            return fn(self.handle, *args) if device else fn(*args)
        except Exception:  # noqa: BLE001 - NOT_SUPPORTED and the like: the fact is unknown
            return None

    def energy_j(self) -> float:
        """The energy counter (J)."""
        return int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)) / 1000.0

    def settings(self) -> dict[str, Any]:
        """What this run must leave as it found it (None: not readable on this GPU)."""
        return {
            "power_limit_mw": self.get("nvmlDeviceGetPowerManagementLimit"),
            "enforced_power_limit_mw": self.get("nvmlDeviceGetEnforcedPowerLimit"),
            "app_sm_clock_mhz": self.get("nvmlDeviceGetApplicationsClock", self.clock_sm),
            "app_mem_clock_mhz": self.get("nvmlDeviceGetApplicationsClock", self.clock_mem),
            "persistence_mode": self.get("nvmlDeviceGetPersistenceMode"),
            "compute_mode": self.get("nvmlDeviceGetComputeMode"),
        }

    def clocks(self) -> dict[str, Any]:
        """The current SM and memory clocks (MHz): they follow the load."""
        return {"sm_clock_mhz": self.get("nvmlDeviceGetClockInfo", self.clock_sm),
                "mem_clock_mhz": self.get("nvmlDeviceGetClockInfo", self.clock_mem)}

    def facts(self, count: int) -> dict[str, Any]:
        """Name, versions, power limits and clocks."""
        g = self.get
        rng = g("nvmlDeviceGetPowerManagementLimitConstraints")

        def watts(mw: Any) -> float | None:
            return None if mw is None else int(mw) / 1000

        facts: dict[str, Any] = {
            "index": self.index,
            "gpus_seen": count,
            "name": text(g("nvmlDeviceGetName")),
            "uuid": text(g("nvmlDeviceGetUUID")),
            "driver": text(g("nvmlSystemGetDriverVersion", device=False)),
            "nvml_version": text(g("nvmlSystemGetNVMLVersion", device=False)),
            "cuda_driver_version": g("nvmlSystemGetCudaDriverVersion", device=False),
            "power_limit_w": watts(g("nvmlDeviceGetPowerManagementLimit")),
            "default_power_limit_w": watts(g("nvmlDeviceGetPowerManagementDefaultLimit")),
            "enforced_power_limit_w": watts(g("nvmlDeviceGetEnforcedPowerLimit")),
            "power_limit_range_w": None if rng is None else [watts(rng[0]), watts(rng[1])],
            **self.clocks(),
            "max_sm_clock_mhz": g("nvmlDeviceGetMaxClockInfo", self.clock_sm),
            "max_mem_clock_mhz": g("nvmlDeviceGetMaxClockInfo", self.clock_mem),
            "app_sm_clock_mhz": g("nvmlDeviceGetApplicationsClock", self.clock_sm),
            "app_mem_clock_mhz": g("nvmlDeviceGetApplicationsClock", self.clock_mem),
            "persistence_mode": g("nvmlDeviceGetPersistenceMode"),
            # [current, pending]; None: no MIG on this GPU. With MIG on, the counter is the
            # whole GPU's while a training loop runs on one instance.
            "mig_mode": g("nvmlDeviceGetMigMode"),
        }
        try:
            self.energy_j()
            facts["energy_counter"] = True
        except Exception:  # noqa: BLE001 - pre-Volta: no counter
            facts["energy_counter"] = False
        return facts

    def getters(self) -> dict[str, Callable[[], Any]]:
        """The getters the agent calls, by the names of data/real-gpu/h200/nvml_calls.json."""
        n, h = self.nvml, self.handle
        instant = getattr(n, "NVML_FI_DEV_POWER_INSTANT", _FI_POWER_INSTANT)
        temperature = getattr(n, "NVML_TEMPERATURE_GPU", _TEMPERATURE_GPU)
        return {
            "total_energy": lambda: n.nvmlDeviceGetTotalEnergyConsumption(h),
            "power_usage": lambda: n.nvmlDeviceGetPowerUsage(h),
            "power_instant_field": lambda: n.nvmlDeviceGetFieldValues(h, [instant]),
            "power_limit": lambda: n.nvmlDeviceGetPowerManagementLimit(h),
            "sm_clock": lambda: n.nvmlDeviceGetClockInfo(h, self.clock_sm),
            "mem_clock": lambda: n.nvmlDeviceGetClockInfo(h, self.clock_mem),
            "temperature": lambda: n.nvmlDeviceGetTemperature(h, temperature),
            "utilization": lambda: n.nvmlDeviceGetUtilizationRates(h),
        }


def open_nvml(requested: int | None) -> tuple[Any, int | None, int] | str:
    """(pynvml, the GPU's NVML index, GPUs seen), or why there is no GPU to check.

    The index is None when `CUDA_VISIBLE_DEVICES` names a GPU NVML does not know."""
    try:
        import pynvml
    except ImportError as e:
        return f"pynvml is not importable ({e}); install nvidia-ml-py"
    try:
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded...
        return f"nvmlInit failed: {e}"
    try:
        count = int(pynvml.nvmlDeviceGetCount())
    except Exception as e:  # noqa: BLE001
        return f"nvmlDeviceGetCount failed: {e}"
    if count == 0:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
        return "NVML sees 0 GPUs"
    index = requested if requested is not None else default_index(pynvml, count)
    return pynvml, index, count


def default_index(nvml: Any, count: int) -> int | None:
    """The NVML index of the first GPU `CUDA_VISIBLE_DEVICES` names, else 0.

    It may name an index, a GPU UUID (or its prefix, as CUDA accepts) or a MIG instance's UUID
    (then its parent GPU: NVML's energy counter and settings are the whole GPU's). None: it
    names a UUID NVML does not know."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if first.isdigit():
        return int(first)
    if not first.startswith(("GPU-", "MIG-")):
        return 0
    with contextlib.suppress(Exception):  # the full UUID; a MIG instance's is a MIG handle
        handle = nvml.nvmlDeviceGetHandleByUUID(first)
        if first.startswith("MIG-"):
            handle = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
        return int(nvml.nvmlDeviceGetIndex(handle))
    for i in range(count):  # a prefix
        with contextlib.suppress(Exception):
            uuid = text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)))
            if uuid is not None and uuid.startswith(first):
                return i
    return None


# ------------------------------------------------------------------ costs and the counter
def getter_costs(gpu: Nvml, calls: int) -> dict[str, Any]:
    """p50/p90/max (us) of each getter: `calls` calls after 5 warm-up calls, one getter at a
    time."""
    costs: dict[str, Any] = {}
    pc = time.perf_counter_ns
    for name, call in gpu.getters().items():
        try:
            for _ in range(5):
                call()
            samples = []
            for _ in range(calls):
                t0 = pc()
                call()
                samples.append((pc() - t0) / 1000)
        except Exception as e:  # noqa: BLE001 - not supported on this GPU
            costs[name] = {"error": text(e)}
            continue
        costs[name] = spread(samples)
    return costs


def counter_period(gpu: Nvml, seconds: float) -> dict[str, Any]:
    """Read the counter back to back for `seconds`: its update period and the reads' cost."""
    mono = time.monotonic_ns
    end = mono() + int(seconds * 1e9)
    costs: list[float] = []
    instants: list[float] = []
    widths: list[float] = []
    increments: list[float] = []
    reads = changed = 0
    prev_t0 = prev_value = None
    while True:
        t0 = mono()
        value = gpu.energy_j()
        t1 = mono()
        reads += 1
        if len(costs) < 50_000:
            costs.append((t1 - t0) / 1e6)
        if prev_value is not None and value != prev_value:
            changed += 1
            assert prev_t0 is not None
            # The update came after the last read that saw the old value began and before
            # this one ended.
            instants.append((prev_t0 + t1) / 2e6)
            widths.append((t1 - prev_t0) / 1e6)
            increments.append(value - prev_value)
        prev_t0, prev_value = t0, value
        if t1 >= end:
            break
    periods = [b - a for a, b in zip(instants, instants[1:], strict=False)]
    return {
        "seconds": seconds,
        "reads": reads,
        "updates": changed,
        "continuous": reads > 10 and changed >= 0.9 * (reads - 1),
        "period_ms": {"p50": quantile(periods, 0.5), "p5": quantile(periods, 0.05),
                      "p95": quantile(periods, 0.95), "n": len(periods)},
        "bracket_ms_p50": quantile(widths, 0.5),
        "increment_j_p50": quantile(increments, 0.5),
        "read_cost_ms": {"p50": quantile(costs, 0.5), "p90": quantile(costs, 0.9),
                         "p99": quantile(costs, 0.99), "max": max(costs) if costs else None},
    }


def unchanged(gpu: Nvml, before: dict[str, Any], clocks_before: dict[str, Any],
              settle_s: float = SETTLE_S) -> tuple[list[str], dict[str, Any]]:
    """What differs from before the run (the settings at once, the current clocks after up to
    `settle_s` to settle), and the current clocks read last."""
    after = gpu.settings()
    changed = [f"{k}: {before[k]} -> {after[k]}" for k in before if before[k] != after[k]]
    reads: list[dict[str, Any]] = []

    def back() -> bool:
        reads[:] = [gpu.clocks()]
        return reads[0] == clocks_before

    wait_for(back, settle_s, interval_s=0.25, fail=False)  # `changed` names what is not back
    clocks = reads[0]
    changed += [f"{k} (current): {clocks_before[k]} -> {clocks[k]}"
                for k in clocks_before if clocks_before[k] != clocks[k]]
    return changed, clocks


def settled_clocks(gpu: Nvml, limit_s: float = 5.0) -> dict[str, Any]:
    """The current clocks once two reads 0.5 s apart agree (at most `limit_s`)."""
    reads: list[dict[str, Any]] = []

    def two_agree() -> bool:
        reads.append(gpu.clocks())
        return len(reads) > 1 and reads[-1] == reads[-2]

    wait_for(two_agree, limit_s, interval_s=0.5, fail=False)  # else the last read
    return reads[-1]

