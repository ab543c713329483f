"""The pipeline part of `zeus-demo`, and the engine of `bench/perseus_savings.py`.

A simulated synchronous-1F1B pipeline job (`zeus_agent.sim_pipeline_trainer`: one process per
rank, stage workloads fitted on the real Perseus profiles, `zeus_agent.gpu.sim.instructions`)
runs twice on the same simulated GPUs, each time under a coordinator of its own, all in one
asyncio loop with the agents (one `AgentServer` per simulated node) and an embedded NATS:

1. **All-max baseline.** The coordinator runs `PointSolution` (`PointSolution3D` for DP > 1) with
   a plan of every instruction at the GPU's highest SM clock: what the job does without Perseus,
   through the same per-instruction clock locking as the optimised run.
2. **Perseus.** The coordinator runs the "Perseus" scheduler (`coordinator.pipeline.perseus`;
   "Perseus3D" for DP > 1): it profiles the instructions online, plans the time-energy frontier
   and serves the chosen plan. Without that module the demo falls back to "InstructionProfiler"
   (profiling only: it then serves all-max clocks) and says so.

Every figure is what the agents measured and published on the bus: per rank and step, the
step's time and the GPU's energy counter over it (the coarse, NVML-like counter, its period
scaled with the time scale), summed over many consecutive steps (the counter's steps telescope)
and over the job's GPUs; per instruction, its start and end. The frontier, the chosen point and
the planner's prediction are read from the coordinator's Perseus scheduler (in this process).

Pieces:

* `PipelineDemoConfig`: the job and the measurement (validated, `PipelineDemoConfigError`).
* `PipelineCluster`: embedded NATS (or an external one) and the agents; `run_job(...)` starts
  a coordinator with a scheduler, runs the trainer (in a thread), follows the job's status
  events and measurements, snapshots the scheduler, stops the coordinator: a `JobRun`.
* `window_stats`, `Side`: the pure arithmetic (energy per iteration summed over GPUs and per
  pipeline, time per iteration the slowest rank's).
* `run_pipeline_demo(config, console)`: both jobs, live progress; a `PipelineDemoRun`.
* `pipeline_summary`, `render_pipeline_table`, `plot_frontier`, `plot_timeline`: the report.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from zeus_agent.aio import wait_started
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import JobStatus, MeasurementBatch

LOG = logging.getLogger(__name__)

DEFAULT_PROFILE = "gpt3-175b+a40"
PERSEUS = "Perseus"
FALLBACK = "InstructionProfiler"
PIPELINE_SUMMARY_VERSION = 1


class PipelineDemoError(Exception):
    """The pipeline part could not complete; the message says what happened."""


class PipelineDemoConfigError(PipelineDemoError, ValueError):
    """An option of the pipeline part is out of range."""


# ---------------------------------------------------------------------------- configuration
@dataclass(frozen=True)
class PipelineDemoConfig:
    """The pipeline job and how it is measured.

    Attributes:
        profile: Stage profile (`zeus_agent.gpu.sim.instructions.STAGE_PROFILES`).
        stages: Pipeline stages (PP degree, 2-8).
        dp: Data-parallel pipelines (DP degree).
        microbatches: Microbatches per iteration.
        time_scale: Factor on every instruction's duration (and the energy counter's period).
        baseline_iterations: Iterations of the all-max job.
        serve_iterations: Iterations run under the served Perseus plan (measured).
        warmup_iterations: Iterations left out at the start of each measured schedule.
        clocks: Clocks the profiler tries per instruction (its grid, highest down).
        min_clock_fraction: The profiler's lowest clock as a fraction of the highest.
        profiling_iterations: Iterations per profiling result.
        min_profile_iterations: Iterations measured per profiler setting (after a warm-up one).
        straggler: (pipeline, factor): that pipeline's instructions run `factor` times longer.
        straggler_detection: Let the coordinator detect stragglers (off: threshold set high).
        scheduler: "auto" (Perseus if installed, else InstructionProfiler) or a name.
        nodes: Simulated nodes (agents); the ranks are spread over them.
        timeout_s: Give up on one job after this long (s).
    """

    profile: str = DEFAULT_PROFILE
    stages: int = 4
    dp: int = 1
    microbatches: int = 4
    time_scale: float = 0.1
    baseline_iterations: int = 30
    serve_iterations: int = 30
    warmup_iterations: int = 2
    clocks: int = 6
    min_clock_fraction: float = 0.5
    profiling_iterations: int = 4
    min_profile_iterations: int = 3
    straggler: tuple[int, float] | None = None
    straggler_detection: bool = True
    scheduler: str = "auto"
    nodes: int = 2
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        from zeus_agent.gpu.sim.instructions import NUM_STAGES, STAGE_PROFILES

        if self.profile not in STAGE_PROFILES:
            raise PipelineDemoConfigError(
                f"--pipeline-profile {self.profile!r} is unknown; choose one of "
                f"{', '.join(STAGE_PROFILES)}")
        if not 2 <= self.stages <= NUM_STAGES:
            raise PipelineDemoConfigError(
                f"--pipeline-stages must be within 2-{NUM_STAGES}, got {self.stages}")
        for name, value, low in (("pipeline-dp", self.dp, 1),
                                 ("microbatches", self.microbatches, 1),
                                 ("pipeline-iterations", self.baseline_iterations, 4),
                                 ("pipeline-iterations", self.serve_iterations, 4),
                                 ("clocks", self.clocks, 2),
                                 ("profiling-iterations", self.profiling_iterations, 1),
                                 ("min-profile-iterations", self.min_profile_iterations, 1),
                                 ("nodes", self.nodes, 1)):
            if value < low:
                raise PipelineDemoConfigError(f"--{name} must be >= {low}, got {value}")
        if not 0 <= self.warmup_iterations < min(self.baseline_iterations,
                                                 self.serve_iterations) // 2:
            raise PipelineDemoConfigError(
                "--pipeline-warmup must be >= 0 and under half the measured iterations, got "
                f"{self.warmup_iterations}")
        if not (math.isfinite(self.time_scale) and 0.01 <= self.time_scale <= 10):
            raise PipelineDemoConfigError(
                f"--pipeline-time-scale must be within 0.01-10, got {self.time_scale}")
        if not 0 < self.min_clock_fraction <= 1:
            raise PipelineDemoConfigError(
                f"min_clock_fraction must be in (0, 1], got {self.min_clock_fraction}")
        if self.straggler is not None:
            index, factor = self.straggler
            if not 0 <= index < self.dp or not 1 <= factor <= 10:
                raise PipelineDemoConfigError(
                    f"straggler {index}:{factor}: needs 0 <= pipeline < {self.dp} and a factor "
                    "from 1 to 10")
        if not self.timeout_s > 0:
            raise PipelineDemoConfigError(f"timeout must be > 0, got {self.timeout_s}")

    @property
    def preset(self) -> str:
        """The simulated GPU the profile was measured on."""
        from zeus_agent.gpu.sim.instructions import preset_for

        return str(preset_for(self.profile))

    @property
    def world_size(self) -> int:
        """Ranks (GPUs) of the job."""
        return self.stages * self.dp

    @property
    def gpus_per_node(self) -> int:
        """Simulated GPUs per node: the ranks spread evenly."""
        return math.ceil(self.world_size / self.nodes)

    @property
    def node_names(self) -> list[str]:
        """The simulated nodes."""
        return [f"pp-node-{chr(ord('a') + i)}" if i < 26 else f"pp-node-{i}"
                for i in range(self.nodes)]

    @property
    def energy_update_ms(self) -> float:
        """The GPUs' energy counter period: NVML's 100 ms, on the job's time scale."""
        return 100.0 * self.time_scale

    def profiler_args(self) -> dict[str, Any]:
        """The InstructionProfiler's knobs."""
        return {"clocks": self.clocks, "min_clock_fraction": self.min_clock_fraction,
                "warmup_iterations": 1, "min_profile_iterations": self.min_profile_iterations}

    def profiling_budget(self, available_clocks: Sequence[int]) -> int:
        """Iterations the profiler needs at most (every clock of its grid, no early stop).

        Discovery (two alike iterations) and each profiling round's switch are counted with the
        coordinator's lead of two steps plus one of slack.
        """
        from coordinator.pipeline.instruction_profiler import coarse_grid

        levels = len(coarse_grid(available_clocks, self.clocks, self.min_clock_fraction))
        settings = 3 + 2 * (levels - 1)  # Blocking rounds, then the staircase.
        rounds = settings * math.ceil((1 + self.min_profile_iterations)
                                      / self.profiling_iterations)
        return 5 + rounds * (self.profiling_iterations + 3)


