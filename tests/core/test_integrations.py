"""zeus_agent.integrations (ZeusMonitor, GlobalPowerLimitOptimizer, HF callback) on a fake agent."""

from __future__ import annotations

import logging
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.core.emit_kit import FakeAgent, default_handler
from zeus_agent import emit
from zeus_agent.integrations import (
    GlobalPowerLimitOptimizer,
    Measurement,
    ZeusMonitor,
    power_limit_options,
)
from zeus_agent.models import PowerLimitMeasurement
from zeus_agent.wire.codec import validate
from zeus_agent.wire.messages import PowerLimitOptions, RegisterJob, RegisterRank, Reply
from zeus_agent.wire.trainer import Kind, RequestDatagram, WindowRequest

pytestmark = pytest.mark.usefixtures("clean_emit")


# Zeus's selectors, as far as the mapping looks at them (class name and attributes).
class Energy:
    pass


class Time:
    pass


class ZeusCost:
    def __init__(self, eta_knob: float, world_size: int = 1) -> None:
        self.eta_knob = eta_knob
        self.world_size = world_size


class MaxSlowdownConstraint:
    def __init__(self, factor: float) -> None:
        self.factor = factor


for _zeus_class in (Energy, Time, ZeusCost, MaxSlowdownConstraint):
    _zeus_class.__module__ = "zeus.optimizer.power_limit"  # where Zeus 0.16 defines them


class MySelector:
    pass


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    fake = FakeAgent(str(tmp_path / "agent.sock"))
    monkeypatch.setenv(emit.ENV_SOCKET, fake.path)
    yield fake
    fake.stop()


# ----------------------------------------------------------------------------- options
@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        (None, {"selector": "ZeusCost", "eta_knob": 0.5, "world_size": None}),
        (Energy(), {"selector": "Energy"}),
        (Time(), {"selector": "Time"}),
        (ZeusCost(0.3, world_size=4), {"selector": "ZeusCost", "eta_knob": 0.3, "world_size": 4}),
        (MaxSlowdownConstraint(1.25), {"selector": "MaxSlowdownConstraint", "max_slowdown": 1.25}),
    ],
)
def test_selector_mapping(selector: object, expected: dict) -> None:
    options = power_limit_options(selector)
    assert options.model_dump(include=set(expected)) == expected


def test_a_users_own_selector_is_run_by_rank_0() -> None:
    """Zeus: "Users can inherit from OptimumSelector to implement their custom optimum
    selector": any other selector (even one named like a built-in) is the user's own."""
    from zeus_agent.integrations import OptimumSelector

    class Cheapest(OptimumSelector):
        def select(self, measurements: list[PowerLimitMeasurement]) -> int:
            return min(measurements, key=lambda m: m.energy * m.time).power_limit

    class Energy(Cheapest):  # a user's class that shares a built-in's name
        pass

    for selector in (Cheapest(), Energy()):
        options = power_limit_options(selector)
        assert options.selector == "Custom"
        assert options.custom_selector == repr(selector)


def test_the_drop_in_runs_the_users_selector_and_says_why_it_failed() -> None:
    from zeus_agent.integrations import OptimumSelector
    from zeus_agent.integrations.power_limit import choose
    from zeus_agent.wire.trainer import SelectRequest

    rows = [PowerLimitMeasurement(power_limit=w, energy=e, time=t)
            for w, e, t in ((300, 10.0, 1.0), (250, 8.0, 1.1), (200, 9.0, 1.5))]
    question = SelectRequest(job_id="j", request=3, measurements=rows)

    class Cheapest(OptimumSelector):
        def select(self, measurements: list[PowerLimitMeasurement]) -> int:
            return min(measurements, key=lambda m: m.energy * m.time).power_limit

    class Broken(OptimumSelector):
        def select(self, measurements: list[PowerLimitMeasurement]) -> int:
            raise ZeroDivisionError("oops")

    class Fractional(OptimumSelector):
        def select(self, measurements: list[PowerLimitMeasurement]) -> int:
            return 250.5  # type: ignore[return-value]

    assert choose(Cheapest(), question) == (250, "")
    assert choose(Broken(), question) == (
        None, "Broken.select raised ZeroDivisionError: oops")
    assert choose(Fractional(), question)[0] is None


