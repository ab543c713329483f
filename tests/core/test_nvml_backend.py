"""NVML backend against the fake pynvml: round trips, unit conversions, validation, error map."""

from __future__ import annotations

import ast
import inspect

import pynvml
import pytest

from tests.fakes import fake_pynvml as fake
from tests.fakes.fake_pynvml import FakeNVML, a40, p100
from zeus_agent.errors import (
    GPUError,
    GPUNotSupportedError,
    GPUPermissionError,
    GPUUnavailableError,
    GPUValueError,
)
from zeus_agent.gpu import nvml as nvml_backend
from zeus_agent.gpu import power_integrator
from zeus_agent.gpu.base import GPUInfo
from zeus_agent.gpu.nvml import NVMLGPU, nvml_gpus
from zeus_agent.gpu.power_integrator import PowerIntegrator


@pytest.fixture
def nv() -> FakeNVML:
    return FakeNVML([a40(0), p100(1)])


@pytest.fixture
def gpu(nv: FakeNVML) -> NVMLGPU:
    return NVMLGPU(0, nv)


@pytest.fixture
def old_gpu(nv: FakeNVML) -> NVMLGPU:
    return NVMLGPU(1, nv)


# --- The fake and the backend agree with the real pynvml ------------------------------------


def test_fake_constants_match_real_pynvml() -> None:
    assert len(fake.CONSTANT_NAMES) > 30
    for name in fake.CONSTANT_NAMES:
        assert getattr(fake, name) == getattr(pynvml, name), name


def test_backend_constants_match_real_pynvml() -> None:
    for name, value in vars(nvml_backend).items():
        if name.startswith("_NVML_"):
            assert getattr(pynvml, name[1:]) == value, name
    for code, arch in nvml_backend.ARCHITECTURES.items():
        assert getattr(pynvml, f"NVML_DEVICE_ARCH_{arch.upper()}") == code


def test_fake_has_every_function_the_backend_calls() -> None:
    source = inspect.getsource(nvml_backend)
    used = {
        node.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.startswith("nvml")
        and node.value[4:5].isupper()
    }
    assert "nvmlDeviceGetPowerUsage" in used
    for function in used:
        assert hasattr(pynvml, function), function
        assert hasattr(FakeNVML, function), function


# --- Discovery ------------------------------------------------------------------------------


def test_nvml_gpus_all_and_init_once(nv: FakeNVML) -> None:
    gpus = nvml_gpus(nvml=nv)
    assert [g.index for g in gpus] == [0, 1]
    assert nv.called("nvmlInit") == [()]
    assert nv.init_count == 1
    assert all(g.calls_block for g in gpus)


def test_nvml_gpus_explicit_indices_keep_order(nv: FakeNVML) -> None:
    gpus = nvml_gpus([1, 0], nvml=nv)
    assert [g.get_name() for g in gpus] == ["Tesla P100-PCIE-16GB", "NVIDIA A40"]


@pytest.mark.parametrize("indices", [[2], [-1], [0, 0]])
def test_nvml_gpus_bad_indices(nv: FakeNVML, indices: list[int]) -> None:
    with pytest.raises(GPUValueError, match=r"GPU ind"):
        nvml_gpus(indices, nvml=nv)


def test_nvml_gpus_driver_not_loaded(nv: FakeNVML) -> None:
    nv.inject_error("nvmlInit", fake.NVML_ERROR_DRIVER_NOT_LOADED)
    with pytest.raises(GPUUnavailableError, match="nvmlInit"):
        nvml_gpus(nvml=nv)


def test_constructor_inits_and_bad_index(nv: FakeNVML) -> None:
    NVMLGPU(0, nv)
    assert nv.init_count == 1
    with pytest.raises(GPUValueError, match="nvmlDeviceGetHandleByIndex on GPU 7"):
        NVMLGPU(7, nv)


# --- Identity and static facts ----------------------------------------------------------------