def resolve_scheduler(requested: str, dp: int) -> tuple[str, str | None]:
    """(scheduler name for a job of `dp` pipelines, a note when Perseus was not available)."""
    from coordinator.pipeline.names import known_schedulers

    with contextlib.suppress(ImportError):
        import coordinator.pipeline.perseus  # noqa: F401 - registers Perseus/Perseus3D
    known = set(known_schedulers())
    base = PERSEUS if requested == "auto" else requested
    note = None
    if base not in known:
        if requested != "auto":
            raise PipelineDemoConfigError(
                f"scheduler {requested!r} is unknown; known: {', '.join(sorted(known))}")
        note = (f"the {PERSEUS} scheduler (coordinator/pipeline/perseus.py) is not installed: "
                f"running {FALLBACK}, which profiles the instructions and then serves all-max "
                "clocks (no saving expected)")
        base = FALLBACK
    name = f"{base}3D" if dp > 1 and f"{base}3D" in known else base
    return name, note


def all_max_plan(stages: int, microbatches: int, top_mhz: int) -> list[list[tuple[str, int]]]:
    """Per stage, every 1F1B instruction at `top_mhz` (a `PointSolution3D` plan)."""
    from zeus_agent.sim_pipeline_trainer import one_f_one_b

    return [[(name, top_mhz) for name, _ in one_f_one_b(s, stages, microbatches)]
            for s in range(stages)]


# ---------------------------------------------------------------------------- measurements
@dataclass
class StepRecord:
    """One rank's step as its agent measured it."""

    t0_ns: int
    t1_ns: int
    time_s: float
    energy_j: float
    version: int | None


@dataclass
class InstructionRecord:
    """One instruction of a rank's step as its agent measured it."""

    index: int
    name: str
    t0_ns: int
    t1_ns: int
    version: int | None


class JobObserver:
    """Status events and the agents' measurements of one job (by its metadata tag)."""

    def __init__(self, tag: str, on_status: Callable[[JobStatus], None] | None = None) -> None:
        self.tag = tag
        self.on_status = on_status
        self.job_id: str | None = None
        self.statuses: list[JobStatus] = []
        self.steps: dict[tuple[int, int], StepRecord] = {}
        self.instructions: dict[tuple[int, int], list[InstructionRecord]] = {}
        self.changed = asyncio.Event()

    def _ours(self, job_id: str) -> bool:
        return job_id.endswith("+" + self.tag)

    async def status(self, msg: Any) -> None:
        """A status event (NATS callback)."""
        try:
            ev = codec.decode(msg.data, JobStatus)
        except Exception as e:  # noqa: BLE001 - a foreign message on a shared bus
            LOG.debug("ignoring an undecodable status event: %s", e)
            return
        if not self._ours(ev.job_id):
            return
        self.job_id = ev.job_id
        self.statuses.append(ev)
        self.changed.set()
        if self.on_status is not None:
            self.on_status(ev)

    async def measurement(self, msg: Any) -> None:
        """A measurement batch (NATS callback)."""
        try:
            batch = codec.decode(msg.data, MeasurementBatch)
        except Exception as e:  # noqa: BLE001
            LOG.debug("ignoring an undecodable measurement batch: %s", e)
            return
        if not self._ours(batch.job_id):
            return
        for m in batch.measurements:
            if m.epoch != 0:
                continue
            key = (batch.rank, m.step)
            if m.kind == "step":
                self.steps[key] = StepRecord(m.t0_ns, m.t1_ns, m.time_s, m.energy_j, m.schedule)
            else:
                self.instructions.setdefault(key, []).append(
                    InstructionRecord(m.index, m.name, m.t0_ns, m.t1_ns, m.schedule))
        self.changed.set()

    def versions(self, state: str) -> list[int]:
        """Schedule versions announced by status events of `state` ("serving", ...), in order."""
        out: list[int] = []
        for ev in self.statuses:
            version = (ev.progress or {}).get("schedule")
            if ev.state == state and isinstance(version, int) and version not in out:
                out.append(version)
        return out

    def last_step(self, rank: int = 0) -> int:
        """The latest step measured of `rank` (-1: none)."""
        return max((s for r, s in self.steps if r == rank), default=-1)

    def steps_at(self, version: int, rank: int = 0) -> int:
        """How many steps of `rank` ran under schedule `version`."""
        return sum(1 for (r, _), rec in self.steps.items() if r == rank and rec.version == version)


