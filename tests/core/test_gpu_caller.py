"""GPUCaller: inline for non-blocking backends, one thread per GPU with a timeout otherwise."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from tests.fakes import fake_pynvml as fake
from tests.fakes.fake_pynvml import FakeNVML
from zeus_agent.errors import GPUPermissionError, GPUUnavailableError
from zeus_agent.gpu.base import GPU
from zeus_agent.gpu.nvml import NVMLGPU
from zeus_agent.gpu.threaded import GPUCaller


class InlineGPU(NVMLGPU):
    """An NVMLGPU that claims not to block, standing in for the simulated GPU."""

    calls_block = False


@pytest.fixture
def nv() -> FakeNVML:
    return FakeNVML()


@pytest.fixture
def threaded(nv: FakeNVML) -> Iterator[GPUCaller]:
    caller = GPUCaller(NVMLGPU(0, nv))
    yield caller
    caller.close()


async def test_inline_runs_on_the_loop_thread(nv: FakeNVML) -> None:
    gpu = InlineGPU(0, nv)
    caller = GPUCaller(gpu)
    assert not caller.blocking
    thread_id = await caller.call(threading.get_ident)
    assert thread_id == threading.get_ident()
    assert await caller.call(gpu.get_power_w) == pytest.approx(250.5)
    caller.close()


async def test_threaded_runs_in_the_gpu_thread(threaded: GPUCaller) -> None:
    assert threaded.blocking
    name = await threaded.call(lambda: threading.current_thread().name)
    assert name.startswith("gpu0")
    assert await threaded.call(threaded.gpu.get_power_w) == pytest.approx(250.5)
    await threaded.call(threaded.gpu.set_power_limit_w, 200)
    assert await threaded.call(threaded.gpu.get_power_limit_w) == 200


async def test_threaded_calls_are_serialised(threaded: GPUCaller) -> None:
    active = 0
    peak = 0
    lock = threading.Lock()

    def work() -> None:
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
        time.sleep(0.01)
        with lock:
            active -= 1

    await asyncio.gather(*(threaded.call(work) for _ in range(5)))
    assert peak == 1


async def test_timeout_raises_unavailable(threaded: GPUCaller) -> None:
    release = threading.Event()

    def hang() -> None:
        release.wait(5)

    try:
        with pytest.raises(GPUUnavailableError) as info:
            await threaded.call(hang, timeout_s=0.05)
    finally:
        release.set()
    message = str(info.value)
    assert "hang" in message and "0.05 s" in message and "GPU 0" in message
    assert isinstance(info.value.__cause__, TimeoutError)


async def test_errors_pass_through_unchanged(nv: FakeNVML, threaded: GPUCaller) -> None:
    nv.inject_error("nvmlDeviceSetPowerManagementLimit", fake.NVML_ERROR_NO_PERMISSION)
    with pytest.raises(GPUPermissionError, match="CAP_SYS_ADMIN"):
        await threaded.call(threaded.gpu.set_power_limit_w, 200)


async def test_close_is_idempotent_and_final(threaded: GPUCaller) -> None:
    threaded.close()
    threaded.close()
    with pytest.raises(GPUUnavailableError, match="closed"):
        await threaded.call(threaded.gpu.get_power_w)


async def test_a_gpu_that_does_not_state_calls_block_is_threaded() -> None:
    class Unstated(GPU):
        index = 3

    Unstated.__abstractmethods__ = frozenset()  # (no method is called)
    assert GPU.calls_block is True
    caller = GPUCaller(Unstated())
    assert caller.blocking
    assert (await caller.call(lambda: threading.current_thread().name)).startswith("gpu3")
    caller.close()