def test_identity(gpu: NVMLGPU, old_gpu: NVMLGPU) -> None:
    assert gpu.get_name() == "NVIDIA A40"
    assert gpu.get_uuid().startswith("GPU-a40")
    assert gpu.get_architecture() == "ampere"
    assert old_gpu.get_architecture() == "pascal"
    assert gpu.supports_energy_counter()
    assert not old_gpu.supports_energy_counter()


def test_bytes_strings_are_decoded(nv: FakeNVML) -> None:
    nv.devices[0].name = b"NVIDIA A40"  # type: ignore[assignment]  # old pynvml returns bytes
    assert NVMLGPU(0, nv).get_name() == "NVIDIA A40"


@pytest.mark.parametrize(
    ("code", "name"),
    [
        (2, "kepler"),
        (3, "maxwell"),
        (4, "pascal"),
        (5, "volta"),
        (6, "turing"),
        (7, "ampere"),
        (8, "ada"),
        (9, "hopper"),
        (10, "blackwell"),
        (0xFFFFFFFF, "unknown"),
        (77, "unknown"),
    ],
)
def test_architecture_table(nv: FakeNVML, code: int, name: str) -> None:
    nv.devices[0].architecture = code
    assert NVMLGPU(0, nv).get_architecture() == name


def test_unknown_architecture_probes_energy_counter(nv: FakeNVML) -> None:
    nv.devices[0].architecture = 0xFFFFFFFF
    nv.devices[1].architecture = 0xFFFFFFFF
    assert NVMLGPU(0, nv).supports_energy_counter()
    assert not NVMLGPU(1, nv).supports_energy_counter()


def test_architecture_call_unsupported(nv: FakeNVML) -> None:
    nv.inject_error("nvmlDeviceGetArchitecture", fake.NVML_ERROR_NOT_SUPPORTED)
    gpu = NVMLGPU(0, nv)
    assert gpu.get_architecture() == "unknown"
    assert gpu.supports_energy_counter()  # probed


def test_static_facts_are_cached(nv: FakeNVML, gpu: NVMLGPU) -> None:
    for _ in range(3):
        gpu.get_name()
        gpu.get_power_limit_constraints_w()
        gpu.get_supported_graphics_clocks_mhz()
    assert len(nv.called("nvmlDeviceGetName")) == 1
    assert len(nv.called("nvmlDeviceGetPowerManagementLimitConstraints")) == 1
    assert len(nv.called("nvmlDeviceGetSupportedGraphicsClocks")) == 1


def test_info(gpu: NVMLGPU, old_gpu: NVMLGPU) -> None:
    info = gpu.info()
    assert info == GPUInfo(
        index=0,
        uuid=gpu.get_uuid(),
        name="NVIDIA A40",
        architecture="ampere",
        min_power_limit_w=100,
        max_power_limit_w=300,
        default_power_limit_w=300,
        supported_memory_clocks_mhz=(7251, 405),
        supported_graphics_clocks_mhz=tuple(fake.A40_GRAPHICS_CLOCKS_MHZ),
        has_energy_counter=True,
    )
    old = old_gpu.info()
    assert (old.architecture, old.has_energy_counter) == ("pascal", False)
    assert (old.min_power_limit_w, old.max_power_limit_w) == (126, 250)


# --- Power limit ------------------------------------------------------------------------------


def test_power_limit_constraints_round_inward(gpu: NVMLGPU, old_gpu: NVMLGPU) -> None:
    assert gpu.get_power_limit_constraints_w() == (100, 300)
    assert old_gpu.get_power_limit_constraints_w() == (126, 250)  # 125.5 W -> 126 W


def test_power_limit_round_trip_in_mw(nv: FakeNVML, gpu: NVMLGPU) -> None:
    assert gpu.get_default_power_limit_w() == 300
    assert gpu.get_power_limit_w() == 300
    gpu.set_power_limit_w(175)
    assert nv.called("nvmlDeviceSetPowerManagementLimit") == [(175_000,)]
    assert nv.devices[0].limit_mw == 175_000
    assert gpu.get_power_limit_w() == 175
    gpu.reset_power_limit()
    assert nv.devices[0].limit_mw == 300_000
    assert gpu.get_power_limit_w() == 300