# ---------------------------------------------------------------------------- arithmetic
@dataclass(frozen=True)
class Side:
    """Per-iteration figures of a set of steps, as the agents measured them.

    Attributes:
        iterations: Steps averaged (each measured on every rank).
        first_step: First step included (None without steps).
        last_step: Last step included.
        time_s: Mean over steps of the slowest rank's step time (s).
        energy_j: Mean over steps of the energy summed over the job's GPUs (J).
        pipeline_energy_j: Pipeline (dp index) -> mean energy of its GPUs per step (J).
        versions: The schedule versions the steps ran under.
        median_time_s: Median over steps of the slowest rank's step time (s): what the
            iteration takes without the occasional hiccup of a busy machine.
    """

    iterations: int
    first_step: int | None
    last_step: int | None
    time_s: float
    energy_j: float
    pipeline_energy_j: dict[int, float]
    versions: list[int | None]
    median_time_s: float = math.nan

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (NaN as None)."""
        return {
            "iterations": self.iterations, "first_step": self.first_step,
            "last_step": self.last_step, "time_per_iteration_s": _finite(self.time_s),
            "median_time_per_iteration_s": _finite(self.median_time_s),
            "energy_per_iteration_j": _finite(self.energy_j),
            "energy_per_iteration_by_pipeline_j": {
                str(d): _finite(e) for d, e in sorted(self.pipeline_energy_j.items())},
            "schedule_versions": self.versions,
        }


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def window_stats(
    steps: Mapping[tuple[int, int], StepRecord],
    rank_pipeline: Mapping[int, int],
    versions: Sequence[int | None],
    skip: int = 0,
    after_step: int = -1,
    limit: int | None = None,
) -> Side:
    """Per-iteration time and energy of the steps every rank ran under one of `versions`.

    A step counts when every rank has a measurement of it, all under one of `versions`, and it
    is after `after_step`; the first `skip` of those are left out (the switch), then at most
    `limit` are kept. Energies telescope: over consecutive steps the coarse counter's error
    stays that of two counter updates per GPU.

    Args:
        steps: (rank, step) -> the agent's measurement.
        rank_pipeline: Rank -> its pipeline (dp index); the job's ranks.
        versions: Schedule versions accepted.
        skip: Leading qualifying steps left out.
        after_step: Only steps after this one.
        limit: Most steps kept (None: all).
    """
    ranks = sorted(rank_pipeline)
    wanted = set(versions)
    numbers = sorted({s for (_, s) in steps if s > after_step})
    picked: list[int] = []
    for n in numbers:
        recs = [steps.get((r, n)) for r in ranks]
        if any(rec is None for rec in recs):
            continue
        if all(rec is not None and rec.version in wanted for rec in recs):
            picked.append(n)
    picked = picked[skip:]
    if limit is not None:
        picked = picked[:limit]
    if not picked:
        return Side(0, None, None, math.nan, math.nan, {}, list(versions))
    times = [max(steps[(r, n)].time_s for r in ranks) for n in picked]
    energies = [sum(steps[(r, n)].energy_j for r in ranks) for n in picked]
    by_pipeline = {
        d: statistics.fmean(sum(steps[(r, n)].energy_j for r in ranks if rank_pipeline[r] == d)
                            for n in picked)
        for d in sorted(set(rank_pipeline.values()))
    }
    return Side(len(picked), picked[0], picked[-1], statistics.fmean(times),
                statistics.fmean(energies), by_pipeline, list(versions),
                statistics.median(times))


def pct_less(before: float, after: float) -> float:
    """(before - after) / before in % (NaN when undefined)."""
    return (before - after) / before * 100.0 if before > 0 and math.isfinite(after) else math.nan


def pct_more(before: float, after: float) -> float:
    """(after - before) / before in % (NaN when undefined)."""
    return (after - before) / before * 100.0 if before > 0 and math.isfinite(after) else math.nan


# ---------------------------------------------------------------------------- the cluster
@dataclass
class SchedulerSnapshot:
    """What the coordinator's Perseus scheduler planned (None fields: it has none)."""

    name: str
    frontier: list[tuple[float, float]] = field(default_factory=list)
    chosen: tuple[float, float] | None = None
    chosen_plan: list[list[tuple[str, int]]] | None = None
    all_max: tuple[float, float] | None = None
    p_block_w: float | None = None
    profile_rows: list[tuple[int, str, int, float, float]] = field(default_factory=list)

    @property
    def predicted_saving_pct(self) -> float:
        """The planner's energy saving of the chosen plan over all-max clocks (%)."""
        if self.chosen is None or self.all_max is None:
            return math.nan
        return pct_less(self.all_max[1], self.chosen[1])

    @property
    def predicted_slowdown_pct(self) -> float:
        """The planner's iteration time change of the chosen plan over all-max clocks (%)."""
        if self.chosen is None or self.all_max is None:
            return math.nan
        return pct_more(self.all_max[0], self.chosen[0])


def snapshot_scheduler(name: str, scheduler: Any, microbatches: int) -> SchedulerSnapshot:
    """Copy what a Perseus scheduler planned (frontier, choice, all-max evaluation)."""
    snap = SchedulerSnapshot(name=name)
    frontier = getattr(scheduler, "frontier", None)
    chosen = getattr(scheduler, "chosen", None)
    if not frontier or chosen is None:
        return snap
    snap.frontier = [(float(p.time), float(p.energy)) for p in frontier]
    snap.chosen = (float(chosen.time), float(chosen.energy))
    snap.chosen_plan = [[(str(n), int(f)) for n, f in stage] for stage in chosen.plan]
    snap.p_block_w = getattr(scheduler, "p_block_used", None)
    snap.profile_rows = [(int(s), str(n), int(f), float(t), float(e))
                         for s, n, f, t, e in getattr(scheduler, "profile_rows", [])]
    try:
        from coordinator.pipeline import planner

        profile = planner.InstructionProfile.from_rows(snap.profile_rows)
        plan = planner.max_frequency_plan(profile, microbatches)
        t, e = planner.evaluate(profile, plan, microbatches,
                                snap.p_block_w if snap.p_block_w is not None
                                else planner.DEFAULT_P_BLOCK_W)
        snap.all_max = (float(t), float(e))
    except Exception as e:  # noqa: BLE001 - the prediction is a report item, not the run
        LOG.warning("cannot evaluate the all-max plan on the profile: %s", e)
    return snap


