"""A drop-in for `zeus.optimizer.power_limit.GlobalPowerLimitOptimizer`, run by the coordinator.

The trainer only registers and reports: the coordinator runs the power-limit state machine
(Ready -> Warmup -> Profiling -> Done, per power limit) on rank 0's step and epoch events and
commands every GPU of the job through the agents. The trainer needs no SYS_ADMIN.

* `power_limit_options(...)`: Zeus's constructor arguments -> `PowerLimitOptions`; the optimum
  selector (ours from `zeus_agent.integrations` or Zeus's) is mapped by class name: `Energy`,
  `Time`, `ZeusCost` (`eta_knob`), `MaxSlowdownConstraint` (`factor`); any other
  `OptimumSelector` (a user's subclass, ours or Zeus's) is "Custom": when profiling ends the
  coordinator asks rank 0's process, whose drop-in runs the selector on the measured profile
  (Zeus's `PowerLimitMeasurement` objects for a Zeus selector) at its next step or epoch end.
* `GlobalPowerLimitOptimizer`: validates the arguments like Zeus, registers the job (rank 0)
  and this rank's GPU through `zeus_agent.emit`, and forwards `on_step_begin`/`on_epoch_end`.
  With no agent or coordinator, it warns and training runs unoptimised.

`profile_path` is the trainer's file, as in Zeus: if it exists, rank 0 reads it and sends the
measurements with the job (no profiling); otherwise, once profiling is over, rank 0 fetches the
measured profile from the coordinator (at an epoch end or the end of training, or when
`save_profile()` is called) and writes it there. The coordinator never sees the path.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

from zeus_agent import emit
from zeus_agent.integrations.registration import join_or_warn
from zeus_agent.models import (
    JobInfo,
    PowerLimitMeasurement,
    load_power_limit_profile,
    save_power_limit_profile,
)
from zeus_agent.wire.messages import JobQuery, PowerLimitOptions
from zeus_agent.wire.trainer import Kind, SelectRequest

logger = logging.getLogger(__name__)

DEFAULT_SELECTOR = "ZeusCost"
"""Selector used when none is given: Zeus's `ZeusCost(eta_knob=0.5)` (Zeus 0.16)."""

_SELECTOR_NAMES = ("Energy", "Time", "ZeusCost", "MaxSlowdownConstraint")
_BUILT_IN_MODULES = ("zeus_agent.selectors", "coordinator.power_limit.selectors",
                     "zeus.optimizer.power_limit")
"""Where the built-in selectors live: a class of that name elsewhere is a user's own."""


def power_limit_options(
    optimum_selector: Any = None,
    *,
    wait_steps: int = 1,
    warmup_steps: int = 10,
    profile_steps: int = 40,
    pl_step: int = 25,
    profile: list[PowerLimitMeasurement] | None = None,
    save_profile: bool = False,
) -> PowerLimitOptions:
    """Build the coordinator's `PowerLimitOptions` from Zeus's constructor arguments.

    Args:
        optimum_selector: An `Energy`, `Time`, `ZeusCost` or `MaxSlowdownConstraint`
            instance (ours or Zeus's), or any object with `select(measurements) -> int`
            (a subclass of `OptimumSelector`: run in rank 0's process); None =
            `ZeusCost(eta_knob=0.5)` as in Zeus.
        wait_steps: Steps to let pass before profiling (>= 0).
        warmup_steps: Warm-up steps per power limit (>= 0).
        profile_steps: Profiling steps per power limit (>= 1).
        pl_step: Stride between explored power limits (W, >= 1).
        profile: Measurements read from the trainer's profile file (profiling is skipped).
        save_profile: Whether the trainer will fetch the measured profile to write it.

    Raises:
        ValueError: An argument is out of range, or the selector has no `select` method.
    """
    if wait_steps < 0:
        raise ValueError(f"wait_steps must be non-negative, got {wait_steps}.")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be non-negative, got {warmup_steps}.")
    if profile_steps <= 0:
        raise ValueError(f"profile_steps must be positive, got {profile_steps}.")
    if pl_step <= 0:
        raise ValueError(f"pl_step must be positive (W), got {pl_step}.")
    fields: dict[str, Any] = {}
    if optimum_selector is None:
        fields["selector"] = DEFAULT_SELECTOR
    elif is_custom(optimum_selector):
        if not callable(getattr(optimum_selector, "select", None)):
            raise ValueError(
                f"optimum_selector {optimum_selector!r} has no select(measurements) method: "
                "inherit from zeus_agent.integrations.OptimumSelector (or Zeus's)")
        fields["selector"] = "Custom"
        fields["custom_selector"] = repr(optimum_selector)[:200]
    else:
        name = type(optimum_selector).__name__
        fields["selector"] = name
        if name == "ZeusCost":
            fields["eta_knob"] = float(optimum_selector.eta_knob)
            fields["world_size"] = int(optimum_selector.world_size)
        elif name == "MaxSlowdownConstraint":
            fields["max_slowdown"] = float(optimum_selector.factor)
    try:
        return PowerLimitOptions(
            wait_steps=wait_steps,
            warmup_steps=warmup_steps,
            profile_steps=profile_steps,
            pl_step_w=pl_step,
            profile=profile,
            save_profile=save_profile,
            **fields,
        )
    except ValueError as e:  # pydantic's ValidationError: a selector attribute out of range.
        raise ValueError(f"invalid optimum_selector {optimum_selector!r}: {e}") from None


