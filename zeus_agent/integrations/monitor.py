"""A drop-in for `zeus.monitor.ZeusMonitor`, measured by the node's agent.

* `Measurement`: time (s), per-GPU energy (J), per-CPU package and DRAM energy (J) and SoC
  energy (always None here: no SoC is measured) of one window (Zeus's names).
* `ZeusMonitor`: named windows (`begin_window`/`end_window`, `reset_windows`) that may
  overlap; each window is two local `time.monotonic_ns()` stamps, and `end_window` asks the
  agent (a WINDOW request through `zeus_agent.emit`) for the energy in between. No NVML in the
  trainer, and no RAPL: the agent, which runs privileged, reads the CPU packages' and their
  DRAM's RAPL counters (`zeus_agent.agent.rapl`), so a trainer needs no root for CPU energy
  either.

GPU indices are CUDA device indices of this process (they respect `CUDA_VISIBLE_DEVICES`, as
in Zeus); `zeus_agent.emit` maps them to the node's indices. Without an agent, energies are
NaN and times are still right. CPU indices are RAPL packages (`intel-rapl:<index>`), as in
Zeus; on a node without readable RAPL counters, `cpu_energy` and `dram_energy` are None (said
once per monitor in the log), as in Zeus.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from functools import cached_property
from types import ModuleType
from typing import Any, Literal

from zeus_agent import emit

logger = logging.getLogger(__name__)


@dataclass
class Measurement:
    """Measurement of one window.

    Attributes:
        time: Duration of the window (s).
        gpu_energy: CUDA device index -> energy of the window (J).
        cpu_energy: CPU index (a RAPL package, `intel-rapl:<index>`) -> energy of the window
            (J); None when CPU energy is not measured (`cpu_indices=[]`, or no readable RAPL
            counters on the node).
        dram_energy: CPU index -> energy of its DRAM in the window (J), for packages with a
            DRAM domain; None when there is none (AMD CPUs have none) or CPU energy is not
            measured.
        soc_energy: Zeus's energy of an SoC's subsystems (Apple silicon, Jetson), None where
            there is no SoC, as in Zeus; always None here: the agent measures NVIDIA GPUs
            (NVML) and RAPL, never an SoC.
    """

    time: float
    gpu_energy: dict[int, float]
    cpu_energy: dict[int, float] | None = field(default=None)
    dram_energy: dict[int, float] | None = field(default=None)
    soc_energy: Any | None = field(default=None)

    @cached_property
    def total_energy(self) -> float:
        """Energy of all GPUs (J), computed once (Zeus's `cached_property`)."""
        return sum(self.gpu_energy.values())


def _visible_gpu_indices() -> list[int]:
    """CUDA device indices this process sees, without importing torch or NVML."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available():
                return list(range(torch.cuda.device_count()))
        except Exception as e:  # A broken CUDA setup must not stop monitoring.
            logger.debug("torch.cuda device query failed: %r", e)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip():
        return list(range(len([p for p in visible.split(",") if p.strip()])))
    return [emit.get_publisher().gpu_index]


def _import(module: str, name: str) -> ModuleType:
    """Import a framework on first use, as Zeus does (`zeus.utils.framework`)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise RuntimeError(f"Failed to import {name}") from e


def _synchronize(gpu_indices: list[int], sync_with: str = "torch") -> None:
    """Wait for the work queued on `gpu_indices` (Zeus's `zeus.utils.framework.sync_execution`).

    * "torch": `torch.cuda.synchronize` on each GPU, only when this process has imported torch
      and initialised CUDA (nothing can be queued otherwise); never raises.
    * "jax": as Zeus: a tiny computation put on each GPU (`jax.devices("gpu")[index]`) and on
      the first CPU device, then `jax.block_until_ready` on them (JAX has no device
      synchronize); jax is imported here if it was not.
    * "cupy": as Zeus: `cupy.cuda.Device(index).synchronize()`; cupy imported if it was not.

    Raises:
        RuntimeError: As Zeus: "jax" or "cupy" that cannot be imported ("Failed to import
            JAX" / "CuPy"), JAX without a GPU backend, or any other `sync_with` ("No
            framework is available.").
    """
    if sync_with == "torch":
        _synchronize_torch(gpu_indices)
        return
    if sync_with == "jax":
        jax = _import("jax", "JAX")
        if not jax.devices("gpu"):  # No GPU backend raises in jax itself.
            raise RuntimeError("JAX is available but does not have CUDA support.")
        futures = [jax.device_put(0.0, device=jax.devices("gpu")[i]) + 0 for i in gpu_indices]
        futures.append(jax.device_put(0.0, device=jax.devices("cpu")[0]) + 0)
        jax.block_until_ready(futures)
        return
    if sync_with == "cupy":
        cupy = _import("cupy", "CuPy")
        for index in gpu_indices:
            cupy.cuda.Device(index).synchronize()
        return
    raise RuntimeError("No framework is available.")


def _synchronize_torch(gpu_indices: list[int]) -> None:
    torch = sys.modules.get("torch")
    if torch is None:
        return
    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for index in gpu_indices:
                torch.cuda.synchronize(index)
    except Exception as e:
        logger.debug("torch.cuda.synchronize failed: %r", e)


class ZeusMonitor:
    """Measure the time, GPU energy and CPU energy of named windows (Zeus's `ZeusMonitor`).

    Windows may overlap and nest in any order; each has a unique key while open.

    Example:
        ```python
        monitor = ZeusMonitor(gpu_indices=[0])
        monitor.begin_window("epoch")
        train_one_epoch()
        m = monitor.end_window("epoch")
        print(m.time, m.gpu_energy[0])
        ```
    """

    def __init__(
        self,
        gpu_indices: list[int] | None = None,
        cpu_indices: list[int] | None = None,
        approx_instant_energy: bool = False,
        log_file: str | os.PathLike[str] | None = None,
        sync_execution_with: Literal["torch", "jax", "cupy"] = "torch",
        *,
        publisher: emit.Publisher | None = None,
    ) -> None:
        """Set up the monitor (no GPU access: the agent measures).

        The positional order is Zeus 0.16's.

        Args:
            gpu_indices: CUDA device indices to measure; default every visible GPU (torch's
                device count, else `CUDA_VISIBLE_DEVICES`, else the publisher's GPU); `[]`:
                none (CPU energy only, as in Zeus).
            cpu_indices: CPU packages (RAPL's `intel-rapl:<index>`) whose CPU and DRAM
                energy to measure; default every package of the node; `[]`: none. Indices
                the node does not have are left out of `cpu_energy` (with a warning once).
            approx_instant_energy: Kept (`self.approx_instant_energy`) for compatibility; it
                changes nothing: the agent never answers a short window with zero (past its
                newest counter read it extrapolates with the last update period's power).
            log_file: When given, its directory is created and the file truncated, with
                Zeus's header (`start_time,window_name,elapsed_time,gpu{i}_energy...`); each
                finished (not cancelled) window appends one line.
            sync_execution_with: The framework whose queued GPU work `begin_window` and
                `end_window` wait for: "torch" (default; only when this process has imported
                torch and initialised CUDA, never raising), "jax" or "cupy" (imported at the
                first window, as Zeus's `zeus.utils.framework.sync_execution`); another value
                raises Zeus's `RuntimeError` at the first synchronisation.
            publisher: Not in Zeus: the publisher to measure with; default `zeus_agent.emit`'s
                default publisher at each call (so a later `emit.init` is picked up).

        Raises:
            ValueError: `gpu_indices` or `cpu_indices` has negative or repeated indices.
            OSError: `log_file` cannot be created (as Zeus).
        """
        self.approx_instant_energy = approx_instant_energy
        self.sync_with: str = sync_execution_with
        indices = _visible_gpu_indices() if gpu_indices is None else list(gpu_indices)
        if any(i < 0 for i in indices) or len(set(indices)) != len(indices):
            raise ValueError(f"gpu_indices must be distinct non-negative integers, got {indices}")
        self.gpu_indices = indices
        cpus = None if cpu_indices is None else list(cpu_indices)
        if cpus is not None and (any(i < 0 for i in cpus) or len(set(cpus)) != len(cpus)):
            raise ValueError(f"cpu_indices must be distinct non-negative integers, got {cpus}")
        self.cpu_indices: list[int] | None = cpus
        """CPU packages measured; None: every package of the node (the agent's)."""
        self._cpus_seen: list[int] = []
        self._cpu_note_said = False
        self._publisher = publisher
        self._windows: dict[str, tuple[int, float]] = {}
        logger.info("Monitoring GPU indices %s.", self.gpu_indices)
        logger.info("Monitoring CPU indices %s", "all" if cpus is None else cpus)
        self.log_file = None if log_file is None else os.fspath(log_file)
        """Path of the CSV log (Zeus keeps the open file here), or None."""
        if self.log_file is not None:
            if directory := os.path.dirname(self.log_file):
                os.makedirs(directory, exist_ok=True)
            with open(self.log_file, "w") as f:  # Truncated, as Zeus.
                gpus = ",".join(f"gpu{i}_energy" for i in self.gpu_indices)
                f.write(f"start_time,window_name,elapsed_time,{gpus}\n")
            logger.info("Writing measurement logs to %s.", self.log_file)

    @property
    def publisher(self) -> emit.Publisher:
        """The publisher windows are measured with."""
        return self._publisher if self._publisher is not None else emit.get_publisher()

    def begin_window(self, key: str, sync_execution: bool = True, restart: bool = False) -> None:
        """Begin a new measurement window.

        Args:
            key: Unique name of the window.
            sync_execution: Wait for the GPUs' queued work (`sync_execution_with`) before
                stamping.
            restart: When a window named `key` is open, drop it and begin anew (Zeus: for a
                notebook cell that failed between `begin_window` and `end_window`).

        Raises:
            ValueError: A window named `key` is already open and `restart` is False.
        """
        if key in self._windows:
            if not restart:
                raise ValueError(f"Measurement window '{key}' already exists")
            del self._windows[key]
            logger.info("Measurement window '%s' restarted.", key)
        if sync_execution and self.gpu_indices:
            _synchronize(self.gpu_indices, self.sync_with)
        self._windows[key] = (time.monotonic_ns(), time.time())
        logger.debug("Measurement window '%s' started.", key)

    def end_window(
        self, key: str, sync_execution: bool = True, cancel: bool = False, exact: bool = False
    ) -> Measurement:
        """End a measurement window and return its time and energy.

        Args:
            key: Name of a window opened with `begin_window`.
            sync_execution: Wait for the GPUs' queued work (`sync_execution_with`) before
                stamping (a cancelled window too, as Zeus).
            cancel: Discard the window: nothing is measured or logged, and zeros are returned
                (each GPU's and each CPU's energy 0, no DRAM).
            exact: Not in Zeus: wait for the energy counter's read that brackets the window's
                end (~60 ms, ~200 ms at most on an H200) instead of answering at once
                (`zeus_agent.emit.Publisher.measure`).

        Returns:
            The window's `Measurement` (energies NaN when the agent could not measure).

        Raises:
            ValueError: No window named `key` is open.
        """
        try:
            t0_ns, start_wall = self._windows.pop(key)
        except KeyError:
            raise ValueError(f"Measurement window '{key}' does not exist") from None
        if sync_execution and self.gpu_indices:
            _synchronize(self.gpu_indices, self.sync_with)
        if cancel:  # As Zeus: zero for every GPU and CPU measured, no DRAM.
            logger.debug("Measurement window '%s' cancelled.", key)
            cpus = self._cpus_seen if self.cpu_indices is None else self.cpu_indices
            return Measurement(time=0.0, gpu_energy=dict.fromkeys(self.gpu_indices, 0.0),
                               cpu_energy=dict.fromkeys(cpus, 0.0))
        t1_ns = time.monotonic_ns()
        wanted: list[int] | Literal["all"] | None = (
            "all" if self.cpu_indices is None else (self.cpu_indices or None))
        energy = self.publisher.measure_window(
            t0_ns, t1_ns, self.gpu_indices, exact=exact, cpu_indices=wanted)
        if energy.cpu_energy is not None:
            self._cpus_seen = list(energy.cpu_energy)
        if energy.cpu_note and not self._cpu_note_said:
            self._cpu_note_said = True  # Said once: a node without RAPL stays without it.
            level = logging.INFO if self.cpu_indices is None else logging.WARNING
            logger.log(level, "ZeusMonitor: CPU energy %s: %s",
                       "not measured" if energy.cpu_energy is None else "in part",
                       energy.cpu_note)
        measurement = Measurement(
            time=(t1_ns - t0_ns) / 1e9,
            gpu_energy=dict(zip(self.gpu_indices, energy.gpu_energy, strict=True)),
            cpu_energy=energy.cpu_energy,
            dram_energy=energy.dram_energy,
        )
        logger.debug("Measurement window '%s' ended.", key)
        if self.log_file is not None:
            self._log(start_wall, key, measurement)
        return measurement

    def reset_windows(self) -> None:
        """Drop every open window (Zeus's): nothing is measured or logged for them."""
        active = list(self._windows)
        self._windows.clear()
        if active:
            logger.info("ZeusMonitor reset dropped active windows: %s", active)
        else:
            logger.info("ZeusMonitor reset with no active windows to drop.")

    def _log(self, start_wall: float, key: str, measurement: Measurement) -> None:
        assert self.log_file is not None
        try:
            with open(self.log_file, "a") as f:
                energies = ",".join(str(measurement.gpu_energy[i]) for i in self.gpu_indices)
                f.write(f"{start_wall},{key},{measurement.time},{energies}\n")
        except OSError as e:
            logger.warning("ZeusMonitor: cannot write %s: %s", self.log_file, e)
