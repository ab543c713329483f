"""The simulated GPU device: a `GPU` backend whose state lives in a small shared file.

Pieces:

* `SimGPU`: implements `zeus_agent.gpu.base.GPU`. `SimGPU.create` writes a device file,
  `SimGPU.open` attaches to one; an agent process (setting limits and clocks) and a simulated
  trainer process (running work) that open the same file see one device.
* `SimGPU.run_work`: the trainer-side call: computes the operating point from the current
  power limit and clock locks (`physics.operating_point`), marks the device busy for the step's
  duration from now and returns a `WorkResult` without sleeping.
* `WorkResult`: duration, energy and clock of one piece of work.
* `create_sim_gpus`: create several devices at once.

State file: ``state_dir/gpu{index}.json`` (JSON, rewritten in place), guarded for
read-modify-write by ``fcntl.flock`` on ``state_dir/gpu{index}.lock``, which also holds a
generation number that lets a handle reuse the state it parsed until a write (in any process)
changes it (`zeus_agent.gpu.sim.store`). Time is
``time.monotonic_ns()`` (system-wide on one host), injectable for tests.

The device integrates power over time exactly: idle power when idle, the running work's
average power while busy. Approximation: work already started keeps its duration and average
power when the limit or clocks change mid-work; the state folds the energy up to the change and
the new settings apply from the next `run_work`.

The energy counter as read (`get_total_energy_j`, `read_telemetry`) is coarse, like NVML's: it
advances every `energy_update_ms` (per device; the preset's `HardwareParams.energy_update_ms`,
100 ms, unless `SimGPU.create` is given another; 0 = continuous) and shows the exact energy at
the last update instant ``floor(now / period) * period`` of the device's clock (with timing
"h200": a per-device phase and the recorded per-update jitter, `zeus_agent.gpu.sim.state`). The
state keeps the exact energy at the last update instant at or before its last fold, so the
staircase is deterministic and telescopes: differences over long windows are exact to within
one step.

Call costs (`zeus_agent.gpu.sim.timing`): a handle opened with ``timing="h200"`` charges every
NVML-like call what it cost on a real H200 (a counter read ~3 ms, taking its value at the
call's midpoint; setters `set_latency_ms`) and serialises the counter read, the power-limit
read and setters on a per-GPU lock (`zeus_agent.gpu.sim.driver`); it is then called like NVML
(`calls_block` True). ``timing="none"`` (the default, for fast tests and the trainer's handle)
charges nothing. `run_work`, `is_busy` and `get_locked_sm_clocks_mhz` are the simulation's own
calls and never charge.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import random
import time
import uuid as uuid_mod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from zeus_agent.errors import GPUNotSupportedError, GPUValueError
from zeus_agent.gpu.base import GPU, Telemetry
from zeus_agent.gpu.sim.driver import NO_CALL, SimDriver, driver_lock
from zeus_agent.gpu.sim.physics import HardwareParams, NoiseModel, WorkloadParams, operating_point
from zeus_agent.gpu.sim.presets import PRESETS
from zeus_agent.gpu.sim.state import STATE_VERSION, DeviceState
from zeus_agent.gpu.sim.store import StateFile
from zeus_agent.gpu.sim.timing import CallKind, NvmlTiming, timing_preset

__all__ = ["STATE_VERSION", "SimGPU", "WorkResult", "create_sim_gpus"]

_NS = 1_000_000_000


@dataclass(frozen=True, slots=True)
class WorkResult:
    """What one `SimGPU.run_work` call will do.

    Attributes:
        duration_s: How long the device is busy; the caller sleeps this long (s).
        energy_j: Energy the device accrues over that time (J).
        sm_clock_mhz: SM clock the work runs at (MHz).
        busy_until_ns: When the device is done with this work and what it queued behind (its
            clock's ns; 0: unknown). Not compared: the same work is equal whatever came before.
    """

    duration_s: float
    energy_j: float
    sm_clock_mhz: int
    busy_until_ns: int = field(default=0, compare=False)


def _hardware(preset: str | HardwareParams) -> HardwareParams:
    """`preset`'s hardware: a key of `PRESETS`, or custom hardware as is.

    Raises:
        GPUValueError: An unknown preset name.
    """
    if isinstance(preset, HardwareParams):
        return preset
    try:
        return PRESETS[preset]
    except KeyError:
        raise GPUValueError(
            f"unknown simulated GPU preset {preset!r}; choose one of {sorted(PRESETS)}"
        ) from None


def _energy_update_ns(hw: HardwareParams, energy_update_ms: float | None) -> int:
    """The energy counter's update period (ns): `energy_update_ms`, else the hardware's.

    Raises:
        GPUValueError: A negative (or NaN) period.
    """
    period_ms = hw.energy_update_ms if energy_update_ms is None else energy_update_ms
    if not period_ms >= 0:
        raise GPUValueError(f"energy_update_ms must be >= 0, got {energy_update_ms!r}")
    return round(period_ms * 1_000_000)


def _device_uuid(seed: int | None, index: int) -> str:
    """A GPU UUID: derived from `seed` and `index`, random without a seed."""
    if seed is None:
        return f"GPU-{uuid_mod.uuid4()}"
    rng = random.Random(f"uuid:{seed}:{index}")
    return f"GPU-{uuid_mod.UUID(int=rng.getrandbits(128), version=4)}"


class SimGPU(GPU):
    """A simulated GPU backed by a shared state file.

    Attributes:
        index: Index of the GPU on its (simulated) node.
        calls_block: False without call costs (timing "none"): every call takes microseconds,
            so async callers may call it on the event loop. True with costs: called like NVML,
            through the per-GPU executor.
    """

    calls_block = False

    def __init__(
        self,
        state_dir: str | Path,
        index: int,
        *,
        clock: Callable[[], int] = time.monotonic_ns,
        timing: str | NvmlTiming = "none",
        set_latency_ms: float | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """Attach to an existing device file; prefer `SimGPU.open` or `SimGPU.create`.

        Args:
            state_dir: Directory of the device files.
            index: Index of the GPU.
            clock: Monotonic clock in nanoseconds (injectable for tests).
            timing: What this handle's calls cost: "h200", "none" or a model.
            set_latency_ms: Cost of a setter (ms; default 1 ms under "h200").
            sleep: Sleeps seconds; charged calls wait with it (injectable for tests).

        Raises:
            GPUValueError: For an unknown timing name or a negative setter cost.
        """
        self.index = index
        self._dir = Path(state_dir)
        self._clock = clock
        self._file = StateFile(self._dir, index)
        # Static facts never change after creation: read them once.
        self._static = self._read()
        self._attach_driver(_resolve_timing(timing, set_latency_ms), sleep)

    def _attach_driver(self, timing: NvmlTiming, sleep: Callable[[float], None]) -> None:
        """Give this handle its cost model and the GPU's driver lock."""
        rng = random.Random(f"nvml:{self._static.uuid}")
        lock = driver_lock(self._dir, self.index)
        self._driver = SimDriver(timing, lock, rng, self._clock, sleep)
        if timing.charges:  # (Untimed, a subclass's own `calls_block` stands.)
            self.calls_block = True

    # Construction.
    @classmethod
    def create(
        cls,
        state_dir: str | Path,
        index: int,
        preset: str | HardwareParams = "A40",
        uuid: str | None = None,
        has_energy_counter: bool = True,
        seed: int | None = None,
        *,
        energy_update_ms: float | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
        timing: str | NvmlTiming = "none",
        set_latency_ms: float | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> SimGPU:
        """Create (or overwrite) a device file and return the device.

        Args:
            state_dir: Directory of the device files (created if missing).
            index: Index of the GPU.
            preset: A key of `PRESETS` ("A40", "V100", "A100", "H100") or custom hardware.
            uuid: The GPU's UUID (default: derived from `seed`, or random without one).
            has_energy_counter: False emulates a pre-Volta GPU without an energy counter.
            seed: Seed of the device's noise (energy spread, per-step jitter, power readings);
                None turns noise off.
            energy_update_ms: Period of the energy counter's updates (ms; 0 = continuous);
                None takes the preset's `HardwareParams.energy_update_ms` (100 ms).
            clock: Monotonic clock in nanoseconds (injectable for tests).
            timing: What the returned handle's calls cost ("h200", "none" or a model); a
                model whose counter jitters ("h200") also makes this device's counter update
                at jittered instants, for every process that opens it.
            set_latency_ms: Cost of a setter (ms; default 1 ms under "h200").
            sleep: Sleeps seconds; charged calls wait with it (injectable for tests).

        Returns:
            The device.

        Raises:
            GPUValueError: When the preset or timing name is unknown, `energy_update_ms` or
                `set_latency_ms` is negative.
        """
        model = _resolve_timing(timing, set_latency_ms)
        hw = _hardware(preset)
        period_ns = _energy_update_ns(hw, energy_update_ms)
        if uuid is None:
            uuid = _device_uuid(seed, index)
        factor = 1.0
        if seed is not None:
            factor = NoiseModel().device_energy_factor(random.Random(f"spread:{seed}:{index}"))
        now = clock()
        state = DeviceState(
            index=index,
            uuid=uuid,
            hardware=hw,
            has_energy_counter=has_energy_counter,
            seed=seed,
            energy_factor=factor,
            power_limit_w=hw.default_power_limit_w,
            locked_min_mhz=None,
            locked_max_mhz=None,
            persistence_mode=False,
            energy_j=0.0,
            updated_ns=now,
            busy_until_ns=0,
            busy_power_w=0.0,
            busy_clock_mhz=hw.min_sm_clock_mhz,
            work_count=0,
            energy_update_ns=period_ns,
            counter_ns=now,
            counter_j=0.0,
            counter_jitter=model.counter.name if model.counter is not None else "",
        )
        state.counter_ns = state.update_instant(now)
        return cls._written(Path(state_dir), state, clock, model, sleep)

    @classmethod
    def _written(
        cls,
        state_dir: Path,
        state: DeviceState,
        clock: Callable[[], int],
        model: NvmlTiming,
        sleep: Callable[[float], None],
    ) -> SimGPU:
        """`create`'s device: `state` written to GPU `state.index`'s file in `state_dir`."""
        state_dir.mkdir(parents=True, exist_ok=True)
        gpu = cls.__new__(cls)
        gpu.index = state.index
        gpu._dir = state_dir
        gpu._clock = clock
        gpu._file = StateFile(state_dir, state.index)
        with gpu._file.locked():
            gpu._file.write(state)
        gpu._static = state
        gpu._attach_driver(model, sleep)
        return gpu

    @classmethod
    def open(
        cls,
        state_dir: str | Path,
        index: int,
        *,
        clock: Callable[[], int] = time.monotonic_ns,
        timing: str | NvmlTiming = "none",
        set_latency_ms: float | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> SimGPU:
        """Attach to a device file written by `create` (possibly in another process).

        The counter's update instants are the file's (its creator's timing); `timing` sets
        only what this handle's calls cost.

        Args:
            state_dir: Directory of the device files.
            index: Index of the GPU.
            clock: Monotonic clock in nanoseconds (injectable for tests).
            timing: What this handle's calls cost: "h200", "none" (default) or a model.
            set_latency_ms: Cost of a setter (ms; default 1 ms under "h200").
            sleep: Sleeps seconds; charged calls wait with it (injectable for tests).

        Returns:
            The device.

        Raises:
            GPUUnavailableError: When the file is missing or unreadable.
            GPUValueError: For an unknown timing name or a negative setter cost.
        """
        return cls(
            state_dir, index, clock=clock, timing=timing, set_latency_ms=set_latency_ms,
            sleep=sleep,
        )

    # File access (`zeus_agent.gpu.sim.store`: parsed again only after a write).
    def _read(self) -> DeviceState:
        """The device's state (shared: do not change it; `_update` gives a copy to change)."""
        static = getattr(self, "_static", None)  # hardware never changes after `create`
        return self._file.read(static.hardware if static is not None else None)

    @contextlib.contextmanager
    def _update(self) -> Iterator[DeviceState]:
        """Lock, read, fold energy up to now, yield the state for changes, write it back."""
        static = getattr(self, "_static", None)
        with self._file.update(static.hardware if static is not None else None) as state:
            state.fold(self._clock())
            yield state

    def _describe(self) -> str:
        """Return e.g. "NVIDIA A40 (simulated GPU 0)" for error messages."""
        return f"{self._static.hardware.name} (simulated GPU {self.index})"

    # Identity and static facts.
    @property
    def hardware(self) -> HardwareParams:
        """The hardware model of this device."""
        return self._static.hardware

    def get_name(self) -> str:
        """Return the marketing name of the GPU."""
        return self._static.hardware.name

    def get_uuid(self) -> str:
        """Return the GPU's UUID."""
        return self._static.uuid

    def get_architecture(self) -> str:
        """Return the lower-case architecture name (e.g. "ampere")."""
        return self._static.hardware.architecture

    def get_power_limit_constraints_w(self) -> tuple[int, int]:
        """Return the (min, max) settable power limit. Units: W."""
        hw = self._static.hardware
        return hw.min_power_limit_w, hw.max_power_limit_w

    def get_default_power_limit_w(self) -> int:
        """Return the default power limit. Units: W."""
        return self._static.hardware.default_power_limit_w

    def get_supported_memory_clocks_mhz(self) -> Sequence[int]:
        """Return the supported memory clocks, highest first. Units: MHz."""
        return self._static.hardware.supported_memory_clocks_mhz

    def get_supported_graphics_clocks_mhz(
        self, memory_clock_mhz: int | None = None
    ) -> Sequence[int]:
        """Return the SM clocks supported at a memory clock (default: the highest). Units: MHz.

        The simulated GPU supports the same SM clocks at every memory clock.

        Raises:
            GPUValueError: When the memory clock is not supported.
        """
        hw = self._static.hardware
        if memory_clock_mhz is not None and memory_clock_mhz not in hw.supported_memory_clocks_mhz:
            raise GPUValueError(
                f"{self._describe()}: memory clock {memory_clock_mhz} MHz is not supported; "
                f"use one of {list(hw.supported_memory_clocks_mhz)} MHz"
            )
        return hw.supported_sm_clocks_mhz

    @property
    def energy_update_ms(self) -> float:
        """Period of the energy counter's updates (ms; 0 = continuous)."""
        return self._static.energy_update_ns / 1_000_000

    def supports_energy_counter(self) -> bool:
        """Return whether the GPU has a hardware energy counter (Volta and newer)."""
        return self._static.has_energy_counter

    # Power limit.
    def get_power_limit_w(self) -> int:
        """Return the current power limit. Units: W."""
        with self._driver.call(CallKind.POWER_LIMIT):
            return self._read().power_limit_w

    def set_power_limit_w(self, power_limit_w: int) -> None:
        """Set the power limit. Units: W.

        Raises:
            GPUValueError: When the limit is not an integer within the GPU's range.
        """
        lo, hi = self.get_power_limit_constraints_w()
        if isinstance(power_limit_w, bool) or not isinstance(power_limit_w, int):
            raise GPUValueError(
                f"{self._describe()}: power limit must be an integer number of watts, got "
                f"{power_limit_w!r}; pick an integer within {lo}-{hi} W"
            )
        if not lo <= power_limit_w <= hi:
            raise GPUValueError(
                f"{self._describe()}: power limit {power_limit_w} W is outside the allowed range "
                f"{lo}-{hi} W; pick a value within it"
            )
        with self._driver.call(CallKind.SET), self._update() as state:
            state.power_limit_w = power_limit_w

    def reset_power_limit(self) -> None:
        """Restore the default power limit."""
        with self._driver.call(CallKind.SET), self._update() as state:
            state.power_limit_w = state.hardware.default_power_limit_w

    # Clocks.
    def lock_sm_clocks_mhz(self, min_clock_mhz: int, max_clock_mhz: int) -> None:
        """Lock the SM clock into [min, max]. Units: MHz.

        Raises:
            GPUValueError: When a clock is not supported or min > max.
        """
        hw = self._static.hardware
        supported = hw.supported_sm_clocks_mhz
        for label, value in (("minimum", min_clock_mhz), ("maximum", max_clock_mhz)):
            if value not in supported:
                raise GPUValueError(
                    f"{self._describe()}: {label} SM clock {value!r} MHz is not supported; "
                    f"supported clocks range {hw.min_sm_clock_mhz}-{hw.max_sm_clock_mhz} MHz "
                    f"(see get_supported_graphics_clocks_mhz)"
                )
        if min_clock_mhz > max_clock_mhz:
            raise GPUValueError(
                f"{self._describe()}: minimum SM clock {min_clock_mhz} MHz exceeds the maximum "
                f"{max_clock_mhz} MHz; swap them"
            )
        with self._driver.call(CallKind.SET), self._update() as state:
            state.locked_min_mhz = min_clock_mhz
            state.locked_max_mhz = max_clock_mhz

    def reset_sm_clocks(self) -> None:
        """Undo `lock_sm_clocks_mhz`."""
        with self._driver.call(CallKind.SET), self._update() as state:
            state.locked_min_mhz = None
            state.locked_max_mhz = None

    def get_locked_sm_clocks_mhz(self) -> tuple[int, int] | None:
        """Return the locked (min, max) SM clocks, or None when unlocked. Units: MHz."""
        state = self._read()
        if state.locked_min_mhz is None or state.locked_max_mhz is None:
            return None
        return state.locked_min_mhz, state.locked_max_mhz

    def get_sm_clock_mhz(self) -> int:
        """Return the current SM clock: the work's clock when busy, the lowest allowed otherwise.

        Units: MHz.
        """
        with self._driver.call(CallKind.SM_CLOCK):
            state = self._read()
            if state.busy_until_ns > self._clock():
                return state.busy_clock_mhz
            return state.locked_min_mhz or state.hardware.min_sm_clock_mhz

    def get_memory_clock_mhz(self) -> int:
        """Return the current memory clock (the highest supported). Units: MHz."""
        with self._driver.call(CallKind.MEM_CLOCK):
            return self._static.hardware.supported_memory_clocks_mhz[0]

    # Energy and power.
    def get_total_energy_j(self) -> float:
        """Return the energy counter: the energy up to its last update instant. Units: J.

        Raises:
            GPUNotSupportedError: When the device emulates a GPU without an energy counter.
        """
        if not self._static.has_energy_counter:
            raise GPUNotSupportedError(
                f"{self._describe()} has no energy counter (emulating a pre-Volta GPU); "
                f"integrate get_power_w over time instead"
            )
        with self._driver.call(CallKind.ENERGY) as call:
            call.midpoint()  # the value is the counter's at the middle of the call
            return self._read().counter_at(self._clock())

    def get_power_w(self) -> float:
        """Return the current power draw, with +-1% noise when the device has a seed. Units: W."""
        with self._driver.call(CallKind.POWER):
            return self._power_w(self._read(), self._clock())

    def _power_w(self, state: DeviceState, now: int) -> float:
        if state.busy_until_ns > now:
            power = state.busy_power_w
        else:
            power = state.hardware.idle_power_w * state.energy_factor
        if state.seed is not None:
            rng = random.Random(f"power:{state.seed}:{self.index}:{now}")
            power *= 1.0 + 0.01 * max(-3.0, min(3.0, rng.gauss(0.0, 1.0)))
        return power

    def read_telemetry(self) -> Telemetry:
        """Everything an agent samples, from one read of the device file.

        With call costs, it costs what NVML's five getters cost one after the other (counter,
        power, power limit, SM and memory clocks); the file is read at the counter read's
        midpoint.
        """
        counter = self._static.has_energy_counter
        with self._driver.call(CallKind.ENERGY) if counter else NO_CALL as call:
            call.midpoint()
            state = self._read()
            now = self._clock()
        for kind in _TELEMETRY_REST:
            with self._driver.call(kind):
                pass
        energy = state.counter_at(now) if self._static.has_energy_counter else None
        return self._telemetry(state, now, energy)

    def _telemetry(self, state: DeviceState, now: int, energy_j: float | None) -> Telemetry:
        """What the getters would answer from one read of the device file."""
        busy = state.busy_until_ns > now
        return Telemetry(
            energy_j=energy_j,
            power_w=self._power_w(state, now),
            power_limit_w=state.power_limit_w,
            sm_clock_mhz=state.busy_clock_mhz
            if busy
            else state.locked_min_mhz or state.hardware.min_sm_clock_mhz,
            memory_clock_mhz=self._static.hardware.supported_memory_clocks_mhz[0],
        )

    def read_status(self, power_limit_w: int | None = None) -> Telemetry:
        """Everything an agent samples but the energy counter, from one read of the device file.

        With call costs, it costs what NVML's four getters cost one after the other (power,
        power limit, SM and memory clocks); four file reads would charge the agent's process
        for the simulator's own work, which a real GPU does not. Given `power_limit_w` (the
        caller read it recently), the limit's getter is neither called nor charged.
        """
        for kind in _TELEMETRY_REST:
            if power_limit_w is not None and kind is CallKind.POWER_LIMIT:
                continue
            with self._driver.call(kind):
                pass
        status = self._telemetry(self._read(), self._clock(), None)
        if power_limit_w is None:
            return status
        return dataclasses.replace(status, power_limit_w=power_limit_w)

    def get_instant_power_w(self) -> float:
        """Return the instantaneous power draw (same as `get_power_w` here). Units: W."""
        with self._driver.call(CallKind.POWER_INSTANT):
            return self._power_w(self._read(), self._clock())

    # What the calls cost.
    @property
    def timing(self) -> NvmlTiming:
        """This handle's call-cost model (ask it e.g. ``p99_s(CallKind.ENERGY)``)."""
        return self._driver.timing

    @property
    def call_counts(self) -> collections.Counter[CallKind]:
        """NVML-like calls made through this handle so far, by kind."""
        return self._driver.counts

    def is_busy(self) -> bool:
        """Return whether work submitted by `run_work` is still running."""
        return self._read().busy_until_ns > self._clock()

    # Persistence mode.
    def get_persistence_mode(self) -> bool:
        """Return whether persistence mode is on."""
        with self._driver.call(CallKind.OTHER):
            return self._read().persistence_mode

    def set_persistence_mode(self, enabled: bool) -> None:
        """Turn persistence mode on or off."""
        with self._driver.call(CallKind.SET), self._update() as state:
            state.persistence_mode = bool(enabled)

    # Trainer side.
    def run_work(
        self,
        workload: WorkloadParams,
        *,
        scale: float = 1.0,
        rng: random.Random | None = None,
        noise: NoiseModel | None = None,
    ) -> WorkResult:
        """Start one piece of work (a step, or a fraction of one) and return what it will do.

        The operating point comes from the current power limit and clock locks. The device is
        busy for the returned duration from now (after any unfinished work, which it queues
        behind); this call does not sleep.

        Args:
            workload: The work.
            scale: Factor on the work's durations (and so its energy); power is unchanged.
            rng: Source of noise; with None the device's seed drives the noise, and without a
                seed there is none.
            noise: The noise model (default `NoiseModel()` when noise applies).

        Returns:
            Duration, energy and clock of the work.

        Raises:
            GPUValueError: When `scale` is not positive.
        """
        if not scale > 0:
            raise GPUValueError(f"run_work scale must be > 0, got {scale!r}")
        with self._update() as state:
            hw = state.hardware
            point = operating_point(
                hw,
                workload,
                state.power_limit_w,
                max_sm_clock_mhz=state.locked_max_mhz,
                min_sm_clock_mhz=state.locked_min_mhz,
            )
            if rng is None and state.seed is not None:
                rng = random.Random(f"work:{state.seed}:{self.index}:{state.work_count}")
            if rng is not None:
                point = (noise or NoiseModel()).perturb(point, rng, state.energy_factor)
            elif state.energy_factor != 1.0:
                point = dataclasses.replace(point, energy_j=point.energy_j * state.energy_factor)
            duration_s = point.step_time_s * scale
            energy_j = point.energy_j * scale
            now = state.updated_ns
            # Queue behind unfinished work: merge into one busy period of average power.
            left_ns = max(0, state.busy_until_ns - now)
            left_j = state.busy_power_w * left_ns / _NS
            duration_ns = max(1, round(duration_s * _NS))
            state.busy_until_ns = now + left_ns + duration_ns
            state.busy_power_w = (left_j + energy_j) * _NS / (left_ns + duration_ns)
            state.busy_clock_mhz = round(point.sm_clock_mhz)
            state.work_count += 1
            until_ns = state.busy_until_ns
        return WorkResult(
            duration_s=duration_s, energy_j=energy_j, sm_clock_mhz=round(point.sm_clock_mhz),
            busy_until_ns=until_ns,
        )


_TELEMETRY_REST = (CallKind.POWER, CallKind.POWER_LIMIT, CallKind.SM_CLOCK, CallKind.MEM_CLOCK)
"""The getters `read_telemetry` charges after the counter read."""


def _resolve_timing(timing: str | NvmlTiming, set_latency_ms: float | None) -> NvmlTiming:
    """The cost model a `timing` argument names; `set_latency_ms` overrides its setter cost."""
    if isinstance(timing, NvmlTiming):
        if set_latency_ms is None or timing.name == "none":
            return timing
        if not set_latency_ms >= 0:
            raise GPUValueError(f"set_latency_ms must be >= 0, got {set_latency_ms!r}")
        return dataclasses.replace(timing, set_latency_s=set_latency_ms / 1e3)
    try:
        if set_latency_ms is None:
            return timing_preset(timing)
        return timing_preset(timing, set_latency_ms)
    except ValueError as e:
        raise GPUValueError(f"simulated NVML timing: {e}") from None


def create_sim_gpus(
    state_dir: str | Path,
    count: int,
    preset: str | HardwareParams = "A40",
    *,
    seed: int | None = None,
    has_energy_counter: bool = True,
    energy_update_ms: float | None = None,
    clock: Callable[[], int] = time.monotonic_ns,
) -> list[SimGPU]:
    """Create `count` simulated GPUs with indices 0..count-1 in one directory.

    Args:
        state_dir: Directory of the device files.
        count: Number of GPUs.
        preset: A key of `PRESETS` or custom hardware.
        seed: Noise seed shared by the devices (each index draws its own spread), or None.
        has_energy_counter: False emulates pre-Volta GPUs.
        energy_update_ms: Period of the energy counters (ms; 0 = continuous; None: the
            preset's).
        clock: Monotonic clock in nanoseconds (injectable for tests).

    Returns:
        The devices, by index.
    """
    return [
        SimGPU.create(
            state_dir,
            i,
            preset,
            has_energy_counter=has_energy_counter,
            seed=seed,
            energy_update_ms=energy_update_ms,
            clock=clock,
        )
        for i in range(count)
    ]