def test_options_carry_the_arguments(tmp_path: Path) -> None:
    profile = [PowerLimitMeasurement(power_limit=200, energy=10.0, time=1.0)]
    options = power_limit_options(
        Time(), wait_steps=2, warmup_steps=0, profile_steps=5, pl_step=10, profile=profile,
    )  # fmt: skip
    assert (options.wait_steps, options.warmup_steps, options.profile_steps) == (2, 0, 5)
    assert options.pl_step_w == 10 and options.profile == profile
    assert "profile_path" not in PowerLimitOptions.model_fields  # never a path on the wire


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"wait_steps": -1}, "wait_steps must be non-negative"),
        ({"warmup_steps": -1}, "warmup_steps must be non-negative"),
        ({"profile_steps": 0}, "profile_steps must be positive"),
        ({"pl_step": 0}, "pl_step must be positive"),
        ({"optimum_selector": MySelector()}, "has no select\\(measurements\\) method"),
        ({"optimum_selector": ZeusCost(1.5)}, "invalid optimum_selector"),
        ({"optimum_selector": MaxSlowdownConstraint(0.5)}, "invalid optimum_selector"),
    ],
)
def test_argument_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GlobalPowerLimitOptimizer(SimpleNamespace(gpu_indices=[0]), **kwargs)


# ----------------------------------------------------------------------------- optimizer
def test_optimizer_registers_and_forwards(agent: FakeAgent) -> None:
    monitor = ZeusMonitor(gpu_indices=[0])
    plo = GlobalPowerLimitOptimizer(monitor, MaxSlowdownConstraint(1.1), warmup_steps=0)
    assert plo.job_id == "job-1"
    kinds = [r.kind for r in agent.requests]
    assert kinds == [Kind.REGISTER_JOB, Kind.HELLO, Kind.REGISTER_RANK]
    job = validate(RegisterJob, agent.requests[0].payload)
    assert (job.job.dp_degree, job.job.pp_degree, job.job.tp_degree, job.job.world_size) == (
        1, 1, 1, 1,
    )  # fmt: skip
    assert job.power_limit is not None
    assert job.power_limit.selector == "MaxSlowdownConstraint"
    assert job.power_limit.warmup_steps == 0
    rank = validate(RegisterRank, agent.requests[2].payload)
    assert (rank.rank_info.rank, rank.gpu.gpu_index) == (0, 0)

    for _ in range(2):
        plo.on_epoch_begin()
        for _ in range(3):
            plo.on_step_begin()
            plo.on_step_end()
        plo.on_epoch_end()
    events = agent.wait_events(8, plo.publisher)
    assert [(e.kind, e.a, e.b) for e in events] == [
        (Kind.STEP_BEGIN, 0, 0), (Kind.STEP_BEGIN, 1, 0), (Kind.STEP_BEGIN, 2, 0),
        (Kind.EPOCH_END, 0, 0),
        (Kind.STEP_BEGIN, 3, 1), (Kind.STEP_BEGIN, 4, 1), (Kind.STEP_BEGIN, 5, 1),
        (Kind.EPOCH_END, 1, 0),
    ]  # fmt: skip


def test_optimizer_uses_local_rank_gpu_of_a_wide_monitor(agent: FakeAgent, monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "2")
    plo = GlobalPowerLimitOptimizer(ZeusMonitor(gpu_indices=[0, 1, 2, 3]))
    rank = validate(RegisterRank, agent.requests[2].payload)
    assert rank.gpu.gpu_index == 2
    assert plo.publisher.gpu_indices == [0, 1, 2, 3]


def test_optimizer_without_agent_warns_and_continues(tmp_path: Path, monkeypatch, caplog) -> None:
    monkeypatch.setenv(emit.ENV_SOCKET, str(tmp_path / "nobody.sock"))
    with caplog.at_level(logging.WARNING):
        plo = GlobalPowerLimitOptimizer(SimpleNamespace(gpu_indices=[0]))
    assert plo.job_id is None
    assert "without power-limit optimisation" in caplog.text
    plo.on_step_begin()
    plo.on_epoch_end()
    assert plo.publisher.stats().dropped == 2