def is_custom(selector: Any) -> bool:
    """Whether `selector` is a user's own (run in rank 0's process), not a built-in one."""
    cls = type(selector)
    return cls.__name__ not in _SELECTOR_NAMES or cls.__module__ not in _BUILT_IN_MODULES


def choose(selector: Any, question: SelectRequest) -> tuple[int | None, str]:
    """Run a user's selector on the measured profile: (limit, "") or (None, why not).

    A selector from Zeus gets Zeus's `PowerLimitMeasurement` objects, ours gets ours.
    """
    rows: list[Any] = list(question.measurements)
    if type(selector).__module__.split(".")[0] == "zeus" or any(
            c.__module__.startswith("zeus.") for c in type(selector).__mro__):
        try:
            from zeus.optimizer.power_limit import PowerLimitMeasurement as ZeusMeasurement

            rows = [ZeusMeasurement(**m.model_dump()) for m in question.measurements]
        except ImportError:
            pass
    try:
        chosen = selector.select(rows)
    except Exception as e:  # noqa: BLE001 - the user's code: said in the job's status
        return None, f"{type(selector).__name__}.select raised {type(e).__name__}: {e}"
    if isinstance(chosen, bool) or not isinstance(chosen, int | float) or chosen != int(chosen):
        return None, f"{type(selector).__name__}.select returned {chosen!r}, not a limit in W"
    return int(chosen), ""