@dataclass
class JobRun:
    """One job: what the trainer did, what the agents measured, what the coordinator planned."""

    scheduler: str
    job_id: str
    result: Any  # PipelineResult
    observer: JobObserver
    rank_pipeline: dict[int, int]
    snapshot: SchedulerSnapshot | None
    schedules: dict[int, dict[int, list[tuple[str, int]]]]
    """Version -> rank -> (instruction, MHz), from the coordinator's dumps."""
    marks: dict[str, int] = field(default_factory=dict)
    """Named steps the director recorded (e.g. "notice": the step the notice was sent at)."""
    elapsed_s: float = 0.0


Director = Callable[["JobContext"], Coroutine[Any, Any, None]]


@dataclass
class JobContext:
    """What a director (run alongside the trainer) can see and do."""

    cluster: PipelineCluster
    observer: JobObserver
    marks: dict[str, int]
    iterations: list[int]
    """Iterations done, as reported by the trainer (rank 0)."""


class PipelineCluster:
    """Embedded NATS (or an external one), one agent per simulated node, coordinators per job."""

    def __init__(self, config: PipelineDemoConfig, *, nats_url: str | None = None,
                 prefix: str = subjects.DEFAULT_PREFIX, log_level: str = "ERROR") -> None:
        self.config = config
        self.nats_url = nats_url
        self.prefix = prefix
        self.log_level = log_level
        self._tmp = tempfile.TemporaryDirectory(prefix="zeus-pipeline-demo-")
        self.root = Path(self._tmp.name)
        self.embedded: Any = None
        self.url = ""
        self.nc: Any = None
        self.agents: list[tuple[Any, asyncio.Task[None]]] = []
        self._observers: list[JobObserver] = []
        self.top_clock_mhz = 0
        self.available_clocks: list[int] = []

    async def start(self) -> None:
        """Start NATS (unless external), the agents, and subscribe to statuses and measurements.

        Raises:
            PipelineDemoError: Something did not start.
        """
        from zeus_agent.agent.server import AgentServer
        from zeus_agent.broker import EmbeddedNats, confirm_subscriptions, connect
        from zeus_agent.config import AgentSettings
        from zeus_agent.errors import BrokerError
        from zeus_agent.gpu.sim.presets import PRESETS

        cfg = self.config
        if self.nats_url:
            self.url = self.nats_url
        else:
            try:
                self.embedded = await asyncio.to_thread(EmbeddedNats().start)
            except BrokerError as e:
                raise PipelineDemoError(f"the embedded nats-server did not start: {e}") from e
            self.url = self.embedded.url
        try:
            self.nc = await connect(self.url, "zeus-demo-pipeline")
        except BrokerError as e:
            raise PipelineDemoError(str(e)) from e
        await self.nc.subscribe(subjects.all_job_status(self.prefix), cb=self._status)
        await self.nc.subscribe(subjects.all_gpu_measurements(self.prefix), cb=self._measurement)
        await confirm_subscriptions(self.nc)
        for node in cfg.node_names:
            server = AgentServer(AgentSettings.model_validate({
                "nats_url": self.url, "backend": "sim", "sim_count": cfg.gpus_per_node,
                "sim_preset": cfg.preset, "sim_state_dir": str(self.root / node),
                "socket_path": str(self.root / f"{node}.sock"), "node": node,
                "sample_hz": 2, "prefix": self.prefix, "log_level": self.log_level,
                "sim_energy_update_ms": cfg.energy_update_ms,
            }))
            self.agents.append((server, asyncio.create_task(server.serve())))
        for server, task in self.agents:
            await _wait_started(server.started, task, f"agent {server.settings.node}")
        hw = PRESETS[cfg.preset]
        self.available_clocks = sorted(hw.supported_sm_clocks_mhz, reverse=True)
        self.top_clock_mhz = self.available_clocks[0]

    async def _status(self, msg: Any) -> None:
        for obs in list(self._observers):
            await obs.status(msg)

    async def _measurement(self, msg: Any) -> None:
        for obs in list(self._observers):
            await obs.measurement(msg)

    def placements(self) -> list[Any]:
        """The job's ranks on the nodes' GPUs (Megatron order: rank = stage * dp + d)."""
        from zeus_agent.sim_pipeline_trainer import NodeSpec, place_ranks

        cfg = self.config
        per = cfg.gpus_per_node
        nodes = [NodeSpec(n, str(self.root / f"{n}.sock"), str(self.root / n), tuple(range(per)))
                 for n in cfg.node_names]
        return place_ranks(nodes, cfg.stages, cfg.dp)

    async def run_job(
        self,
        scheduler: str,
        scheduler_args: Mapping[str, Any],
        iterations: int,
        *,
        label: str,
        straggler: tuple[int, float] | None = None,
        detect_stragglers: bool = True,
        on_iteration: Callable[[int, float], None] | None = None,
        on_status: Callable[[JobStatus], None] | None = None,
        director: Director | None = None,
        perseus_snapshot: bool = False,
    ) -> JobRun:
        """Run one job under a fresh coordinator running `scheduler`; stop the coordinator.

        Raises:
            PipelineDemoError: The coordinator did not start, the job failed, or the
                coordinator stopped the optimisation with an error.
        """
        from coordinator.config import CoordinatorSettings
        from coordinator.pipeline.dumps import job_dir_name
        from coordinator.service import CoordinatorService
        from zeus_agent.sim_pipeline_trainer import PipelineError, PipelineOptions, run_pipeline

        cfg = self.config
        started = time.monotonic()
        tag = f"{label}-{uuid.uuid4().hex[:8]}"
        observer = JobObserver(tag, on_status)
        self._observers.append(observer)
        home = self.root / f"coordinator-{tag}"
        values: dict[str, Any] = {
            "nats_url": self.url, "prefix": self.prefix, "state_dir": str(home / "state"),
            "dump_dir": str(home / "dump"), "log_level": self.log_level,
            "scheduler": scheduler, "scheduler_args": dict(scheduler_args),
            "profiling_iterations": cfg.profiling_iterations, "switch_lead_steps": 2,
        }
        fields = CoordinatorSettings.model_fields
        if "straggler_threshold" in fields and not detect_stragglers:
            values["straggler_threshold"] = 10.0  # The largest allowed: nothing is detected.
        try:
            settings = CoordinatorSettings.model_validate(values)
        except Exception as e:  # noqa: BLE001 - pydantic's message names the field
            raise PipelineDemoError(f"coordinator settings: {e}") from e
        coord = CoordinatorService(settings)
        coord_task = asyncio.create_task(coord.serve())
        director_task: asyncio.Task[None] | None = None
        marks: dict[str, int] = {}
        done_iterations: list[int] = []
        loop = asyncio.get_running_loop()
        try:
            await _wait_started(coord.started, coord_task, "the coordinator")
            options = PipelineOptions(
                profile=cfg.profile, stages=cfg.stages, microbatches=cfg.microbatches,
                dp=cfg.dp, iterations=iterations, time_scale=cfg.time_scale,
                straggler=straggler, job_metadata=tag)

            def iteration_done(count: int, elapsed: float) -> None:
                def note() -> None:
                    done_iterations.append(count)
                    observer.changed.set()
                    if on_iteration is not None:
                        on_iteration(count, elapsed)
                loop.call_soon_threadsafe(note)

            if director is not None:
                ctx = JobContext(self, observer, marks, done_iterations)
                director_task = asyncio.create_task(director(ctx))
            try:
                result = await asyncio.to_thread(run_pipeline, self.placements(), options,
                                                 iteration_done, cfg.timeout_s)
            except PipelineError as e:
                raise PipelineDemoError(f"the simulated pipeline job ({label}) failed: {e}") from e
            if not result.job_id:
                raise PipelineDemoError(f"the {label} job was not registered")
            expected = {(r.rank, s) for r in result.ranks for s in range(len(r.iteration_time_s))}
            deadline = time.monotonic() + 10
            while not expected <= observer.steps.keys() and time.monotonic() < deadline:
                observer.changed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(observer.changed.wait(), 0.5)
            if director_task is not None:
                if not director_task.done():
                    director_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await director_task
            job = coord.pipeline_jobs.get(result.job_id)
            snapshot = None
            if perseus_snapshot and job is not None and job.scheduler is not None:
                snapshot = snapshot_scheduler(scheduler, job.scheduler, cfg.microbatches)
            schedules = _read_schedules(home / "dump" / job_dir_name(result.job_id))
        finally:
            if director_task is not None and not director_task.done():
                director_task.cancel()
            coord.should_exit.set()
            done, pending = await asyncio.wait({coord_task}, timeout=15)
            for t in pending:
                t.cancel()
            for t in done:
                if not t.cancelled() and t.exception() is not None:
                    LOG.warning("the coordinator ended with an error: %s", t.exception())
            self._observers.remove(observer)
        errors = [ev.message for ev in observer.statuses if ev.state == "error"]
        if errors:
            raise PipelineDemoError(f"the coordinator stopped the {label} job: {errors[-1]}")
        return JobRun(
            scheduler=scheduler, job_id=result.job_id, result=result, observer=observer,
            rank_pipeline={r.rank: r.dp_rank for r in result.ranks}, snapshot=snapshot,
            schedules=schedules, marks=marks, elapsed_s=time.monotonic() - started)

    async def straggler_notice(self, job_id: str, pipeline: int, factor: float | None) -> str:
        """Send a straggler notice as `zeus-coordinator straggler` does; the answer's text.

        Runs the command line itself when it is installed, else sends the `StragglerNotice`
        request directly.

        Raises:
            PipelineDemoError: No straggler support, or the coordinator refused the notice.
        """
        what = ["--clear"] if factor is None else ["--factor", f"{factor:g}"]
        command = _coordinator_command()
        if command is not None:
            argv = [*command, "straggler", job_id, "--pipeline", str(pipeline), *what,
                    "--nats-url", self.url, "--prefix", self.prefix]
            proc = await asyncio.to_thread(
                subprocess.run, argv, capture_output=True, text=True, timeout=60,
                stdin=subprocess.DEVNULL)
            text = (proc.stdout + proc.stderr).strip()
            if proc.returncode == 0:
                return text
            if "invalid choice" not in text:
                raise PipelineDemoError(f"zeus-coordinator straggler failed: {text}")
        try:
            from zeus_agent.wire.messages import Reply, StragglerNotice
        except ImportError as e:
            raise PipelineDemoError("this coordinator has no straggler notices") from e
        notice = (StragglerNotice(job_id=job_id, pipeline=pipeline, clear=True) if factor is None
                  else StragglerNotice(job_id=job_id, pipeline=pipeline, factor=factor))
        subject = getattr(subjects, "coord_job_straggler")(self.prefix)  # noqa: B009
        msg = await self.nc.request(subject, codec.encode(notice), timeout=10)
        reply = codec.decode(msg.data, Reply)
        if not reply.ok:
            raise PipelineDemoError(f"the coordinator refused the notice: {reply}")
        return str(reply)

    async def stop(self) -> None:
        """Stop the agents and NATS; remove the temporary state."""
        for server, _ in self.agents:
            server.handle_exit()
        tasks = [t for _, t in self.agents]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=15)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending, timeout=5)
        self.agents = []
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.drain(), 5)
            self.nc = None
        if self.embedded is not None:
            await asyncio.to_thread(self.embedded.stop)
            self.embedded = None
        self._tmp.cleanup()


