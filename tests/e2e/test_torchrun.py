"""Real process groups: `torchrun` (gloo, CPU) against a real broker, agent and coordinator.

Every test starts, as separate processes, `nats-server`, `zeus-coordinator run` and one
`zeus-agent run --backend sim --sim-count 4` (A40s, a 10 ms energy counter: the steps here are
~10x shorter than real ones, so is the counter's period), then launches a training script with
`torchrun --standalone`; its ranks find the agent through `ZEUS_AGENT_SOCKET`. The scripts use
the Zeus drop-ins as Zeus 0.16 documents them, so the agent's log must hold no WARNING.

* DDP (`examples/ddp_power_limit.py`, the example users run): one job of world size 4, every
  GPU pinned at the limit the selector picks from the job's measured profile; the same with a
  selector of the script's own (`--selector custom`), run in rank 0's process;
* FSDP2 (`fully_shard` on gloo, the same script with `--parallel fsdp`);
* `transformers.Trainer` with `HFGlobalPowerLimitOptimizer` (`examples/huggingface_trainer.py`,
  2 processes);
* a rank SIGKILLed mid-profiling: torchrun tears the group down, the agent restores every GPU
  and the job's status says why;
* short steps on a real GPU's 100 ms energy counter (issue 34 item 5; this test's agent runs
  with `--sim-energy-update-ms 100`): the same `Trainer` with 13 ms of GPU work per step and
  `profile_steps=3` (3-step windows last 45-85 ms, under one period): the job says its windows
  were lengthened, measures every limit's energy within 5% and pins the Energy selector's
  optimum, 100 W.

Marked `torchrun` (`pytest -m torchrun` runs them alone; `-m "not torchrun"` skips them).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from coordinator.power_limit import Energy, ZeusCost
from tests.repo_kit import REPO_ROOT
from zeus_agent.emit import ENV_SOCKET
from zeus_agent.gpu.sim.physics import operating_point
from zeus_agent.gpu.sim.presets import PRESETS, WORKLOADS
from zeus_agent.models import PowerLimitMeasurement
from zeus_agent.wire import codec
from zeus_agent.wire.messages import JobStatus
from zeus_demo.cluster import SimCluster, console_script, processes_with_mark

pytestmark = [pytest.mark.torchrun, pytest.mark.timeout(180)]

NODE = "node-a"
A40_DEFAULT_W = 300
PL_STEP = 50
LIMITS = list(range(300, 99, -PL_STEP))
"""The A40's limits profiled: `pl_step` 50 W (5 limits) keeps each run short."""
EXAMPLES = REPO_ROOT / "examples"
TORCHRUN = console_script("torchrun", "torch.distributed.run")


class TorchrunCluster(SimCluster):
    """NATS, a coordinator and one 4-GPU agent as processes; every job status is recorded."""

    def __init__(self, agent_args: Sequence[str] = ()) -> None:
        super().__init__(nodes=(NODE,), gpus_per_node=4, agent_args=agent_args)

    async def _on_status(self, msg: Any) -> None:
        self.statuses.append((time.monotonic(), codec.decode(msg.data, JobStatus)))
        self._changed.set()

    def torchrun(self, nproc: int, script: Path, *args: str) -> None:
        """Launch `torchrun --standalone --nproc_per_node nproc script args` ("trainer")."""
        argv = [*TORCHRUN, "--standalone", "--nproc_per_node", str(nproc), str(script), *args]
        self.procs.spawn("trainer", argv, cwd=REPO_ROOT, env={
            ENV_SOCKET: str(self.socket_path(NODE)),
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        })

    async def trainer_exit(self, timeout_s: float) -> int:
        proc = self.procs.procs["trainer"]
        try:
            await self.wait(lambda: proc.poll() is not None, timeout_s)
        except TimeoutError:
            raise AssertionError(f"torchrun did not end within {timeout_s} s; statuses:\n"
                                 f"{self.messages()}\n{self.procs.log('trainer')}") from None
        return int(proc.returncode)

    def rank_pids(self) -> dict[int, int]:
        """Global rank -> pid of each rank process torchrun started (their RANK variable)."""
        pids: dict[int, int] = {}
        for pid in processes_with_mark(self.procs.mark):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"torch.distributed.run" in cmdline or b"torchrun" in cmdline:
                continue  # The launcher (it has no RANK) .
            for item in env:
                if item.startswith(b"RANK="):
                    pids[int(item[5:])] = pid
        return pids

    def agent_log(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in self.procs.logs[f"agent-{NODE}"])

    def limits(self) -> list[int]:
        return [self.gpu_limit(NODE, i) for i in range(self.gpus_per_node)]

    def job_statuses(self, job_id: str) -> list[JobStatus]:
        return [s for _, s in self.statuses if s.job_id == job_id]