def test_power_limit_edges_are_settable(nv: FakeNVML, old_gpu: NVMLGPU) -> None:
    old_gpu.set_power_limit_w(126)
    old_gpu.set_power_limit_w(250)
    assert nv.called("nvmlDeviceSetPowerManagementLimit") == [(126_000,), (250_000,)]


@pytest.mark.parametrize("bad_w", [99, 301, 0, -5])
def test_power_limit_out_of_range_never_reaches_nvml(
    nv: FakeNVML, gpu: NVMLGPU, bad_w: int
) -> None:
    with pytest.raises(GPUValueError) as info:
        gpu.set_power_limit_w(bad_w)
    assert f"{bad_w} W" in str(info.value)
    assert "[100, 300] W" in str(info.value)
    assert nv.called("nvmlDeviceSetPowerManagementLimit") == []


@pytest.mark.parametrize("bad", [250.5, True, "250"])
def test_power_limit_must_be_int(nv: FakeNVML, gpu: NVMLGPU, bad: object) -> None:
    with pytest.raises(GPUValueError, match="integer"):
        gpu.set_power_limit_w(bad)  # type: ignore[arg-type]
    assert nv.called("nvmlDeviceSetPowerManagementLimit") == []


def test_power_limit_rounds_odd_mw(nv: FakeNVML, gpu: NVMLGPU) -> None:
    nv.devices[0].limit_mw = 250_600
    assert gpu.get_power_limit_w() == 251


# --- Clocks ------------------------------------------------------------------------------------


def test_supported_clocks_highest_first(gpu: NVMLGPU) -> None:
    assert list(gpu.get_supported_memory_clocks_mhz()) == [7251, 405]
    graphics = list(gpu.get_supported_graphics_clocks_mhz())
    assert graphics[0] == 1740 and graphics[-1] == 210
    assert graphics == sorted(graphics, reverse=True)
    assert gpu.get_supported_graphics_clocks_mhz(405)[0] == 420


def test_supported_graphics_clocks_bad_memory_clock(nv: FakeNVML, gpu: NVMLGPU) -> None:
    with pytest.raises(GPUValueError, match="1234 MHz"):
        gpu.get_supported_graphics_clocks_mhz(1234)
    assert nv.called("nvmlDeviceGetSupportedGraphicsClocks") == []


def test_lock_and_reset_sm_clocks(nv: FakeNVML, gpu: NVMLGPU) -> None:
    gpu.lock_sm_clocks_mhz(1200, 1500)
    assert nv.called("nvmlDeviceSetGpuLockedClocks") == [(1200, 1500)]
    assert nv.devices[0].locked_clocks_mhz == (1200, 1500)
    assert gpu.get_sm_clock_mhz() == 1500
    gpu.reset_sm_clocks()
    assert nv.devices[0].locked_clocks_mhz is None
    assert nv.called("nvmlDeviceResetGpuLockedClocks") == [()]


@pytest.mark.parametrize(
    ("lo", "hi", "needle"),
    [
        (1201, 1500, "1201"),
        (1200, 1750, "1750"),
        (1500, 1200, "above"),
    ],
)
def test_lock_sm_clocks_validation(
    nv: FakeNVML, gpu: NVMLGPU, lo: int, hi: int, needle: str
) -> None:
    with pytest.raises(GPUValueError, match=needle):
        gpu.lock_sm_clocks_mhz(lo, hi)
    assert nv.called("nvmlDeviceSetGpuLockedClocks") == []


def test_current_clocks(nv: FakeNVML, gpu: NVMLGPU) -> None:
    assert gpu.get_sm_clock_mhz() == 1740
    assert gpu.get_memory_clock_mhz() == 7251
    assert nv.called("nvmlDeviceGetClockInfo") == [(fake.NVML_CLOCK_SM,), (fake.NVML_CLOCK_MEM,)]