@pytest.mark.parametrize(("code", "raises"), [("unavailable", False), ("bad_request", True)])
def test_optimizer_coordinator_errors(tmp_path: Path, monkeypatch, code: str, raises: bool) -> None:
    def handler(req: RequestDatagram) -> Reply | None:
        if req.kind is Kind.REGISTER_JOB:
            return Reply.failure(code, "coordinator says no")
        return default_handler(req)

    fake = FakeAgent(str(tmp_path / "agent.sock"), handler)
    monkeypatch.setenv(emit.ENV_SOCKET, fake.path)
    try:
        if raises:
            with pytest.raises(emit.RegistrationError, match="coordinator says no"):
                GlobalPowerLimitOptimizer(SimpleNamespace(gpu_indices=[0]))
        else:
            plo = GlobalPowerLimitOptimizer(SimpleNamespace(gpu_indices=[0]))
            assert plo.job_id is None
            plo.on_step_begin()
    finally:
        fake.stop()


def test_hf_callback_forwards_events(agent: FakeAgent, tmp_path: Path) -> None:
    from transformers import TrainerCallback
    from transformers.trainer_callback import CallbackHandler, TrainerControl, TrainerState

    from zeus_agent.integrations import HFGlobalPowerLimitOptimizer

    plo = HFGlobalPowerLimitOptimizer(ZeusMonitor(gpu_indices=[0]), Energy(), warmup_steps=2)
    assert isinstance(plo, TrainerCallback)
    handler = CallbackHandler([plo], model=None, processing_class=None, optimizer=None,
                              lr_scheduler=None)  # fmt: skip
    args = SimpleNamespace(output_dir=str(tmp_path))
    state, control = TrainerState(), TrainerControl()
    handler.on_step_begin(args, state, control)
    handler.on_step_end(args, state, control)
    handler.on_step_begin(args, state, control)
    handler.on_epoch_end(args, state, control)
    events = agent.wait_events(3, plo.optimizer.publisher)
    assert [(e.kind, e.a) for e in events] == [
        (Kind.STEP_BEGIN, 0), (Kind.STEP_BEGIN, 1), (Kind.EPOCH_END, 0),
    ]  # fmt: skip
    assert validate(RegisterJob, agent.requests[0].payload).power_limit.selector == "Energy"