def _world() -> tuple[int, int]:
    """(rank, world size) from `torch.distributed` when initialised, else (0, 1)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank()), int(dist.get_world_size())
    except Exception as e:
        logger.debug("torch.distributed query failed: %r", e)
    return 0, 1


def _own_gpu(gpu_indices: list[int]) -> int:
    """This process's GPU among the monitor's: the only one, else `LOCAL_RANK`, else the first."""
    if len(gpu_indices) == 1:
        return gpu_indices[0]
    try:
        local = int(os.environ.get("LOCAL_RANK", ""))
    except ValueError:
        return gpu_indices[0]
    return local if local in gpu_indices else gpu_indices[0]


def _existing_profile(profile_path: Path | None) -> list[PowerLimitMeasurement] | None:
    """The power-limit profile at `profile_path` if that file exists, else None.

    Raises:
        ValueError: The file exists but is not a readable power-limit profile.
    """
    if profile_path is None or not profile_path.exists():
        return None
    try:
        return load_power_limit_profile(profile_path)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"profile_path {profile_path} is not a readable power-limit profile "
            f"({e}); delete it to profile again"
        ) from None


def _init_publisher(**kwargs: Any) -> emit.Publisher:
    """`emit.init(**kwargs)`; an unreachable coordinator or an unregistered job only warns."""
    return join_or_warn(logger, "GlobalPowerLimitOptimizer",
                        "without power-limit optimisation", **kwargs)


class GlobalPowerLimitOptimizer:
    """Optimizer for the power limit knob (Zeus's callback API; the coordinator optimizes).

    Call `on_step_begin()` at the start of every step and `on_epoch_end()` at the end of every
    epoch; the other callbacks are no-ops kept for Zeus compatibility.
    """

    def __init__(
        self,
        monitor: Any,
        optimum_selector: Any = None,
        wait_steps: int = 1,
        warmup_steps: int = 10,
        profile_steps: int = 40,
        pl_step: int = 25,
        profile_path: str | Path | None = None,
    ) -> None:
        r"""Register the job and this rank with the coordinator.

        GPU indices to optimize are taken from `monitor.gpu_indices`; this process's own GPU
        is the only one, else the one `LOCAL_RANK` names, else the first.

        Args:
            monitor: A `ZeusMonitor` (ours or anything with `gpu_indices`).
            optimum_selector: `Energy`, `Time`, `ZeusCost` or `MaxSlowdownConstraint`; default
                `ZeusCost` with \eta=0.5, as in Zeus.
            wait_steps: Steps to let pass before profiling (>= 0).
            warmup_steps: Warm-up steps for each power limit (>= 0; 0 is allowed here).
            profile_steps: Profiling steps for each power limit (>= 1).
            pl_step: Stride between power limits to explore (W, >= 1).
            profile_path: This trainer's profile file (Zeus JSON): loaded if it exists (no
                profiling), else written by rank 0 once profiling is over; None = neither.

        Raises:
            ValueError: An argument is out of range, the selector is not supported, or the
                profile file exists but is not a valid profile.
            zeus_agent.emit.RegistrationError: The coordinator refused the job or the rank
                (other than being unreachable, which only warns).
        """
        self.profile_path = None if profile_path is None else Path(profile_path)
        profile = _existing_profile(self.profile_path)
        self.options = power_limit_options(
            optimum_selector,
            wait_steps=wait_steps,
            warmup_steps=warmup_steps,
            profile_steps=profile_steps,
            pl_step=pl_step,
            profile=profile,
            save_profile=self.profile_path is not None and profile is None,
        )
        self._profile_written = not self.options.save_profile
        self.monitor = monitor
        self.optimum_selector = optimum_selector
        self._custom = self.options.selector == "Custom"
        gpu_indices = list(monitor.gpu_indices)
        if not gpu_indices:
            raise ValueError("monitor.gpu_indices must not be empty")
        rank, world_size = _world()
        self.rank = rank
        self._custom = self._custom and rank == 0  # (Only rank 0 is asked.)
        job_info = JobInfo(pp_degree=1, dp_degree=world_size, tp_degree=1, world_size=world_size)
        self.publisher: emit.Publisher = _init_publisher(
            job_info=job_info,
            power_limit=self.options,
            rank=rank,
            dp_rank=rank,
            gpu_index=_own_gpu(gpu_indices),
            gpu_indices=gpu_indices,
        )
        self.job_id = self.publisher.job_id

    def on_step_begin(self) -> None:
        """Mark the beginning of a training step."""
        self.publisher.step_begin()
        if self._custom:
            self._answer_selection()

    def on_epoch_end(self) -> None:
        """Mark the end of a training epoch (rank 0 also writes a newly measured profile)."""
        self.publisher.epoch_end()
        if self._custom:
            self._answer_selection()
        self.save_profile()

    def _answer_selection(self) -> None:
        """Rank 0 with a custom selector: answer the coordinator's question, if one came."""
        question = self.publisher.pending_selection()
        if question is None:
            return
        limit, why = choose(self.optimum_selector, question)
        if limit is None:
            logger.warning("GlobalPowerLimitOptimizer: %s; the coordinator falls back to the "
                           "built-in ZeusCost", why)
        reply = self.publisher.answer_selection(question, limit, why)
        if reply is None or not reply.ok:
            logger.warning("GlobalPowerLimitOptimizer: the choice of %s W did not reach the "
                           "coordinator (%s)", limit, reply.error if reply else "no agent")

    def save_profile(self) -> bool:
        """Write the measured profile to `profile_path` if profiling is over (rank 0 only).

        Asks the coordinator through the node's agent (one request, at most the publisher's
        timeout); called at every epoch end and at the end of training.

        Returns:
            Whether the profile has been written (now or before).
        """
        if self._profile_written or self.rank != 0 or self.job_id is None:
            return self._profile_written
        assert self.profile_path is not None
        reply = self.publisher.request(Kind.QUERY_JOB, JobQuery(job_id=self.job_id))
        progress = reply.result.get("power_limit") if reply is not None and reply.ok else None
        if not isinstance(progress, dict) or progress.get("optimal_power_limit_w") is None:
            return False  # Still profiling (or the coordinator is unreachable): next time.
        try:
            measurements = [PowerLimitMeasurement(**m) for m in progress["measurements"]]
            self.profile_path.parent.mkdir(parents=True, exist_ok=True)
            save_power_limit_profile(self.profile_path, measurements)
        except (OSError, ValueError, TypeError, KeyError) as e:
            logger.warning("GlobalPowerLimitOptimizer: could not write the profile to %s: %s",
                           self.profile_path, e)
            return False
        self._profile_written = True
        logger.info("GlobalPowerLimitOptimizer: profile written to %s", self.profile_path)
        return True

    def on_step_end(self) -> None:
        """No-op (Zeus compatibility)."""

    def on_epoch_begin(self) -> None:
        """No-op (Zeus compatibility)."""

    def on_train_begin(self) -> None:
        """No-op (Zeus compatibility)."""

    def on_train_end(self) -> None:
        """End of training: rank 0 writes a newly measured profile."""
        self.save_profile()

    def on_evaluate(self, metric: float) -> None:
        """No-op (Zeus compatibility)."""

    def on_instruction_begin(self, name: str) -> None:
        """No-op (Zeus compatibility)."""

    def on_instruction_end(self, name: str) -> None:
        """No-op (Zeus compatibility)."""