def _coordinator_command() -> list[str] | None:
    """`zeus-coordinator` next to this Python, on PATH, or None."""
    script = Path(sys.executable).with_name("zeus-coordinator")
    if script.exists():
        return [str(script)]
    found = shutil.which("zeus-coordinator")
    return [found] if found else None


def _read_schedules(directory: Path) -> dict[int, dict[int, list[tuple[str, int]]]]:
    out: dict[int, dict[int, list[tuple[str, int]]]] = {}
    for path in directory.glob("*.sched.json"):
        head = path.name.split(".", 1)[0]
        if not head.isdigit():
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        out[int(head)] = {int(s["rank"]): [(str(n), int(f)) for n, f in s["frequencies"]]
                          for s in data}
    return out


async def _wait_started(event: asyncio.Event, task: asyncio.Task[Any], what: str) -> None:
    await wait_started(event, task, what, PipelineDemoError)


def _write_plan(path: Path, plan: Sequence[Sequence[tuple[str, int]]]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([[list(p) for p in stage] for stage in plan]))
    return str(path)


# ---------------------------------------------------------------------------- the demo
@dataclass
class PipelineDemoRun:
    """What the pipeline part produced (the report's inputs)."""

    config: PipelineDemoConfig
    scheduler: str
    note: str | None
    all_max: JobRun
    perseus: JobRun
    baseline: Side
    optimised: Side
    served_version: int | None
    nats: str
    elapsed_s: float