# --- Energy and power ----------------------------------------------------------------------------


def test_energy_and_power_conversions(nv: FakeNVML, gpu: NVMLGPU) -> None:
    assert gpu.get_total_energy_j() == pytest.approx(123_456.789)
    assert gpu.get_power_w() == pytest.approx(250.5)
    assert gpu.get_instant_power_w() == pytest.approx(263.25)
    assert nv.called("nvmlDeviceGetFieldValues") == [([fake.NVML_FI_DEV_POWER_INSTANT],)]


def test_instant_power_falls_back_per_field(nv: FakeNVML, old_gpu: NVMLGPU) -> None:
    assert old_gpu.get_instant_power_w() == pytest.approx(30.0)
    assert old_gpu.get_instant_power_w() == pytest.approx(30.0)
    assert len(nv.called("nvmlDeviceGetFieldValues")) == 1  # not asked again
    assert len(nv.called("nvmlDeviceGetPowerUsage")) == 2


def test_instant_power_falls_back_when_call_unsupported(nv: FakeNVML, gpu: NVMLGPU) -> None:
    nv.inject_error("nvmlDeviceGetFieldValues", fake.NVML_ERROR_FUNCTION_NOT_FOUND)
    assert gpu.get_instant_power_w() == pytest.approx(250.5)


def test_instant_power_other_errors_propagate(nv: FakeNVML, gpu: NVMLGPU) -> None:
    nv.inject_error("nvmlDeviceGetFieldValues", fake.NVML_ERROR_GPU_IS_LOST)
    with pytest.raises(GPUUnavailableError):
        gpu.get_instant_power_w()


class FakeClock:
    def __init__(self, times_s: list[float]) -> None:
        self._times_ns = [int(t * 1e9) for t in times_s]

    def __call__(self) -> int:
        return self._times_ns.pop(0)


def test_pre_volta_energy_integrates_polled_power(nv: FakeNVML) -> None:
    # Trace (s, W): (0, 100) (1, 200) (2, 200) (4, 50) (4.5, 50)
    # Trapezoids:        150  +  200  +  250  +  25  = 625 J
    clock = FakeClock([0.0, 1.0, 2.0, 4.0, 4.5])
    gpu = NVMLGPU(1, nv, clock_ns=clock)
    device = nv.devices[1]
    steps = [
        (100_000, "energy", 0.0),
        (200_000, "power", None),
        (200_000, "energy", 350.0),
        (50_000, "power", None),
        (50_000, "energy", 625.0),
    ]
    for power_mw, method, expected_j in steps:
        device.power_mw = power_mw
        if method == "power":
            assert gpu.get_power_w() == power_mw / 1000
        else:
            assert gpu.get_total_energy_j() == pytest.approx(expected_j)
    assert nv.called("nvmlDeviceGetTotalEnergyConsumption") == []


def test_volta_and_newer_do_not_integrate(nv: FakeNVML) -> None:
    gpu = NVMLGPU(0, nv, clock_ns=FakeClock([]))  # would raise if the clock were read
    gpu.get_power_w()
    assert gpu.get_total_energy_j() == pytest.approx(123_456.789)


# --- Persistence mode ----------------------------------------------------------------------------


def test_persistence_mode_round_trip(nv: FakeNVML, gpu: NVMLGPU) -> None:
    assert gpu.get_persistence_mode() is False
    gpu.set_persistence_mode(True)
    assert nv.devices[0].persistence == fake.NVML_FEATURE_ENABLED
    assert gpu.get_persistence_mode() is True
    gpu.set_persistence_mode(False)
    assert nv.called("nvmlDeviceSetPersistenceMode") == [(1,), (0,)]