async def started(c: TorchrunCluster) -> AsyncIterator[TorchrunCluster]:
    try:
        await c.start()
        yield c
    finally:
        await c.close()
    assert not c.strays, f"processes left behind: {c.strays}"


@pytest.fixture
async def cluster() -> AsyncIterator[TorchrunCluster]:
    async for c in started(TorchrunCluster()):
        yield c


@pytest.fixture
async def real_counter_cluster() -> AsyncIterator[TorchrunCluster]:
    """The agent's simulated GPUs' energy counters update every 100 ms, as a real GPU's do
    (the other tests' 10 ms counters keep pace with their ~10x shorter steps)."""
    async for c in started(TorchrunCluster(agent_args=("--sim-energy-update-ms", "100"))):
        yield c


def warnings_in(log: str) -> list[str]:
    return [line for line in log.splitlines() if " WARNING " in line or " ERROR " in line]


async def restored(c: TorchrunCluster, timeout_s: float = 10) -> list[int]:
    """Wait until every GPU is back at its default limit; return the limits."""
    try:
        await c.wait(lambda: c.limits() == [A40_DEFAULT_W] * 4, timeout_s)
    except TimeoutError:
        raise AssertionError(f"GPUs not restored: {c.limits()}\n"
                             f"{c.procs.log('agent-' + NODE)}") from None
    return c.limits()


async def run_ddp_example(c: TorchrunCluster, tmp_path: Path, *extra: str) -> dict[str, Any]:
    """Run examples/ddp_power_limit.py on 4 ranks to its end; return rank 0's summary."""
    summary = tmp_path / "summary.json"
    c.torchrun(4, EXAMPLES / "ddp_power_limit.py",
               "--sim-state-dir", str(c.sim_dir(NODE)), "--scale", "0.25",
               "--epochs", "3", "--steps", "25", "--batch-size", "16", "--hidden", "16",
               "--warmup-steps", "1", "--profile-steps", "3", "--pl-step", str(PL_STEP),
               "--summary", str(summary), *extra)
    rc = await c.trainer_exit(120)
    assert rc == 0, c.procs.log("trainer", 12000)
    return json.loads(summary.read_text())


async def check_pinned_at_the_selectors_choice(c: TorchrunCluster, result: dict[str, Any],
                                               world: int) -> int:
    """One job of `world` ranks, pinned on every GPU at what ZeusCost picks from its profile."""
    job_id = result["job_id"]
    assert job_id and f"+dp{world}+pp1+tp1+" in job_id, result
    assert {r["job_id"] for r in result["ranks"]} == {job_id}  # one job, every rank in it
    answer = await c.query(job_id)
    progress = answer["power_limit"]
    assert progress, f"{answer}\n{c.messages()}\n{c.procs.log('coordinator')}"
    measurements = [PowerLimitMeasurement(**m) for m in progress["measurements"]]
    assert sorted(m.power_limit for m in measurements) == sorted(LIMITS), (
        f"{progress}\n{c.messages()}\n{c.procs.log('coordinator')}\n{c.procs.log('trainer')}")
    optimum = progress["optimal_power_limit_w"]
    assert optimum == ZeusCost(eta_knob=0.5, world_size=world).select(measurements)
    # Every rank's GPU ran its last steps at that limit (read from the simulated GPU).
    assert [r["final_power_limit_w"] for r in result["ranks"]] == [optimum] * world, result
    assert all(r["dropped"] == 0 for r in result["ranks"]), result
    states = [s.state for s in c.job_statuses(job_id)]
    assert states[0] == "registered" and "profiling" in states and "done" in states, states
    done = [s for s in c.job_statuses(job_id) if s.state == "done"][-1]
    assert done.progress["optimal_power_limit_w"] == optimum
    return optimum