class _Live:
    """Live progress: a rich progress bar on a terminal, plain lines otherwise."""

    def __init__(self, console: Console, enabled: bool) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        self.console = console
        self.rich = enabled and console.is_terminal
        self.progress = Progress(
            SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(),
            MofNCompleteColumn(), TextColumn("{task.fields[phase]}"), TimeElapsedColumn(),
            console=console, disable=not self.rich)
        self.task: Any = None
        self.label = ""
        self.total = 0
        self._last_phase = ""
        self._last_line = 0.0

    def __enter__(self) -> _Live:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def begin(self, label: str, total: int) -> None:
        self.label, self.total, self._last_phase = label, total, ""
        if self.rich:
            if self.task is not None:
                self.progress.update(self.task, visible=False)
            self.task = self.progress.add_task(label, total=total, phase="starting the ranks")
        else:
            self.console.print(f"[bold]{label}[/]: {total} iterations")

    def iteration(self, count: int, elapsed: float) -> None:
        if self.rich:
            self.progress.update(self.task, completed=min(count, self.total))
            return
        now = time.monotonic()
        if now - self._last_line >= 10.0 or count == self.total:
            self._last_line = now
            self.console.print(f"  {self.label}: iteration {count}/{self.total} "
                               f"({elapsed:.3f} s)")

    def status(self, ev: JobStatus) -> None:
        text = phase_text(ev)
        if text is None or (ev.state == "rank_registered" and self._last_phase):
            return  # (A late registration status after the job moved on.)
        if self.rich:
            self.progress.update(self.task, phase=text)
        elif text != self._last_phase:
            self.console.print(f"  {self.label}: {text}")
        self._last_phase = text


def phase_text(ev: JobStatus) -> str | None:
    """A short line for a pipeline job's status event (None: not worth showing)."""
    p = ev.progress or {}
    if ev.state in ("registered", "rank_registered"):
        return "registering the ranks"
    if ev.state == "discovering":
        return "discovering each stage's instructions"
    if ev.state == "profiling":
        rounds = p.get("rounds")
        if rounds:
            return f"profiling online: round {rounds[0] + 1}/{rounds[1]}"
        return f"schedule {p.get('schedule')}"
    if ev.state in ("serving", "straggler"):
        return f"{ev.state}: {ev.message.split(':')[0]} (schedule {p.get('schedule')})"
    if ev.state in ("error", "stopped"):
        return f"{ev.state}: {ev.message[:80]}"
    return None


async def run_pipeline_demo(
    config: PipelineDemoConfig,
    console: Console,
    *,
    progress: bool = True,
    nats_url: str | None = None,
    prefix: str = subjects.DEFAULT_PREFIX,
    log_level: str = "ERROR",
) -> PipelineDemoRun:
    """The all-max job, then the Perseus job; every process stopped and temporary file removed.

    Raises:
        PipelineDemoError: Something did not start, a job failed, or too few iterations ran
            under the served plan to measure it.
    """
    started = time.monotonic()
    scheduler, note = resolve_scheduler(config.scheduler, config.dp)
    cluster = PipelineCluster(config, nats_url=nats_url, prefix=prefix, log_level=log_level)
    try:
        with _Live(console, progress) as live:
            await cluster.start()
            if note:
                console.print(f"[yellow]note: {note}[/]")
            baseline_name = "PointSolution3D" if config.dp > 1 else "PointSolution"
            plan = _write_plan(cluster.root / "all-max-plan.json",
                               all_max_plan(config.stages, config.microbatches,
                                            cluster.top_clock_mhz))
            total = 5 + config.warmup_iterations + config.baseline_iterations
            live.begin(f"all-max clocks ({cluster.top_clock_mhz} MHz)", total)
            all_max = await cluster.run_job(
                baseline_name, {"solution_path": plan}, total, label="all-max",
                straggler=config.straggler, on_iteration=live.iteration,
                on_status=live.status)
            total = (config.profiling_budget(cluster.available_clocks)
                     + config.warmup_iterations + config.serve_iterations)
            live.begin(scheduler, total)
            perseus = await cluster.run_job(
                scheduler, scheduler_args(scheduler, config), total, label="perseus",
                straggler=config.straggler, detect_stragglers=config.straggler_detection,
                on_iteration=live.iteration, on_status=live.status, perseus_snapshot=True)
    finally:
        await cluster.stop()
    baseline = window_stats(all_max.observer.steps, all_max.rank_pipeline,
                            sorted(all_max.schedules) or [0], skip=config.warmup_iterations,
                            limit=config.baseline_iterations)
    served = perseus.observer.versions("serving")
    version = served[-1] if served else None
    optimised = window_stats(perseus.observer.steps, perseus.rank_pipeline, [version],
                             skip=config.warmup_iterations) if version is not None else Side(
        0, None, None, math.nan, math.nan, {}, [])
    if baseline.iterations < 4:
        raise PipelineDemoError(
            f"only {baseline.iterations} all-max iteration(s) were measured on every rank")
    if optimised.iterations < 4:
        raise PipelineDemoError(
            f"only {optimised.iterations} iteration(s) ran under the served plan: profiling "
            "took longer than budgeted; raise --pipeline-iterations")
    return PipelineDemoRun(
        config=config, scheduler=scheduler, note=note, all_max=all_max, perseus=perseus,
        baseline=baseline, optimised=optimised, served_version=version,
        nats="embedded" if nats_url is None else nats_url,
        elapsed_s=time.monotonic() - started)


def scheduler_args(scheduler: str, config: PipelineDemoConfig) -> dict[str, Any]:
    """The coordinator's scheduler args: the profiler's knobs (inside Perseus's)."""
    if scheduler.startswith(PERSEUS):
        # One plan served for the whole measurement (no re-profiling on drift).
        return {"profiler_args": config.profiler_args(), "max_reprofiles": 0}
    return config.profiler_args()


