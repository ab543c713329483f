"""How async code calls a GPU backend without blocking the event loop.

* `GPUCaller`: `await caller.call(fn, *args, timeout_s=2.0)`. For a backend whose `calls_block`
  is True (NVML: calls serialise on a driver lock and can hang when a GPU falls off the bus),
  calls run on two single-thread executors per GPU, one at a time in each, and time out with
  `GPUUnavailableError`: the setters' lane (every call that changes the GPU, `SETTERS`, in the
  order issued) and the getters' lane (counter and status reads). A clock change thus never
  waits in a queue behind a read that has not started yet; it can still wait in the driver for
  one in flight (NVML serialises calls to a GPU). `caller.submit_setter(fn, *args)` puts a call
  on the setters' lane without a task or an await (the clock-change hot path). For a backend
  whose `calls_block` is False (the simulated GPU), calls run inline on the event loop.

Pure asyncio; nothing here knows about NATS.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from zeus_agent.errors import GPUUnavailableError
from zeus_agent.gpu.base import GPU

__all__ = ["DEFAULT_TIMEOUT_S", "SETTERS", "GPUCaller"]

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 2.0
"""Default time a blocking GPU call may take before it counts as hung. Units: s."""
SETTERS = frozenset({"lock_sm_clocks_mhz", "reset_sm_clocks", "set_power_limit_w",
                     "reset_power_limit"})
"""GPU methods that change a setting: they run on the setters' lane, in the order issued, so a
restore is never overtaken by a clock change issued before it."""


class GPUCaller:
    """Runs one GPU's (possibly blocking) methods on behalf of async code.

    A timed-out call keeps running in its thread (a blocking C call cannot be interrupted), so
    later calls queue behind it and time out too until it returns; callers see
    `GPUUnavailableError` each time, which is the right signal for a hung GPU.

    Attributes:
        gpu: The GPU whose methods are called.
        blocking: Whether calls go through the executors (`gpu.calls_block`).
    """

    def __init__(self, gpu: GPU) -> None:
        """Create the caller and, for blocking backends, its single-thread executor.

        Args:
            gpu: The GPU to call. Its `calls_block` picks the mode.
        """
        self.gpu = gpu
        self.blocking: bool = gpu.calls_block
        self._executor: ThreadPoolExecutor | None = None
        self._setters: ThreadPoolExecutor | None = None
        if self.blocking:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"gpu{gpu.index}")
            self._setters = ThreadPoolExecutor(1, thread_name_prefix=f"gpu{gpu.index}-set")
        self._closed = False

    def __repr__(self) -> str:
        mode = "threaded" if self.blocking else "inline"
        return f"GPUCaller(gpu={self.gpu!r}, {mode}, closed={self._closed})"

    async def call(
        self,
        fn: Callable[..., T],
        *args: Any,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        setter: bool | None = None,
    ) -> T:
        """Call `fn(*args)`, in one of this GPU's threads if the backend blocks.

        Args:
            fn: Usually a bound method of `self.gpu`, e.g. `gpu.get_power_w`.
            *args: Positional arguments for `fn`.
            timeout_s: Longest wait for a blocking call (ignored for inline calls). Units: s.
            setter: Run it on the setters' lane; None: when `fn` is one of `SETTERS`.

        Returns:
            What `fn` returns.

        Raises:
            GPUUnavailableError: If the call did not return within `timeout_s`, or the caller
                is closed.
            GPUError: Whatever `fn` raises, unchanged.
        """
        if self._closed:
            raise GPUUnavailableError(
                f"GPU {self.gpu.index}: cannot call {_name(fn)}, the GPU caller is closed."
            )
        if self._executor is None:
            return fn(*args)
        if setter is None:
            setter = _name(fn).rsplit(".", 1)[-1] in SETTERS
        loop = asyncio.get_running_loop()
        lane = self._setters if setter else self._executor
        future = loop.run_in_executor(lane, functools.partial(fn, *args))
        try:
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError as e:
            raise GPUUnavailableError(
                f"GPU {self.gpu.index}: {_name(fn)} did not return within {timeout_s:g} s; "
                "the GPU or its driver may be hung (check `nvidia-smi` and the kernel log)."
            ) from e

    def submit_setter(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue `fn(*args)` on the setters' lane now, from the loop's thread, and return.

        For the clock-change hot path: no task, no loop iteration before the call is queued.
        The caller handles the result (a done callback runs in the GPU's thread); there is no
        timeout (a hung call holds the lane, and the setters queued behind it time out).

        Raises:
            GPUUnavailableError: The caller is closed.
            RuntimeError: The backend does not block (call `fn` inline instead).
        """
        if self._closed:
            raise GPUUnavailableError(
                f"GPU {self.gpu.index}: cannot call {_name(fn)}, the GPU caller is closed."
            )
        if self._setters is None:
            raise RuntimeError("submit_setter needs a blocking backend")
        return self._setters.submit(fn, *args)

    def close(self) -> None:
        """Shut the executors down without waiting; queued calls are cancelled. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for executor in (self._executor, self._setters):
            if executor is not None:
                executor.shutdown(wait=False, cancel_futures=True)


def _name(fn: Callable[..., Any]) -> str:
    """Return a readable name for `fn` ("get_power_w" for a bound method)."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return str(name) if name else repr(fn)