async def test_ddp_example_pins_every_gpu_at_the_selectors_choice(
    cluster: TorchrunCluster, tmp_path: Path
) -> None:
    c = cluster
    result = await run_ddp_example(c, tmp_path)
    assert result["world_size"] == 4 and result["parallel"] == "ddp"
    assert result["losses"][-1] < result["losses"][0]
    optimum = await check_pinned_at_the_selectors_choice(c, result, 4)
    # What anyone would look at: `zeus-coordinator watch JOB --once` shows the same profile.
    proc = await asyncio.create_subprocess_exec(
        *console_script("zeus-coordinator", "coordinator.cli"), "watch", result["job_id"],
        "--once", "--nats-url", c.url, stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, out
    watched = json.loads(out)["power_limit"]
    assert watched["optimal_power_limit_w"] == optimum
    assert optimum == ZeusCost(eta_knob=0.5, world_size=4).select(
        [PowerLimitMeasurement(**m) for m in watched["measurements"]])
    # The ranks said goodbye: the agent put every GPU back at its default limit.
    await restored(c)
    assert warnings_in(c.agent_log()) == []


async def test_a_selector_of_the_scripts_own_chooses_in_rank_0s_process(
    cluster: TorchrunCluster, tmp_path: Path
) -> None:
    """The example's `LeastEnergyWithin(1.2)`, a subclass of `OptimumSelector`: rank 0's
    process runs it on the job's measured profile and every GPU is pinned at its choice."""
    c = cluster
    result = await run_ddp_example(c, tmp_path, "--selector", "custom")
    job_id = result["job_id"]
    progress = (await c.query(job_id))["power_limit"]
    measurements = [PowerLimitMeasurement(**m) for m in progress["measurements"]]
    assert sorted(m.power_limit for m in measurements) == sorted(LIMITS), progress
    fastest = min(m.time for m in measurements)
    expected = min((m for m in measurements if m.time <= 1.2 * fastest),
                   key=lambda m: m.energy).power_limit
    assert progress["optimal_power_limit_w"] == expected
    assert [r["final_power_limit_w"] for r in result["ranks"]] == [expected] * 4, result
    states = [s.state for s in c.job_statuses(job_id)]
    assert "selecting" in states and states.count("done") == 1, states
    done = next(s for s in c.job_statuses(job_id) if s.state == "done")
    assert "LeastEnergyWithin(slowdown=1.2) in rank 0's process" in done.message, done.message
    await restored(c)
    assert warnings_in(c.agent_log()) == []


async def test_fsdp_fully_shard_on_gloo_pins_every_gpu(
    cluster: TorchrunCluster, tmp_path: Path
) -> None:
    c = cluster
    result = await run_ddp_example(c, tmp_path, "--parallel", "fsdp")
    assert result["world_size"] == 4 and result["parallel"] == "fsdp"
    assert result["losses"][-1] < result["losses"][0]
    await check_pinned_at_the_selectors_choice(c, result, 4)
    await restored(c)
    assert warnings_in(c.agent_log()) == []


async def test_hugging_face_trainer_under_torchrun(
    cluster: TorchrunCluster, tmp_path: Path
) -> None:
    c = cluster
    summary = tmp_path / "summary.json"
    c.torchrun(2, EXAMPLES / "huggingface_trainer.py",
               "--sim-state-dir", str(c.sim_dir(NODE)), "--workload", "A40+resnet50+gpu0,1,2,3",
               "--scale", "0.25", "--epochs", "2", "--samples", "256", "--batch-size", "4",
               "--warmup-steps", "1", "--profile-steps", "3", "--pl-step", str(PL_STEP),
               "--summary", str(summary))
    rc = await c.trainer_exit(150)
    assert rc == 0, c.procs.log("trainer", 12000)
    result = json.loads(summary.read_text())
    assert result["world_size"] == 2
    assert result["steps"] == 2 * 256 // (4 * 2)
    optimum = await check_pinned_at_the_selectors_choice(c, result, 2)
    assert c.limits()[2:] == [A40_DEFAULT_W] * 2  # GPUs 2 and 3 were not in the job
    assert optimum in result["ranks"][0]["power_limits_w"]
    await restored(c)
    assert warnings_in(c.agent_log()) == []


async def test_a_rank_killed_mid_profiling_restores_the_gpus_and_the_job_says_why(
    cluster: TorchrunCluster, tmp_path: Path
) -> None:
    c = cluster
    c.torchrun(4, EXAMPLES / "ddp_power_limit.py",
               "--sim-state-dir", str(c.sim_dir(NODE)), "--scale", "0.25",
               "--epochs", "20", "--steps", "25", "--batch-size", "16", "--hidden", "16",
               "--warmup-steps", "2", "--profile-steps", "6")
    _, status = await c.wait_status(
        lambda s: s.state == "profiling" and (s.progress or {}).get("measured", 0) >= 1, 90,
        "profiling, one limit measured")
    job_id = status.job_id
    # The coordinator has set a limit below the maximum on every GPU of the job.
    await c.wait(lambda: max(c.limits()) < A40_DEFAULT_W, 10)
    pids = c.rank_pids()
    assert sorted(pids) == [0, 1, 2, 3], pids
    seen = len(c.statuses)
    os.kill(pids[2], signal.SIGKILL)
    rc = await c.trainer_exit(60)
    assert rc != 0  # torchrun saw rank 2 fail and tore the group down
    assert await restored(c) == [A40_DEFAULT_W] * 4
    _, why = await c.wait_status(
        lambda s: s.job_id == job_id and s.state in ("error", "stopped", "failed", "gave_up"),
        20, "a status saying why the job ended", after=seen)
    assert "rank" in why.message and "gone" in why.message, why
    # The job's status stays put: no new limit is commanded to GPUs without a trainer.
    await asyncio.sleep(1.0)
    assert c.limits() == [A40_DEFAULT_W] * 4



HF_WORKLOAD = "A40+resnet50+gpu0,1,2,3"
SHORT_STEP_SCALE = 0.0625
"""12.8 ms of simulated GPU work per step at 300 W (204 ms unscaled): 3 steps last ~40 ms."""


def gpu_step_energy_j(limit: int, step_s: float) -> float:
    """What one GPU draws over a step of `step_s` (J): the workload's step at `limit` (the
    simulator's physics, scaled), then idle (30 W) until the rank's step ends."""
    hw = PRESETS["A40"]
    op = operating_point(hw, WORKLOADS[HF_WORKLOAD], limit)
    busy_s = SHORT_STEP_SCALE * op.step_time_s
    return SHORT_STEP_SCALE * op.energy_j + hw.idle_power_w * max(0.0, step_s - busy_s)


def energy_optimum() -> int:
    """The limit `Energy` picks from the workload's noise-free profile, whether the steps are
    the GPU's (each limit's own step time) or the CPU's (one longer step time at every limit):
    the same either way."""
    hw, wl = PRESETS["A40"], WORKLOADS[HF_WORKLOAD]
    gpu_s = {limit: SHORT_STEP_SCALE * operating_point(hw, wl, limit).step_time_s
             for limit in LIMITS}
    picks = {Energy().select([PowerLimitMeasurement(power_limit=limit, time=step_s,
                                                    energy=gpu_step_energy_j(limit, step_s))
                              for limit in LIMITS])
             for step_s in [*gpu_s.values(), 1.5 * max(gpu_s.values())]}
    assert len(picks) == 1, picks
    return picks.pop()


async def test_short_steps_on_a_100_ms_counter_lengthen_the_windows_and_pin_the_optimum(
    real_counter_cluster: TorchrunCluster, tmp_path: Path
) -> None:
    """Issue 34 item 5, on the run it describes: `transformers.Trainer` under torchrun (2 gloo
    ranks, `HFGlobalPowerLimitOptimizer`), the ResNet-50 workload's steps scaled to 13 ms,
    `profile_steps=3`, `pl_step` 50 W, energy counters updating every 100 ms. Before the fix
    every window lasted 35-44 ms, the energies were noise (250 W drew more than 300 W) and runs
    pinned 300 W or 150 W; now the first window is found too short, every limit is profiled
    for enough steps to span 5 periods, each energy is the physics' within 5%, and the job
    pins the workload's optimum, 100 W (or, on a host so loaded that 100 W's steps ran 5.6 ms
    longer than the others', the optimum of the steps as they ran, within 5%).

    The selector is `Energy` (`--selector energy`): from 300 W down to 200 W the workload runs
    at the same speed and energy, 150 W takes 11% less energy per step, 100 W 22% less. The
    issue's run used Zeus's default, ZeusCost (eta 0.5, 2 GPUs), whose optimum is 100 W too,
    but by 0.9% over 150 W and only while the steps are the GPU's: on a 2-core CPU the ranks'
    steps are the CPU's (18-25 ms, jittering 10-20% from one window to the next), so that time,
    ~80% of ZeusCost's cost, ranks the limits by chance (150, 200 and 250 W in three runs,
    their energies all right). Energy's choice holds unless 100 W's steps run 5.6 ms longer.
    """
    c = real_counter_cluster
    optimum = energy_optimum()
    assert optimum == 100
    summary = tmp_path / "summary.json"
    started_at = time.monotonic()
    # One long epoch (an epoch end cancels a window; lengthened ones are 25-50 steps): 4000
    # samples of 4 on 2 ranks are 500 steps, and profiling takes at most ~350.
    c.torchrun(2, EXAMPLES / "huggingface_trainer.py",
               "--sim-state-dir", str(c.sim_dir(NODE)), "--workload", HF_WORKLOAD,
               "--scale", str(SHORT_STEP_SCALE), "--samples", "4000", "--batch-size", "4",
               "--max-steps", "500", "--warmup-steps", "1", "--profile-steps", "3",
               "--pl-step", str(PL_STEP), "--selector", "energy", "--summary", str(summary))
    rc = await c.trainer_exit(150)
    trained_s = time.monotonic() - started_at
    assert rc == 0, c.procs.log("trainer", 12000)
    result = json.loads(summary.read_text())
    job_id = result["job_id"]
    assert job_id and "+dp2+pp1+tp1+" in job_id, result
    assert {r["job_id"] for r in result["ranks"]} == {job_id}
    said = [s.message for s in c.job_statuses(job_id)]
    # The agent announced its GPUs' 100 ms counters; the job set its minimum window from them.
    first = next(m for m in said if m.startswith(f"profiling {len(LIMITS)} power limits"))
    # (Learnt from the agent's reads: 99-101 ms on a loaded host.)
    assert re.search(r"windows of at least 0\.(49|5\d?) s \(5 periods of the GPUs' (99|100|101) "
                     r"ms energy counters\)", first), said
    # The first window lasted about what the did, and the job said it lengthened them.
    raised = [m for m in said if "profile_steps is a minimum" in m]
    assert raised, "\n".join(said)
    # (A window may cover a step less than profile_steps when a rank runs a step behind: the
    # join ends it at the last step every rank agrees on.)
    lasted = re.match(r"windows of [23] steps lasted (\d+) ms, under 5 energy-counter periods "
                      r"\((?:99|100|101) ms\): profiling (\d+) steps per limit", raised[0])
    assert lasted, raised
    window_ms, steps = int(lasted[1]), int(lasted[2])
    # (35-45 ms on a quiet host; 108 ms was seen with the host's load at 5: still short.)
    assert window_ms < 500 and steps > 3, raised
    # (The first steps are the slowest: the minimum may be raised again, once or twice.)
    assert len(raised) <= 3, raised
    # Every limit measured (per profile_steps steps) within 5% of what the physics says for
    # the time its steps took.
    progress = (await c.query(job_id))["power_limit"]
    measurements = [PowerLimitMeasurement(**m) for m in progress["measurements"]]
    assert sorted(m.power_limit for m in measurements) == sorted(LIMITS), progress
    off = {m.power_limit: m.energy / (2 * 3 * gpu_step_energy_j(m.power_limit, m.time / 3)) - 1
           for m in measurements}
    chosen = progress["optimal_power_limit_w"]
    print(f"\nfirst window {window_ms} ms -> {steps} steps per limit (raised {len(raised)}x); "
          f"chose {chosen} W (optimum {optimum} W); per step: " + ", ".join(
              f"{m.power_limit} W {m.time / 3 * 1000:.1f} ms {m.energy / 3:.2f} J "
              f"({off[m.power_limit]:+.1%})" for m in measurements) +
          f"; torchrun {trained_s:.1f} s, {result['steps']} steps")
    # Within 5% while the agent's reads stay locked on the counters' update grid. A host stalled
    # long enough for 4 reads in a row to miss (CI, 2 cores, 2 workers) sends a GPU back to
    # learning for a few hundred ms, its knots placed between reads meanwhile: a window edge
    # then may be tens of ms off (CI once: 300 W +6.8%, 250 W -6.6%, the edge between them
    # ~43 ms late). The agent logs each loss; with one on the job's GPUs, 10%.
    phase = [line for line in c.agent_log().splitlines() if "energy counter" in line]
    lost = [line for line in phase if "lost its update grid" in line
            and re.search(r"GPU [01]:", line)]
    assert all(abs(e) < (0.10 if lost else 0.05) for e in off.values()), (off, phase)
    # The choice is the measurements' and the workload's optimum for the time the host's steps
    # took: the limits whose true energy (the physics at each window's own step time) is within
    # the measurement's 5% of the least. On a host that runs every limit's steps alike that is
    # 100 W alone (150 W takes 12% more); at load 9, 100 W's steps once took 43 ms against
    # 33-36 ms, and the idle GPUs' extra 7-10 ms per step made 150 W the true optimum too.
    true_j = {m.power_limit: gpu_step_energy_j(m.power_limit, m.time / 3) for m in measurements}
    within = {limit for limit, e in true_j.items() if e <= 1.05 * min(true_j.values())}
    assert chosen == Energy().select(measurements) and chosen in within, (within, said, progress)
    assert [r["final_power_limit_w"] for r in result["ranks"]] == [chosen] * 2, result
    assert all(r["dropped"] == 0 for r in result["ranks"]), result
    done = [s for s in c.job_statuses(job_id) if s.state == "done"]
    assert done and done[-1].progress["optimal_power_limit_w"] == chosen
    assert c.limits()[2:] == [A40_DEFAULT_W] * 2  # GPUs 2 and 3 were not in the job
    await restored(c)
    assert warnings_in(c.agent_log()) == []