# ---------------------------------------------------------------------------- report
def timeline_of(run: JobRun, step: int, pipeline: int = 0) -> list[list[tuple[str, float, float,
                                                                             int]]]:
    """Per stage of `pipeline`: (instruction, start s, end s, SM clock MHz) of one step.

    Times are the agents' instruction stamps relative to the step's earliest start; clocks are
    what the simulated GPU ran (the trainer's record: the lock, or lower under the power cap).
    """
    ranks = sorted((r for r in run.result.ranks if r.dp_rank == pipeline),
                   key=lambda r: r.pp_rank)
    starts = [run.observer.steps[(r.rank, step)].t0_ns for r in ranks
              if (r.rank, step) in run.observer.steps]
    if not starts:
        return []
    origin = min(starts)
    out = []
    for r in ranks:
        recs = sorted(run.observer.instructions.get((r.rank, step), []), key=lambda i: i.index)
        clocks = r.clocks_mhz[step] if step < len(r.clocks_mhz) else []
        out.append([(i.name, (i.t0_ns - origin) / 1e9, (i.t1_ns - origin) / 1e9,
                     int(clocks[k]) if k < len(clocks) else 0) for k, i in enumerate(recs)])
    return out


def _middle(side: Side, run: JobRun) -> int | None:
    if side.first_step is None or side.last_step is None:
        return None
    mid = (side.first_step + side.last_step) // 2
    for step in range(mid, side.last_step + 1):
        ranks = [r.rank for r in run.result.ranks]
        if all(len(run.observer.instructions.get((r, step), [])) == 2 * run_micro(run)
               for r in ranks):
            return step
    return mid


def run_micro(run: JobRun) -> int:
    """Microbatches of the job's iterations (from rank 0's first recorded clocks)."""
    first = run.result.ranks[0]
    return len(first.clocks_mhz[0]) // 2 if first.clocks_mhz else 0


def pipeline_summary(run: PipelineDemoRun) -> dict[str, Any]:
    """The `pipeline` section of summary.json."""
    cfg = run.config
    snap = run.perseus.snapshot
    planner_part: dict[str, Any] | None = None
    if snap is not None and snap.chosen is not None:
        planner_part = {
            "frontier_points": len(snap.frontier),
            "frontier": [{"time_s": t, "energy_j": e} for t, e in snap.frontier],
            "chosen": {"time_s": snap.chosen[0], "energy_j": snap.chosen[1]},
            "all_max": (None if snap.all_max is None
                        else {"time_s": snap.all_max[0], "energy_j": snap.all_max[1]}),
            "predicted_energy_saving_pct": _finite(snap.predicted_saving_pct),
            "predicted_time_change_pct": _finite(snap.predicted_slowdown_pct),
            "p_block_w": snap.p_block_w,
            "chosen_plan": snap.chosen_plan,
            "note": "per iteration, whole job (energies of a stage summed over its replicas); "
                    "instruction time and energy plus P_block while a GPU waits, as Perseus "
                    "plans; the all-reduce and optimizer step are not in it",
        }
    b, o = run.baseline, run.optimised
    steps = {"all_max": _middle(b, run.all_max), "perseus": _middle(o, run.perseus)}
    return {
        "version": PIPELINE_SUMMARY_VERSION,
        "config": {
            "profile": cfg.profile, "preset": cfg.preset, "stages": cfg.stages, "dp": cfg.dp,
            "microbatches": cfg.microbatches, "time_scale": cfg.time_scale,
            "energy_update_ms": cfg.energy_update_ms, "nodes": cfg.nodes,
            "baseline_iterations": cfg.baseline_iterations,
            "serve_iterations": cfg.serve_iterations,
            "warmup_iterations": cfg.warmup_iterations,
            "profiler_args": cfg.profiler_args(),
            "profiling_iterations": cfg.profiling_iterations,
        },
        "scheduler": run.scheduler,
        "scheduler_note": run.note,
        "jobs": {"all_max": run.all_max.job_id, "perseus": run.perseus.job_id},
        "world_size": cfg.world_size,
        "all_max": b.to_json(),
        "perseus": o.to_json(),
        "served_schedule": run.served_version,
        "savings": {
            "energy_pct": _finite(pct_less(b.energy_j, o.energy_j)),
            "time_change_pct": _finite(pct_more(b.time_s, o.time_s)),
        },
        "planner": planner_part,
        "measured_by": "agents: GPU energy counters per step summed over the steps and the "
                       "job's GPUs; time per iteration the slowest rank's step",
        "late_clocks": sum(r.late_clocks for r in run.perseus.result.ranks),
        "timeline_steps": steps,
        "elapsed_s": run.elapsed_s,
    }


def render_pipeline_table(summary: Mapping[str, Any]) -> Table:
    """All-max versus Perseus per iteration, savings, and the planner's prediction."""
    cfg = summary["config"]
    table = Table(
        title=(f"Pipeline frequency optimisation: {cfg['stages']} stages x {cfg['dp']} "
               f"pipeline(s) on simulated {cfg['preset']}s, {cfg['profile']}, "
               f"{cfg['microbatches']} microbatches, {summary['scheduler']}"),
        caption=("per iteration: energy summed over the job's GPUs from the agents' energy "
                 "counters, time the slowest rank's step; predicted: the planner's frontier"),
    )
    table.add_column("")
    table.add_column("iteration time", justify="right")
    table.add_column("energy / iteration", justify="right")
    table.add_column("iterations", justify="right")

    def fmt(v: float | None, unit: str, digits: int) -> str:
        return "n/a" if v is None else f"{v:.{digits}f} {unit}"

    for name, key in (("all-max clocks", "all_max"), (summary["scheduler"], "perseus")):
        s = summary[key]
        table.add_row(name, fmt(s["time_per_iteration_s"], "s", 4),
                      fmt(s["energy_per_iteration_j"], "J", 1), str(s["iterations"]))
    e_pct = summary["savings"]["energy_pct"]
    t_pct = summary["savings"]["time_change_pct"]
    table.add_section()
    table.add_row(
        "[bold]measured[/]",
        "n/a" if t_pct is None else f"[bold]{t_pct:+.1f} % (slowdown)[/]",
        "n/a" if e_pct is None else f"[bold green]{e_pct:.1f} % less[/]", "")
    plan = summary.get("planner")
    if plan and plan.get("predicted_energy_saving_pct") is not None:
        table.add_row(
            "predicted (planner)",
            f"{plan['predicted_time_change_pct']:+.1f} %",
            f"{plan['predicted_energy_saving_pct']:.1f} % less",
            f"{plan['frontier_points']} frontier points")
    elif summary.get("scheduler_note"):
        table.add_row("predicted (planner)", "n/a", "n/a", "no planner")
    return table


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PipelineDemoError("the plots need matplotlib: pip install 'zeus-bus[plot]'") from e
    return plt