def test_integrations_import_without_transformers() -> None:
    code = (
        "import sys; import zeus_agent.integrations as i; "
        "assert 'transformers' not in sys.modules and 'torch' not in sys.modules; "
        "i.ZeusMonitor; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


# ----------------------------------------------------------------------------- monitor
def test_monitor_overlapping_windows(agent: FakeAgent, tmp_path: Path) -> None:
    log = tmp_path / "windows.csv"
    monitor = ZeusMonitor(gpu_indices=[0, 1], log_file=log)
    monitor.begin_window("a")
    monitor.begin_window("b")
    a = monitor.end_window("a")
    b = monitor.end_window("b")
    assert isinstance(a, Measurement)
    assert a.gpu_energy == b.gpu_energy == {0: 10.0, 1: 20.0}
    assert a.total_energy == 30.0
    wa, wb = (validate(WindowRequest, r.payload) for r in agent.wait_requests(Kind.WINDOW))
    assert wa.t0_ns < wb.t0_ns < wa.t1_ns < wb.t1_ns  # Overlapping, not nested.
    lines = log.read_text().splitlines()
    assert lines[0] == "start_time,window_name,elapsed_time,gpu0_energy,gpu1_energy"
    assert [line.split(",")[1] for line in lines[1:]] == ["a", "b"]


def test_monitor_errors_and_cancel(agent: FakeAgent) -> None:
    monitor = ZeusMonitor(gpu_indices=[0])
    with pytest.raises(ValueError, match="Measurement window 'x' does not exist"):
        monitor.end_window("x")
    monitor.begin_window("x")
    with pytest.raises(ValueError, match="Measurement window 'x' already exists"):
        monitor.begin_window("x")
    cancelled = monitor.end_window("x", cancel=True)
    # As Zeus: zero for each CPU measured (none seen yet here: {}), no DRAM.
    assert cancelled == Measurement(time=0.0, gpu_energy={0: 0.0}, cpu_energy={})
    assert not agent.wait_requests(Kind.WINDOW, timeout_s=0.05)


def test_monitor_default_gpus_follow_cuda_visible_devices(agent: FakeAgent, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    monitor = ZeusMonitor()
    assert monitor.gpu_indices == [0, 1]
    monitor.begin_window("w")
    assert monitor.end_window("w").gpu_energy == {0: 50.0, 1: 70.0}  # Physical GPUs 4 and 6.


def test_monitor_without_agent_is_nan(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(emit.ENV_SOCKET, str(tmp_path / "nobody.sock"))
    monitor = ZeusMonitor(gpu_indices=[0])
    monitor.begin_window("w")
    m = monitor.end_window("w")
    assert m.time >= 0 and math.isnan(m.gpu_energy[0])


def test_sync_cuda_failure_is_counted_not_raised(agent: FakeAgent) -> None:
    pub = emit.Publisher(socket_path=agent.path, sync_cuda=True)
    pub.step_begin()  # CPU-only torch: synchronize raises; the event still goes.
    assert agent.wait_events(1)[0].kind is Kind.STEP_BEGIN
    stats = pub.stats()
    assert stats.sent == 1
    if not _cuda_available():
        assert stats.sync_failures == 1
    pub.close()


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def test_the_hugging_face_callback_shows_zeus_signature() -> None:
    import inspect

    from zeus_agent.integrations import HFGlobalPowerLimitOptimizer

    hf = inspect.signature(HFGlobalPowerLimitOptimizer.__init__)
    plain = inspect.signature(GlobalPowerLimitOptimizer.__init__)
    assert hf == plain
    assert list(hf.parameters)[1:] == [
        "monitor", "optimum_selector", "wait_steps", "warmup_steps", "profile_steps", "pl_step",
        "profile_path",
    ]


# ----------------------------------------------------------------------------- profile_path
def test_profile_path_is_read_and_written_by_the_trainer(tmp_path: Path, monkeypatch) -> None:
    """Defect: `profile_path` was read and written on the coordinator's host. Now rank 0 sends
    the content of an existing file, and writes the profile the coordinator measured."""
    from zeus_agent.models import load_power_limit_profile, save_power_limit_profile
    from zeus_agent.wire.messages import JobQuery

    measured = [{"power_limit": 300, "energy": 1000.0, "time": 10.0},
                {"power_limit": 250, "energy": 800.0, "time": 10.5}]
    done = {"now": False}

    def handler(req: RequestDatagram) -> Reply | None:
        if req.kind is Kind.QUERY_JOB:
            assert validate(JobQuery, req.payload).job_id == "job-1"
            progress = {"optimal_power_limit_w": 250 if done["now"] else None,
                        "measurements": measured if done["now"] else measured[:1]}
            return Reply.success(job_id="job-1", power_limit=progress)
        return default_handler(req)

    fake = FakeAgent(str(tmp_path / "agent.sock"), handler)
    monkeypatch.setenv(emit.ENV_SOCKET, fake.path)
    try:
        path = tmp_path / "profiles" / "p.json"
        plo = GlobalPowerLimitOptimizer(ZeusMonitor(gpu_indices=[0]), Energy(), profile_path=path)
        job = validate(RegisterJob, fake.requests[0].payload)
        assert job.power_limit is not None and job.power_limit.profile is None
        assert job.power_limit.save_profile
        plo.on_epoch_end()  # still profiling: nothing written
        assert not path.exists()
        done["now"] = True
        plo.on_train_end()
        assert [m.model_dump() for m in load_power_limit_profile(path)] == measured
        queries = len(fake.wait_requests(Kind.QUERY_JOB))
        plo.on_epoch_end()  # written once, not asked again
        assert len([r for r in fake.requests if r.kind is Kind.QUERY_JOB]) == queries
        emit.close()

        # An existing file: its measurements go with the job, no profiling is asked back.
        fake.requests.clear()
        plo = GlobalPowerLimitOptimizer(ZeusMonitor(gpu_indices=[0]), Energy(), profile_path=path)
        job = validate(RegisterJob, fake.wait_requests(Kind.REGISTER_JOB)[0].payload)
        assert job.power_limit is not None and not job.power_limit.save_profile
        assert [m.model_dump() for m in job.power_limit.profile or []] == measured
        emit.close()

        # A broken file is the trainer's error, said clearly (Zeus would fail to load it too).
        path.write_text("{not json")
        with pytest.raises(ValueError, match="not a readable power-limit profile"):
            GlobalPowerLimitOptimizer(ZeusMonitor(gpu_indices=[0]), profile_path=path)
        save_power_limit_profile(path, [PowerLimitMeasurement(**measured[0])])
    finally:
        fake.stop()