# --- Error map -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "exc_type"),
    [
        (fake.NVML_ERROR_NO_PERMISSION, GPUPermissionError),
        (fake.NVML_ERROR_NOT_SUPPORTED, GPUNotSupportedError),
        (fake.NVML_ERROR_INVALID_ARGUMENT, GPUValueError),
        (fake.NVML_ERROR_GPU_IS_LOST, GPUUnavailableError),
        (fake.NVML_ERROR_UNINITIALIZED, GPUUnavailableError),
        (fake.NVML_ERROR_DRIVER_NOT_LOADED, GPUUnavailableError),
        (fake.NVML_ERROR_TIMEOUT, GPUUnavailableError),
        (fake.NVML_ERROR_RESET_REQUIRED, GPUUnavailableError),
        (fake.NVML_ERROR_UNKNOWN, GPUError),
        (fake.NVML_ERROR_IN_USE, GPUError),
    ],
)
def test_error_map(nv: FakeNVML, gpu: NVMLGPU, code: int, exc_type: type[GPUError]) -> None:
    nv.inject_error("nvmlDeviceSetPowerManagementLimit", code)
    with pytest.raises(GPUError) as info:
        gpu.set_power_limit_w(200)
    assert type(info.value) is exc_type
    assert "nvmlDeviceSetPowerManagementLimit on GPU 0" in str(info.value)
    assert f"code {code}" in str(info.value)
    assert isinstance(info.value.__cause__, fake.NVMLError)
    assert info.value.__cause__.value == code


def test_permission_error_says_how_to_fix(nv: FakeNVML, gpu: NVMLGPU) -> None:
    nv.inject_error("nvmlDeviceSetGpuLockedClocks", fake.NVML_ERROR_NO_PERMISSION)
    with pytest.raises(GPUPermissionError) as info:
        gpu.lock_sm_clocks_mhz(1200, 1500)
    message = str(info.value)
    for needle in (
        "CAP_SYS_ADMIN",
        "root",
        "setcap",
        "--cap-add SYS_ADMIN",
        "https://ml.energy/zeus/getting_started/#system-privileges",
        "GPU 0",
    ):
        assert needle in message


def test_error_injection_targets_one_gpu_and_count(nv: FakeNVML) -> None:
    gpus = nvml_gpus(nvml=nv)
    nv.inject_error("nvmlDeviceGetPowerUsage", fake.NVML_ERROR_GPU_IS_LOST, index=1, times=1)
    assert gpus[0].get_power_w() == pytest.approx(250.5)
    with pytest.raises(GPUUnavailableError, match="GPU 1"):
        gpus[1].get_power_w()
    assert gpus[1].get_power_w() == pytest.approx(30.0)


def test_uninitialised_nvml_is_unavailable(nv: FakeNVML) -> None:
    gpu = NVMLGPU(0, nv)
    nv.nvmlShutdown()
    with pytest.raises(GPUUnavailableError, match="nvmlDeviceGetPowerUsage on GPU 0"):
        gpu.get_power_w()


# --- PowerIntegrator (pure) ---------------------------------------------------------------------


def test_integrator_known_trace() -> None:
    integrator = PowerIntegrator()
    trace = [
        (0, 10.0, 0.0),
        (500_000_000, 30.0, 10.0),
        (1_500_000_000, 30.0, 40.0),
        (1_500_000_000, 0.0, 40.0),
        (3_500_000_000, 0.0, 40.0),
    ]
    for t_ns, power_w, expected_j in trace:
        assert integrator.add(t_ns, power_w) == pytest.approx(expected_j)
    assert integrator.samples == 5
    integrator.reset()
    assert integrator.add(10, 100.0) == 0.0


@pytest.mark.parametrize(
    ("t_ns", "power_w", "needle"), [(5, 1.0, "time order"), (20, -1.0, "non-negative")]
)
def test_integrator_rejects_bad_samples(t_ns: int, power_w: float, needle: str) -> None:
    integrator = PowerIntegrator()
    integrator.add(10, 1.0)
    with pytest.raises(ValueError, match=needle):
        integrator.add(t_ns, power_w)


def test_integrator_is_pure() -> None:
    tree = ast.parse(inspect.getsource(power_integrator))
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__"}