def plot_frontier(summary: Mapping[str, Any], path: Path) -> bool:
    """The planner's frontier, the chosen point and all-max marked, the measured points too.

    Returns False (no file) when there is no frontier (no Perseus).
    """
    plan = summary.get("planner")
    if not plan or not plan.get("frontier"):
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5))
    pts = plan["frontier"]
    ax.plot([p["time_s"] for p in pts], [p["energy_j"] for p in pts], "-", color="tab:blue",
            lw=1.5, label=f"planned frontier ({len(pts)} points)")
    ax.plot([p["time_s"] for p in pts], [p["energy_j"] for p in pts], ".", color="tab:blue",
            ms=3)
    if plan.get("all_max"):
        am = plan["all_max"]
        ax.plot([am["time_s"]], [am["energy_j"]], "D", color="tab:orange", ms=10,
                label="all-max clocks (planned)")
        ax.axvline(am["time_s"], color="tab:orange", alpha=0.25, ls="--")
    ch = plan["chosen"]
    saving = plan.get("predicted_energy_saving_pct")
    ax.plot([ch["time_s"]], [ch["energy_j"]], "*", color="tab:red", ms=18,
            label="chosen (planned" + (f": -{saving:.1f} % energy)" if saving is not None
                                       else ")"))
    b, o = summary["all_max"], summary["perseus"]
    if b["energy_per_iteration_j"] is not None:
        ax.plot([b["time_per_iteration_s"]], [b["energy_per_iteration_j"]], "D", mfc="none",
                color="tab:orange", ms=10, mew=2, label="all-max, measured by the agents")
    if o["energy_per_iteration_j"] is not None:
        e_pct = summary["savings"]["energy_pct"]
        ax.plot([o["time_per_iteration_s"]], [o["energy_per_iteration_j"]], "*", mfc="none",
                color="tab:red", ms=18, mew=1.5,
                label="Perseus, measured" + (f" (-{e_pct:.1f} % energy)" if e_pct is not None
                                             else ""))
    ax.set_xlabel("iteration time (s)")
    ax.set_ylabel("energy per iteration (J, all GPUs)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    cfg = summary["config"]
    ax.set_title(f"Perseus time-energy frontier: {cfg['stages']} stages x {cfg['dp']}, "
                 f"{cfg['profile']}, {cfg['microbatches']} microbatches", fontsize=10)
    fig.text(0.01, 0.01, "measured points include the all-reduce/optimizer step the plan does "
             "not model", fontsize=7, color="gray")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_timeline(
    timelines: Mapping[str, Sequence[Sequence[tuple[str, float, float, int]]]],
    path: Path,
    title: str,
) -> None:
    """One iteration per stage, before and after: instructions as bars coloured by SM clock."""
    plt = _pyplot()
    from matplotlib import colors as mcolors

    rows = [(name, tl) for name, tl in timelines.items() if tl]
    if not rows:
        raise PipelineDemoError("no instruction measurements to draw a timeline from")
    clocks = [c for _, tl in rows for stage in tl for *_, c in stage if c > 0]
    norm = mcolors.Normalize(vmin=min(clocks, default=0), vmax=max(clocks, default=1))
    cmap = plt.get_cmap("viridis")
    end = max((e for _, tl in rows for stage in tl for _, _, e, _ in stage), default=1.0)
    fig, axes = plt.subplots(len(rows), 1, figsize=(10, 1.2 + 1.1 * sum(len(t) for _, t in rows)
                                                     / max(len(rows), 1) * len(rows) / 2 + 1),
                             sharex=True, squeeze=False)
    for ax, (name, tl) in zip(axes[:, 0], rows, strict=True):
        for stage, instr in enumerate(tl):
            for kind, start, stop, clock in instr:
                ax.barh(stage, stop - start, left=start, height=0.8,
                        color=cmap(norm(clock)) if clock > 0 else "lightgray",
                        edgecolor="black", linewidth=0.5)
                if stop - start > end / 60:
                    ax.text((start + stop) / 2, stage, "F" if kind == "forward" else "B",
                            ha="center", va="center", fontsize=7,
                            color="white" if norm(clock) < 0.6 else "black")
        iteration = max((e for stage in tl for _, _, e, _ in stage), default=0.0)
        ax.set_yticks(range(len(tl)), [f"stage {s}" for s in range(len(tl))])
        ax.invert_yaxis()
        ax.set_title(f"{name}: {iteration:.3f} s", fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("time since the iteration's start (s)")
    sm = plt.cm.ScalarMappable(norm=norm, cmap=cmap)
    fig.colorbar(sm, ax=axes[:, 0].tolist(), label="SM clock the GPU ran (MHz)", pad=0.01)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def write_pipeline_report(run: PipelineDemoRun, report_dir: Path) -> dict[str, Any]:
    """pipeline_frontier.png and pipeline_timeline.png; return the `pipeline` summary section."""
    report_dir.mkdir(parents=True, exist_ok=True)
    summary = pipeline_summary(run)
    images = []
    if plot_frontier(summary, report_dir / "pipeline_frontier.png"):
        images.append("pipeline_frontier.png")
    steps = summary["timeline_steps"]
    timelines = {}
    if steps["all_max"] is not None:
        timelines["all-max clocks"] = timeline_of(run.all_max, steps["all_max"])
    if steps["perseus"] is not None:
        timelines[f"{run.scheduler} (served plan)"] = timeline_of(run.perseus, steps["perseus"])
    cfg = run.config
    plot_timeline(timelines, report_dir / "pipeline_timeline.png",
                  f"one iteration of pipeline 0 ({cfg.stages} stages, {cfg.microbatches} "
                  f"microbatches, {cfg.profile}, time scale {cfg.time_scale:g}), measured")
    images.append("pipeline_timeline.png")
    summary["images"] = images
    return summary
