"""`PipelineCluster`: NATS, the agents and a coordinator per job, the engine of the pipeline part.

Also the engine of `bench/perseus_savings.py`. `PipelineCluster.start()` starts an embedded NATS
(or uses an external one) and one `AgentServer` per simulated node (the cluster harness's
`LocalCluster`, `services`); `run_job(...)` starts a coordinator with a scheduler, runs the
simulated pipeline trainer (`zeus_agent.gpu.sim.trainers.pipeline`, in a thread), follows the
job's status events and measurements, snapshots the scheduler (`SchedulerSnapshot`), stops the
coordinator and returns a `JobRun`. A director (`Director`, given a `JobContext`) may run
alongside the trainer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zeus_agent.children import die_with_parent
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import JobStatus
from zeus_demo.cluster import LocalCluster
from zeus_demo.pipeline.config import PipelineDemoConfig, PipelineDemoError
from zeus_demo.pipeline.measure import JobObserver, pct_less, pct_more

LOG = logging.getLogger(__name__)

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

        # The schedule the ranks ran, as the scheduler learnt it (None: 1F1B).
        schedule = getattr(scheduler, "schedule", None)
        profile = planner.InstructionProfile.from_rows(snap.profile_rows)
        plan = planner.max_frequency_plan(profile, microbatches, schedule=schedule)
        t, e = planner.evaluate(profile, plan, microbatches,
                                snap.p_block_w if snap.p_block_w is not None
                                else planner.DEFAULT_P_BLOCK_W, schedule=schedule)
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
        self.services = LocalCluster(nats_url=nats_url, prefix=prefix, log_level=log_level,
                                     error=PipelineDemoError)
        self.url = ""
        self.nc: Any = None
        self._observers: list[JobObserver] = []
        self.top_clock_mhz = 0
        self.available_clocks: list[int] = []

    async def start(self) -> None:
        """Start NATS (unless external), the agents, and subscribe to statuses and measurements.

        Raises:
            PipelineDemoError: Something did not start.
        """
        from zeus_agent.broker import confirm_subscriptions, connect
        from zeus_agent.errors import BrokerError
        from zeus_agent.gpu.sim.presets import PRESETS

        cfg = self.config
        self.url = await self.services.start_broker()
        try:
            self.nc = await connect(self.url, "zeus-demo-pipeline")
        except BrokerError as e:
            raise PipelineDemoError(str(e)) from e
        await self.nc.subscribe(subjects.all_job_status(self.prefix), cb=self._status)
        await self.nc.subscribe(subjects.all_job_measurements(self.prefix), cb=self._measurement)
        await confirm_subscriptions(self.nc)
        for node in cfg.node_names:
            self.services.add_agent(node, {
                "sim_count": cfg.gpus_per_node, "sim_preset": cfg.preset,
                "sim_state_dir": str(self.root / node),
                "socket_path": str(self.root / f"{node}.sock"), "sample_hz": 2,
                "sim_energy_update_ms": cfg.energy_update_ms,
            })
        await self.services.wait_agents()
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
        from zeus_agent.gpu.sim.trainers.pipeline import NodeSpec, place_ranks

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
        enough: Callable[[int, JobObserver], bool] | None = None,
    ) -> JobRun:
        """Run one job under a fresh coordinator running `scheduler`; stop the coordinator.

        `iterations` at most; fewer once `enough(iterations done, the job's observer)` says so.

        Raises:
            PipelineDemoError: The coordinator did not start, the job failed, or the
                coordinator stopped the optimisation with an error.
        """
        from coordinator.pipeline.dumps import job_dir_name
        from zeus_agent.gpu.sim.trainers.pipeline import PipelineError, run_pipeline

        cfg = self.config
        started = time.monotonic()
        tag = f"{label}-{uuid.uuid4().hex[:8]}"
        observer = JobObserver(tag, on_status)
        self._observers.append(observer)
        home = self.root / f"coordinator-{tag}"
        coord, coord_task = self.services.add_coordinator(
            self._coordinator_values(home, scheduler, scheduler_args, detect_stragglers))
        director_task: asyncio.Task[None] | None = None
        marks: dict[str, int] = {}
        done_iterations: list[int] = []
        loop = asyncio.get_running_loop()
        try:
            await self.services.wait_coordinator(coord, coord_task)
            options = self._options(iterations, straggler, tag)

            def iteration_done(count: int, elapsed: float) -> bool:
                def note() -> None:
                    done_iterations.append(count)
                    observer.changed.set()
                    if on_iteration is not None:
                        on_iteration(count, elapsed)
                loop.call_soon_threadsafe(note)
                return enough is not None and enough(count, observer)

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
            await _await_steps(observer, result)
            await _end(director_task)
            job = coord.pipeline_jobs.get(result.job_id)
            snapshot = (snapshot_scheduler(scheduler, job.scheduler, cfg.microbatches)
                        if perseus_snapshot and job is not None and job.scheduler is not None
                        else None)
            schedules = _read_schedules(home / "dump" / job_dir_name(result.job_id))
        finally:
            if director_task is not None and not director_task.done():
                director_task.cancel()
            await self.services.stop_coordinator(coord, coord_task)
            self._observers.remove(observer)
        errors = [ev.message for ev in observer.statuses if ev.state == "error"]
        if errors:
            raise PipelineDemoError(f"the coordinator stopped the {label} job: {errors[-1]}")
        return JobRun(
            scheduler=scheduler, job_id=result.job_id, result=result, observer=observer,
            rank_pipeline={r.rank: r.dp_rank for r in result.ranks}, snapshot=snapshot,
            schedules=schedules, marks=marks, elapsed_s=time.monotonic() - started)

    def _options(self, iterations: int, straggler: tuple[int, float] | None,
                 tag: str) -> Any:
        """The simulated pipeline job's options (`PipelineOptions`)."""
        from zeus_agent.gpu.sim.trainers.pipeline import PipelineOptions

        cfg = self.config
        return PipelineOptions(
            profile=cfg.profile, stages=cfg.stages, microbatches=cfg.microbatches,
            dp=cfg.dp, iterations=iterations, time_scale=cfg.time_scale,
            straggler=straggler, job_metadata=tag)

    def _coordinator_values(self, home: Path, scheduler: str,
                            scheduler_args: Mapping[str, Any],
                            detect_stragglers: bool) -> dict[str, Any]:
        """The settings of a job's own coordinator (its state and dumps under `home`)."""
        values: dict[str, Any] = {
            "state_dir": str(home / "state"), "dump_dir": str(home / "dump"),
            "scheduler": scheduler, "scheduler_args": dict(scheduler_args),
            "profiling_iterations": self.config.profiling_iterations, "switch_lead_steps": 2,
        }
        if not detect_stragglers:
            values["straggler_threshold"] = 10.0  # The largest allowed: nothing is detected.
        return values

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
            # Forked from the worker thread, which waits in `run` as long as the child lives:
            # the child dies with it, and so with this process.
            proc = await asyncio.to_thread(
                subprocess.run, argv, capture_output=True, text=True, timeout=60,
                stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
            text = (proc.stdout + proc.stderr).strip()
            if proc.returncode == 0:
                return text
            if "invalid choice" not in text:
                raise PipelineDemoError(f"zeus-coordinator straggler failed: {text}")
        from zeus_agent.wire.messages import Reply, StragglerNotice

        notice = (StragglerNotice(job_id=job_id, pipeline=pipeline, clear=True) if factor is None
                  else StragglerNotice(job_id=job_id, pipeline=pipeline, factor=factor))
        subject = subjects.coord_job_straggler(self.prefix)
        msg = await self.nc.request(subject, codec.encode(notice), timeout=10)
        reply = codec.decode(msg.data, Reply)
        if not reply.ok:
            raise PipelineDemoError(f"the coordinator refused the notice: {reply}")
        return str(reply)

    async def stop(self) -> None:
        """Stop the agents and NATS; remove the temporary state."""
        try:
            await self.services.stop_services()
            if self.nc is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.nc.drain(), 5)
                self.nc = None
        finally:
            await self.services.stop_broker()
            self._tmp.cleanup()


def _coordinator_command() -> list[str] | None:
    """`zeus-coordinator` next to this Python, on PATH, or None."""
    script = Path(sys.executable).with_name("zeus-coordinator")
    if script.exists():
        return [str(script)]
    found = shutil.which("zeus-coordinator")
    return [found] if found else None


async def _end(task: asyncio.Task[None] | None) -> None:
    """Cancel a job's director if it is still going and wait for it to end."""
    if task is None:
        return
    if not task.done():
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _await_steps(observer: JobObserver, result: Any) -> None:
    """Wait up to 10 s for the agents' measurements of every step the ranks ran."""
    expected = {(r.rank, s) for r in result.ranks for s in range(len(r.iteration_time_s))}
    deadline = time.monotonic() + 10
    while not expected <= observer.steps.keys() and time.monotonic() < deadline:
        observer.changed.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(observer.changed.wait(), 0.5)


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
