"""A drop-in for Zeus's `zeus.profiling.ZeusProfilingService`, measured by the node's agent.

* `ZeusProfilingService`: a stack of profiling windows (`push_window`/`pop_window`); each pop
  closes the innermost window and returns its `ProfilingResult(time, energy)`, one energy per
  GPU in the order given. Each window is two local `time.monotonic_ns()` stamps; the pop asks
  the agent for the energy in between (a WINDOW request through `zeus_agent.emit`, as
  `ZeusMonitor` does). No NVML, no monitor process, no privileges in the trainer.
* `ProfilingResult`: `zeus_agent.emit.ProfilingResult` (Zeus's dataclass: `time`, `energy`).

Zeus shipped this class on its main branch from February to June 2023 (the `ZeusDataLoader`
era), when `ZeusMonitor` replaced it; this follows its last form. What the agent-based design
does differently (no power log files, CUDA indices) is listed in the migration guide.
"""

from __future__ import annotations

import logging
import operator
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from zeus_agent import emit
from zeus_agent.emit import ProfilingResult
from zeus_agent.integrations.monitor import _synchronize, _visible_gpu_indices

__all__ = ["ProfilingResult", "ZeusProfilingService"]

LOG = logging.getLogger(__name__)


def _cuda_index_of_handle(handle: Any) -> int:
    """The CUDA device index of this process for an NVML device handle (`pynvml` imported)."""
    pynvml = sys.modules.get("pynvml")
    if pynvml is None:
        raise TypeError(
            f"gpu_indices takes CUDA device indices (or pynvml device handles), got {handle!r}"
        )
    node = int(pynvml.nvmlDeviceGetIndex(handle))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not visible:
        return node
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    uuid = None
    for cuda_index, entry in enumerate(entries):
        if entry.isdigit():
            if int(entry) == node:
                return cuda_index
            continue
        if uuid is None:
            raw = pynvml.nvmlDeviceGetUUID(handle)
            uuid = raw.decode() if isinstance(raw, bytes) else str(raw)
        if entry.startswith("GPU-") and uuid.startswith(entry):
            return cuda_index
    raise ValueError(
        f"GPU {node} (a pynvml handle) is not visible to this process: "
        f"CUDA_VISIBLE_DEVICES={visible!r}"
    )


def _cuda_indices(gpus: Sequence[Any]) -> list[int]:
    indices = []
    for gpu in gpus:
        try:
            index = operator.index(gpu)
        except TypeError:
            index = _cuda_index_of_handle(gpu)
        if index < 0:
            raise ValueError(f"GPU indices must be non-negative, got {index}")
        indices.append(index)
    return indices


class ZeusProfilingService:
    """Profiles energy and time inside a training script (Zeus's `ZeusProfilingService`).

    Push a profiling window to start profiling and pop to get the profiling result of the
    *last* pushed window: windows nest, like a stack.

    Example:
        ```python
        prof_service = ZeusProfilingService(gpu_indices=[0, 1])
        prof_service.push_window()
        training(x, y)
        prof_result = prof_service.pop_window()
        print(f"Training takes {prof_result.time} seconds.")
        for gpu_idx, energy in zip(prof_service.gpu_indices, prof_result.energy):
            print(f"GPU {gpu_idx} consumes {energy} Joules.")
        ```
    """

    def __init__(
        self,
        gpu_indices: Sequence[Any] | None = None,
        monitor_path: str | None = "zeus_monitor",
        monitor_log_dir: str | None = "",
        monitor_log_prefix: str | None = "",
        *,
        power_log_prefix: str | None = None,
        publisher: emit.Publisher | None = None,
    ) -> None:
        """Set up the service (no GPU access: the agent measures every GPU it serves).

        Args:
            gpu_indices: CUDA device indices of this process (they respect
                `CUDA_VISIBLE_DEVICES`, as `ZeusMonitor`'s do), or pynvml device handles
                (Zeus's first form took `gpu_handles`), mapped to this process's CUDA
                indices. Default: every GPU this process sees (`ZeusMonitor`'s default).
                Repeats are allowed and measured once, as in Zeus.
            monitor_path: Accepted for compatibility, not used: the agent integrates the
                power of GPUs older than Volta itself; no `zeus_monitor` process is started.
            monitor_log_dir: Accepted for compatibility, not used: no power log is written.
            monitor_log_prefix: Accepted for compatibility, not used.
            power_log_prefix: Zeus's first form's name for the log prefix; not used either.
            publisher: The publisher to measure with; default `zeus_agent.emit`'s default
                publisher at each call (so a later `emit.init` is picked up).

        Raises:
            ValueError: A GPU index is negative, or a handle's GPU is not visible here.
            TypeError: An entry is neither an index nor a pynvml handle.
        """
        del power_log_prefix
        gpus = _visible_gpu_indices() if gpu_indices is None else _cuda_indices(gpu_indices)
        self.gpu_indices: list[int] = gpus
        self.monitor_path = monitor_path
        self.monitor_log_dir = monitor_log_dir
        self.monitor_log_prefix = monitor_log_prefix
        self._publisher = publisher
        self._starts: list[int] = []  # monotonic_ns of each open window, innermost last

    @property
    def publisher(self) -> emit.Publisher:
        """The publisher windows are measured with."""
        return self._publisher if self._publisher is not None else emit.get_publisher()

    def push_window(self) -> None:
        """Push one profiling window to the stack (after queued CUDA work has finished)."""
        _synchronize(self.gpu_indices)
        self._starts.append(time.monotonic_ns())
        self._log("Profiling window pushed.")

    def pop_window(self, *, exact: bool = False) -> ProfilingResult:
        """Pop the innermost profiling window; return its time and each GPU's energy.

        Args:
            exact: Not in Zeus: wait for the energy counter's read that brackets the window's
                end (~60 ms, ~200 ms at most on an H200) instead of answering at once.

        Returns:
            `ProfilingResult`: `time` (s) and `energy` (J), one per entry of `gpu_indices`,
            in order (NaN when the agent could not measure).

        Raises:
            RuntimeError: No window is open: call `push_window()` first.
        """
        _synchronize(self.gpu_indices)
        t1 = time.monotonic_ns()
        if not self._starts:
            raise RuntimeError("No profiling window active. Consider calling `push_window` first.")
        t0 = self._starts.pop()
        distinct = list(dict.fromkeys(self.gpu_indices))
        measured = self.publisher.measure(t0, t1, distinct, exact=exact) if distinct else []
        by_gpu = dict(zip(distinct, measured, strict=True))
        self._log("Profiling window popped.")
        return ProfilingResult(time=(t1 - t0) / 1e9, energy=[by_gpu[i] for i in self.gpu_indices])

    def _log(self, message: str) -> None:
        gpus = ",".join(str(i) for i in self.gpu_indices)
        LOG.info("%s %s %s", "[ZeusProfilingService]", f"[GPU_{gpus}]", message)
