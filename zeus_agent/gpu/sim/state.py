"""The simulated GPU's device file: `DeviceState`, its JSON form and its energy counter.

`zeus_agent.gpu.sim.device.SimGPU` reads and rewrites this state under a file lock; the state
itself is pure (no clock, no files): every method takes the time it is asked about.

The counter as read is a staircase: it shows the exact energy at the last update instant. By
default the instants are the grid ``floor(now / period) * period`` of the device's clock; a
device created with a timing model whose counter jitters (`zeus_agent.gpu.sim.timing`, preset
"h200") names it in `counter_jitter`, and its instants then follow that model (per-device
phase, per-update offset), the same in every process that opens the file.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Any

from zeus_agent.errors import GPUUnavailableError
from zeus_agent.gpu.sim.physics import HardwareParams
from zeus_agent.gpu.sim.timing import counter_jitter

__all__ = ["STATE_VERSION", "DeviceState"]

STATE_VERSION = 2
"""Version of the device file's layout (2: the coarse energy counter; 1 is still read)."""

_NS = 1_000_000_000


@dataclass(slots=True)
class DeviceState:
    """Contents of one device file (mutable working copy).

    `counter_jitter` names the counter's update model ("": the exact grid; "h200": the
    recorded jitter, see `zeus_agent.gpu.sim.timing.counter_jitter`); files written before it
    existed read as "".
    """

    index: int
    uuid: str
    hardware: HardwareParams
    has_energy_counter: bool
    seed: int | None
    energy_factor: float
    power_limit_w: int
    locked_min_mhz: int | None
    locked_max_mhz: int | None
    persistence_mode: bool
    energy_j: float
    updated_ns: int
    busy_until_ns: int
    busy_power_w: float
    busy_clock_mhz: int
    work_count: int
    energy_update_ns: int
    counter_ns: int
    counter_j: float
    counter_jitter: str = ""

    def to_json(self) -> dict[str, Any]:
        """Return the JSON-ready form."""
        data = {name: getattr(self, name) for name in _STATE_FIELDS}
        data["hardware"] = _hardware_json(self.hardware)
        data["version"] = STATE_VERSION
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any], hardware: HardwareParams | None = None) -> DeviceState:
        """Rebuild from the JSON form (`hardware`: the already known model, to skip parsing it)."""
        if data.get("version") == 1:  # before the coarse counter: a continuous one
            data = {
                **data,
                "energy_update_ns": 0,
                "counter_ns": data["updated_ns"],
                "counter_j": data["energy_j"],
            }
        elif data.get("version") != STATE_VERSION:
            raise GPUUnavailableError(
                f"simulated GPU state has version {data.get('version')!r}, expected "
                f"{STATE_VERSION}; recreate it with SimGPU.create"
            )
        values = {k: v for k, v in data.items() if k in _STATE_FIELDS}
        values["hardware"] = hardware or _hardware_from_json(data["hardware"])
        try:
            counter_jitter(values.get("counter_jitter", ""))
        except ValueError as e:
            raise GPUUnavailableError(f"simulated GPU state: {e}; recreate it") from None
        return cls(**values)

    def energy_at(self, now_ns: int) -> float:
        """Return the energy counter at `now_ns` (J), without changing the state."""
        elapsed = now_ns - self.updated_ns
        if elapsed <= 0:
            return self.energy_j
        busy = max(0, min(now_ns, self.busy_until_ns) - self.updated_ns)
        idle = elapsed - busy
        idle_w = self.hardware.idle_power_w * self.energy_factor
        return self.energy_j + (self.busy_power_w * busy + idle_w * idle) / _NS

    def update_instant(self, now_ns: int) -> int:
        """Return the counter's last update instant at or before `now_ns` (ns)."""
        period = self.energy_update_ns
        if period <= 0:
            return now_ns
        jitter = counter_jitter(self.counter_jitter) if self.counter_jitter else None
        if jitter is None:
            return now_ns - now_ns % period
        return jitter.last_update_ns(self.uuid, now_ns, period)

    def counter_at(self, now_ns: int) -> float:
        """Return the energy counter as read at `now_ns` (J).

        The exact energy at the last update instant (`update_instant`), or at `now_ns` for a
        continuous counter.
        """
        instant = self.update_instant(now_ns)
        if instant > self.updated_ns:
            return self.energy_at(instant)
        if instant == self.updated_ns:
            return self.energy_j
        # The instant precedes the last fold: it is the one the fold recorded (or, for a read
        # from a clock behind the file's, an earlier one; the recorded value never goes back).
        return self.counter_j

    def fold(self, now_ns: int) -> None:
        """Accrue energy up to `now_ns`, record the last counter update, drop finished work."""
        if now_ns > self.updated_ns:
            instant = self.update_instant(now_ns)
            if instant > self.counter_ns:
                self.counter_j = self.energy_at(instant)
                self.counter_ns = instant
            self.energy_j = self.energy_at(now_ns)
            self.updated_ns = now_ns
        if self.busy_until_ns <= self.updated_ns:
            self.busy_until_ns = 0
            self.busy_power_w = 0.0


_STATE_FIELDS = tuple(f.name for f in dataclasses.fields(DeviceState))


@functools.lru_cache(maxsize=32)
def _hardware_json(hw: HardwareParams) -> dict[str, Any]:
    """The JSON form of a hardware model, computed once (it never changes; setters are hot)."""
    return dataclasses.asdict(hw)


def _hardware_from_json(data: dict[str, Any]) -> HardwareParams:
    """Rebuild a hardware model, reusing the previous one when the file holds the same."""
    key = json.dumps(data)
    cached = _HARDWARE_BY_JSON.get(key)
    if cached is None:
        hw = dict(data)
        hw["supported_sm_clocks_mhz"] = tuple(hw["supported_sm_clocks_mhz"])
        hw["supported_memory_clocks_mhz"] = tuple(hw["supported_memory_clocks_mhz"])
        cached = _HARDWARE_BY_JSON[key] = HardwareParams(**hw)
    return cached


_HARDWARE_BY_JSON: dict[str, HardwareParams] = {}


