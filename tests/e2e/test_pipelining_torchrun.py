"""Perseus on a real `torch.distributed.pipelining` job under `torchrun`, every piece a process.

Every piece is a process: `nats-server`, `zeus-coordinator run --scheduler Perseus`, one
`zeus-agent run --backend sim` with 4 simulated GPUs of the stage profile's own (A100-SXM for
the GPT-3 A100 stages), and `torchrun --nproc_per_node 4` (gloo, CPU) running
`examples/pipeline_gpt.py`: a torch-only GPT cut into 4 stages, instrumented in one line, each
compute action paced by its rank's simulated GPU at the clock in force. Checked:

* one pipeline job of world size 4 (dp 1, pp 4) registers; Perseus learns each rank's
  `kind:stage:microbatch` order, profiles it online, plans and serves;
* the schedule served to each rank names that rank's own actions in its own order (the order
  torch's schedule runs, as the coordinator learnt it and as the rank ran its last step);
* the ranks ran their last step under the served plan: each action at the clock planned for
  it (the simulated GPU's clock while it ran), clocks differing from one action to the next;
* the job ends cleanly, every GPU's clocks are unlocked (back at the maximum) and the agent
  logged no WARNING.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.pipeline.dumps import job_dir_name
from coordinator.pipeline.planner.schedules import rank_orders
from tests.repo_kit import REPO_ROOT
from zeus_agent.emit import ENV_SOCKET
from zeus_agent.gpu.sim import SimGPU
from zeus_agent.gpu.sim.instructions import preset_for
from zeus_agent.gpu.sim.presets import PRESETS
from zeus_agent.models import load_ranks, load_sched
from zeus_agent.pipeline_order import format_action
from zeus_demo.cluster import SimCluster, console_script

pytest.importorskip("torch")

pytestmark = [pytest.mark.e2e, pytest.mark.torchrun, pytest.mark.timeout(120)]

NODE = "node-a"
WORLD = 4
MICROBATCHES = 4
STEPS = 60
"""Discovery and Perseus's 7 profiling rounds take about 32 iterations, then its plan is served
(under a loaded host the plan can come 10-15 steps later, and the last step must run it)."""
PROFILE = "gpt3-175b+a100_sxm"
PRESET = preset_for(PROFILE)
PERSEUS_ARGS = {"profiler_args": {"clocks": 3, "warmup_iterations": 1,
                                  "min_profile_iterations": 2}, "max_reprofiles": 0}
TORCHRUN = console_script("torchrun", "torch.distributed.run")


@pytest.fixture
async def cluster() -> AsyncIterator[SimCluster]:
    c = SimCluster(nodes=(NODE,), gpus_per_node=WORLD,
                     agent_args=("--sim-preset", PRESET), coordinator_args=[
                         "--scheduler", "Perseus", "--scheduler-args", json.dumps(PERSEUS_ARGS),
                         "--profiling-iterations", "3", "--switch-lead-steps", "2"])
    try:
        await c.start()
        yield c
    finally:
        await c.close()
    assert not c.strays, f"processes left behind: {c.strays}"


def one_f_one_b_names(rank: int) -> list[str]:
    """Rank `rank`'s 1F1B order with its stage and microbatches: `forward:r:i`, `backward:r:j`."""
    seen: dict[str, int] = {}
    names = []
    for kind in rank_orders("1f1b", WORLD, MICROBATCHES)[rank]:
        names.append(format_action(kind, rank, seen.get(kind, 0)))
        seen[kind] = seen.get(kind, 0) + 1
    return names


def launch(c: SimCluster, summary: Path, schedule: str) -> None:
    argv = [*TORCHRUN, "--standalone", "--nproc_per_node", str(WORLD),
            str(REPO_ROOT / "examples" / "pipeline_gpt.py"), "--schedule", schedule,
            "--sim-state-dir", str(c.sim_dir(NODE)), "--profile", PROFILE,
            "--microbatches", str(MICROBATCHES), "--steps", str(STEPS),
            "--job-metadata", c.tag, "--summary", str(summary)]
    c.procs.spawn("trainer", argv, cwd=REPO_ROOT, env={
        ENV_SOCKET: str(c.socket_path(NODE)), "OMP_NUM_THREADS": "1"})


def warnings_in(log: str) -> list[str]:
    return [line for line in log.splitlines() if " WARNING " in line or " ERROR " in line]


async def test_perseus_plans_and_serves_a_torchrun_1f1b_pipeline(
    cluster: SimCluster, tmp_path: Path
) -> None:
    c = cluster
    summary_path = tmp_path / "summary.json"
    launch(c, summary_path, "1F1B")
    _, serving = await c.wait_status(lambda s: s.state == "serving", 90, "serving")
    job_id = serving.job_id
    assert job_id.endswith(f"+dp1+pp{WORLD}+tp1+Perseus+{c.tag}"), job_id
    assert {s.job_id for s in (s for _, s in c.statuses)} == {job_id}  # one job
    served = serving.progress["schedule"]
    states = c.states()
    assert states.index("discovering") < states.index("profiling") < states.index("serving")

    proc = c.procs.procs["trainer"]
    try:
        await c.wait(lambda: proc.poll() is not None, 60)
    except TimeoutError:
        raise AssertionError(f"torchrun did not end\n{c.messages()}\n"
                             f"{c.procs.log('trainer')}") from None
    assert proc.returncode == 0, c.procs.log("trainer", 12000)
    summary: dict[str, Any] = json.loads(summary_path.read_text())
    assert summary["job_id"] == job_id and summary["last_loss"] < summary["first_loss"]

    # Perseus learnt each rank's own order, and served each rank the names it runs.
    dump = c.root / "dump" / job_dir_name(job_id)
    learnt = {r.rank: r.instructions for r in load_ranks(str(dump))}
    assert learnt == {r: one_f_one_b_names(r) for r in range(WORLD)}
    plan = {s.rank: s.frequencies for s in load_sched(str(dump), served)}
    assert {r: [n for n, _ in f] for r, f in plan.items()} == learnt

    # Each rank's last step ran under that plan: its actions, at their planned clocks.
    top = max(PRESETS[PRESET].supported_sm_clocks_mhz)
    ran_clocks = set()
    for rank in summary["ranks"]:
        # Every profiling round's schedule ran on this rank, then the plan.
        assert [v for v, _ in rank["versions"]] == [None, *range(served + 1)], rank["versions"]
        last = rank["last_step"]
        assert last["version"] == served, rank
        planned = [(n, f) for n, f in plan[rank["rank"]]]
        assert [(n, f) for n, f, _ in last["actions"]] == planned, rank
        for (name, want), (_, _, ran) in zip(planned, last["actions"], strict=True):
            # (The GPU's power limit holds the top clocks a little lower, as on a real A100.)
            assert ran == want or ran < want >= 0.95 * top, (name, want, ran, rank)
        ran_clocks |= {ran for _, _, ran in last["actions"]}
    assert len(ran_clocks) >= 2 and min(ran_clocks) < top, ran_clocks
    query = await c.query(job_id)
    assert query["pipeline"]["phase"] == "serving", query

    # The ranks left: every GPU's clocks are unlocked again, nothing was logged as wrong.
    gpus = [SimGPU.open(c.sim_dir(NODE), i) for i in range(WORLD)]
    try:
        await c.wait(lambda: all(g.get_locked_sm_clocks_mhz() is None for g in gpus), 10)
    except TimeoutError:
        raise AssertionError([g.get_locked_sm_clocks_mhz() for g in gpus]) from None
    assert warnings_in(c.procs.log(f"agent-{NODE}", 10**6)) == []
