"""PFOServerSettings (ZEUS_PFO_* env, scheduler args check) and the scheduler name registry."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from pydantic_settings import SettingsError

from coordinator.pipeline.schedulers import (
    SchedulerError,
    make_3d_parallel,
)
from coordinator.pipeline.schedulers import registry as names
from coordinator.pipeline.schedulers.instruction_profiler import (
    InstructionProfiler,
    InstructionProfiler3D,
)
from coordinator.pipeline.schedulers.perseus import Perseus, Perseus3D
from coordinator.pipeline.schedulers.point_solution import PointSolution, PointSolution3D
from coordinator.pipeline.schedulers.registry import register_scheduler, resolve_scheduler
from coordinator.pipeline.schedulers.settings import PFOServerSettings
from tests.core.scheduler_kit import Constant
from zeus_agent.models import JobInfo, RankInfo

ZEUS_PATH = "zeus.optimizer.pipeline_frequency.server.scheduler"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.upper().startswith("ZEUS_PFO_"):
            monkeypatch.delenv(key)


@pytest.fixture(autouse=True)
def restore_registry() -> Iterator[None]:
    saved = dict(names.SCHEDULERS)
    yield
    names.SCHEDULERS.clear()
    names.SCHEDULERS.update(saved)


@pytest.fixture
def plan(tmp_path: Path) -> str:
    path = tmp_path / "freqs_pipeline_00000.py"
    path.write_text(
        repr([[("forward", 1410), ("backward", 1410)], [("forward", 1200), ("backward", 1200)]])
    )
    return str(path)


def errors(info: pytest.ExceptionInfo[ValidationError]) -> str:
    return "\n".join(str(e["msg"]) for e in info.value.errors())


# --- Fields, defaults, environment ----------------------------------------------------------


def test_defaults_as_zeus(plan: str) -> None:
    s = PFOServerSettings(scheduler_args={"solution_path": plan})
    assert s.scheduler == "PointSolution"
    assert s.scheduler_class is PointSolution
    assert s.log_level == "DEBUG"
    assert s.dump_data is True
    assert s.dump_dir == "./dump"
    assert s.max_job_idle_time == 60 * 60 * 24 * 7


def test_default_point_solution_needs_a_solution_path() -> None:
    # The default scheduler's args are checked too: the error comes at start, not at a job.
    with pytest.raises(ValidationError) as info:
        PFOServerSettings()
    assert errors(info) == (
        "Value error, Invalid scheduler args for PointSolution: missing a required argument: "
        "'solution_path'; PointSolution takes solution_path (required)"
    )


def test_environment_variables(monkeypatch: pytest.MonkeyPatch, plan: str) -> None:
    monkeypatch.setenv("ZEUS_PFO_SCHEDULER", "PointSolution3D")
    monkeypatch.setenv("ZEUS_PFO_SCHEDULER_ARGS", json.dumps({"solution_path": plan}))
    monkeypatch.setenv("ZEUS_PFO_LOG_LEVEL", "info")
    monkeypatch.setenv("ZEUS_PFO_DUMP_DATA", "false")
    monkeypatch.setenv("ZEUS_PFO_DUMP_DIR", "/tmp/pfo-dump")
    monkeypatch.setenv("ZEUS_PFO_MAX_JOB_IDLE_TIME", "3600")
    monkeypatch.setenv("ZEUS_PFO_NATS_URL", "nats://elsewhere:4222")  # Another's: ignored.
    s = PFOServerSettings()
    assert s.scheduler == "PointSolution3D"
    assert s.scheduler_class is PointSolution3D
    assert s.scheduler_args == {"solution_path": plan}
    assert s.log_level == "INFO"
    assert s.dump_data is False
    assert s.dump_dir == "/tmp/pfo-dump"
    assert s.max_job_idle_time == 3600


def test_environment_scheduler_args_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZEUS_PFO_SCHEDULER_ARGS", '{"solution_path": "p.py", "warmup": 3}')
    with pytest.raises(ValidationError) as info:
        PFOServerSettings()
    assert (
        "Invalid scheduler args for PointSolution: got an unexpected keyword argument "
        "'warmup'; PointSolution takes solution_path (required)" in errors(info)
    )


def test_environment_scheduler_args_must_be_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZEUS_PFO_SCHEDULER_ARGS", "solution_path=p.py")
    with pytest.raises(SettingsError, match="scheduler_args"):
        PFOServerSettings()


def test_log_level_upper_cased_and_checked(plan: str) -> None:
    args = {"solution_path": plan}
    assert PFOServerSettings(log_level="warning", scheduler_args=args).log_level == "WARNING"
    with pytest.raises(ValidationError, match="unknown log level 'loud'"):
        PFOServerSettings(log_level="loud", scheduler_args=args)


def test_max_job_idle_time_positive(plan: str) -> None:
    with pytest.raises(ValidationError, match="max_job_idle_time"):
        PFOServerSettings(max_job_idle_time=0, scheduler_args={"solution_path": plan})


# --- Scheduler names and args ---------------------------------------------------------------


def test_unknown_scheduler_lists_the_known_names() -> None:
    with pytest.raises(ValidationError) as info:
        PFOServerSettings(scheduler="Perseus9000", scheduler_args={"solution_path": "p"})
    message = errors(info)
    assert "unknown scheduler 'Perseus9000'; known schedulers: " in message
    assert "PointSolution, PointSolution3D" in message
    # The args are not checked against a scheduler that does not exist (one error only).
    assert len(info.value.errors()) == 1


def test_zeus_full_path_is_accepted_by_its_last_component(plan: str) -> None:
    s = PFOServerSettings(
        scheduler=f"{ZEUS_PATH}.PointSolution3D", scheduler_args={"solution_path": plan}
    )
    assert s.scheduler == "PointSolution3D"
    assert s.scheduler_class is PointSolution3D
    assert resolve_scheduler(f"{ZEUS_PATH}.PointSolution") is PointSolution


def test_other_import_paths_are_not_loaded() -> None:
    with pytest.raises(SchedulerError) as info:
        resolve_scheduler("os.system")
    assert "import paths other than Zeus's are not loaded" in str(info.value)
    assert "known schedulers: " in str(info.value)
    assert "PointSolution, PointSolution3D" in str(info.value)
    with pytest.raises(SchedulerError, match="unknown scheduler"):
        resolve_scheduler("mypkg.PointSolution")


def test_3d_scheduler_args_are_checked_against_the_wrapped_constructor() -> None:
    # Zeus's wrapper takes **kwargs, so Zeus's check accepts anything for 3D schedulers.
    with pytest.raises(ValidationError) as info:
        PFOServerSettings(scheduler="PointSolution3D", scheduler_args={"path": "p.py"})
    assert (
        "Invalid scheduler args for PointSolution3D: missing a required argument: "
        "'solution_path'; PointSolution3D takes solution_path (required)" in errors(info)
    )


def test_reserved_args_are_refused() -> None:
    with pytest.raises(ValidationError) as info:
        PFOServerSettings(scheduler_args={"solution_path": "p", "job_info": {}})
    assert "Invalid scheduler args for PointSolution: job_info given by the coordinator" in errors(
        info
    )


def test_create_scheduler(plan: str) -> None:
    s = PFOServerSettings(scheduler="PointSolution", scheduler_args={"solution_path": plan})
    infos = [
        RankInfo(rank=r, dp_rank=0, pp_rank=r, tp_rank=0, available_frequencies=[])
        for r in range(2)
    ]
    sched = s.create_scheduler(JobInfo(pp_degree=2, dp_degree=1, tp_degree=1, world_size=2), infos)
    assert isinstance(sched, PointSolution)
    assert sched.pfo_settings is s
    assert [x.frequencies[0] for x in sched.next_schedule()] == [
        ("forward", 1410),
        ("forward", 1200),
    ]


# --- The registry ---------------------------------------------------------------------------


def test_register_and_resolve() -> None:
    register_scheduler("Constant", Constant)
    register_scheduler("Constant", Constant)  # Idempotent.
    assert resolve_scheduler("Constant") is Constant
    assert resolve_scheduler(f"{ZEUS_PATH}.Constant") is Constant
    s = PFOServerSettings(scheduler="Constant", scheduler_args={"frequency": 1410})
    assert s.scheduler_class is Constant
    with pytest.raises(ValidationError) as info:
        PFOServerSettings(scheduler="Constant", scheduler_args={"freq": 1410})
    assert "Constant takes frequency (required), warmup_iters=2" in errors(info)


def test_register_refuses_conflicts_and_non_schedulers() -> None:
    with pytest.raises(SchedulerError, match="already taken by coordinator.pipeline"):
        register_scheduler("PointSolution", Constant)
    with pytest.raises(SchedulerError, match="must be a Python identifier"):
        register_scheduler("a.b", Constant)
    with pytest.raises(SchedulerError, match="is not a FrequencyScheduler subclass"):
        register_scheduler("Dict", dict)  # type: ignore[arg-type]


def test_the_registry_is_an_explicit_table_of_the_shipped_schedulers() -> None:
    assert dict(names.BUILTIN) == {
        "PointSolution": PointSolution, "PointSolution3D": PointSolution3D,
        "InstructionProfiler": InstructionProfiler,
        "InstructionProfiler3D": InstructionProfiler3D,
        "Perseus": Perseus, "Perseus3D": Perseus3D,
    }
    assert names.known_schedulers() == sorted(names.BUILTIN)
    assert all(cls.__name__ == name for name, cls in names.BUILTIN.items())
    with pytest.raises(TypeError):
        names.BUILTIN["Other"] = PointSolution  # type: ignore[index]


def test_importing_a_module_registers_nothing(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Only `register_scheduler`, called, adds a name: a module defining a scheduler does not."""
    module = "defines_a_sched_for_test"
    (tmp_path / f"{module}.py").write_text(
        "from coordinator.pipeline.schedulers import make_3d_parallel\n"
        "from tests.core.scheduler_kit import Constant\n"
        "Lazy3D = make_3d_parallel(Constant, 'Lazy3D')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        before = dict(names.SCHEDULERS)
        imported = __import__(module)
        assert before == names.SCHEDULERS
        with pytest.raises(SchedulerError, match="unknown scheduler 'Lazy3D'"):
            resolve_scheduler("Lazy3D")
        register_scheduler("Lazy3D", imported.Lazy3D)
        assert resolve_scheduler("Lazy3D") is imported.Lazy3D
    finally:
        sys.modules.pop(module, None)


def test_a_user_path_names_how_to_register() -> None:
    with pytest.raises(SchedulerError,
                       match="coordinator.pipeline.schedulers.registry.register_scheduler"):
        resolve_scheduler("mypackage.schedulers.Mine")


def test_make_3d_parallel_of_a_registered_class_keeps_its_args() -> None:
    register_scheduler("Constant3D", make_3d_parallel(Constant, "Constant3D"))
    s = PFOServerSettings(scheduler="Constant3D", scheduler_args={"frequency": 1005})
    assert s.scheduler_class.__name__ == "Constant3D"


# --- The coordinator's settings: Zeus configurations start -----------------------------------


def coordinator_settings(**values: Any) -> Any:
    from coordinator.config import CoordinatorSettings

    return CoordinatorSettings(**values)


def test_a_zeus_configuration_naming_only_a_plan_runs_point_solution(
    monkeypatch: pytest.MonkeyPatch, plan: str
) -> None:
    # Zeus 0.16: ZEUS_PFO_SCHEDULER unset is PointSolution, which the plan is for.
    monkeypatch.setenv("ZEUS_PFO_SCHEDULER_ARGS", json.dumps({"solution_path": plan}))
    s = coordinator_settings()
    assert s.scheduler == "PointSolution"
    assert s.pfo_settings().scheduler_class is PointSolution
    assert s.pfo_settings().scheduler_args == {"solution_path": plan}
    assert s.scheduler_note == (
        "no scheduler named and scheduler_args hold a solution_path: running PointSolution "
        "(Zeus 0.16's default) on that plan")


def test_a_plan_given_by_flag_runs_point_solution_too(plan: str) -> None:
    from pydantic_settings import CliApp

    from coordinator.config import CoordinatorSettings

    s = CliApp.run(CoordinatorSettings,
                   cli_args=["--scheduler-args", json.dumps({"solution_path": plan})])
    assert s.scheduler == "PointSolution"
    assert s.scheduler_note is not None


def test_a_named_scheduler_is_kept_whatever_its_args(
    monkeypatch: pytest.MonkeyPatch, plan: str
) -> None:
    monkeypatch.setenv("ZEUS_PFO_SCHEDULER_ARGS", json.dumps({"solution_path": plan}))
    monkeypatch.setenv("ZEUS_PFO_SCHEDULER", "PointSolution3D")
    s = coordinator_settings()
    assert (s.scheduler, s.scheduler_note) == ("PointSolution3D", None)
    # Naming the default explicitly is naming it: its args are checked against it.
    monkeypatch.setenv("ZEUS_PFO_SCHEDULER", "InstructionProfiler")
    with pytest.raises(ValidationError, match="unexpected keyword argument 'solution_path'"):
        coordinator_settings()


def test_without_a_plan_the_default_is_instruction_profiler() -> None:
    s = coordinator_settings()
    assert (s.scheduler, s.scheduler_note) == ("InstructionProfiler", None)
    s = coordinator_settings(scheduler_args={"clocks": 4})
    assert (s.scheduler, s.scheduler_note) == ("InstructionProfiler", None)


@pytest.mark.parametrize(
    ("given", "level"),
    [("warn", "WARN"), ("fatal", "FATAL"), ("notset", "NOTSET"), ("NotSet", "NOTSET"),
     ("Warning", "WARNING"), ("debug", "DEBUG"), (" info ", "INFO"), ("CRITICAL", "CRITICAL")],
)
def test_log_levels_python_accepts_are_accepted(
    monkeypatch: pytest.MonkeyPatch, plan: str, given: str, level: str
) -> None:
    # Zeus upper-cases ZEUS_PFO_LOG_LEVEL and logging takes any name it knows.
    monkeypatch.setenv("ZEUS_PFO_LOG_LEVEL", given)
    assert coordinator_settings().log_level == level
    assert PFOServerSettings(scheduler_args={"solution_path": plan}).log_level == level
    assert level in logging.getLevelNamesMapping()  # What logging.basicConfig(level=) takes.


def test_unknown_log_levels_are_refused_listing_the_known(
    monkeypatch: pytest.MonkeyPatch, plan: str
) -> None:
    monkeypatch.setenv("ZEUS_PFO_LOG_LEVEL", "loud")
    known = "CRITICAL, FATAL, ERROR, WARN, WARNING, INFO, DEBUG, NOTSET"
    with pytest.raises(ValidationError, match=f"log_level must be one of {known} "
                                              r"\(any case\), got 'loud'"):
        coordinator_settings()
    with pytest.raises(ValidationError, match=f"unknown log level 'loud'; use one of {known}"):
        PFOServerSettings(scheduler_args={"solution_path": plan})
