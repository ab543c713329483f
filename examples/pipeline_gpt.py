"""A small GPT trained with `torch.distributed.pipelining`, each action paced by a simulated GPU.

A GPT built from torch alone (token and position embeddings, pre-norm causal self-attention
blocks, a tied-free output head; nothing is downloaded) learns a synthetic language (counting
modulo the vocabulary). It is cut into one stage per rank for `ScheduleGPipe`/`Schedule1F1B`,
two per rank for the looped, interleaved and V-shape schedules, and trained over gloo
processes started by `torchrun`. One line instruments the schedule for Perseus:

    instrument_pipeline(schedule, optimizer=perseus)

so every forward, full backward, backward-input and backward-weight action is reported to the
node's agent as `kind:stage:microbatch`, and the agent sets the SM clock the coordinator's plan
gives that action.

Each compute action is also paced by the rank's simulated GPU (`SimGPU.open(state_dir,
LOCAL_RANK)` on the state directory of a `zeus-agent --backend sim`): when it starts, the
simulator is given the action's work (`stage_workloads(profile, stages)`: the forward or
backward of that stage, fitted to the real Perseus stage profiles; a split backward's input and
weight halves each half of it), which it runs at the clock in force, and the rank waits out
the duration the simulator gives, so a lower clock really lengthens the action and changes
its energy. `--sim-state-dir ''` runs the model unpaced (no simulated GPU).

    zeus-agent run --nats-url nats://127.0.0.1:4222 --backend sim --sim-count 4 \\
        --sim-state-dir /tmp/zeus-sim --socket-path /tmp/zeus-agent.sock
    ZEUS_AGENT_SOCKET=/tmp/zeus-agent.sock torchrun --standalone --nproc_per_node 4 \\
        examples/pipeline_gpt.py --sim-state-dir /tmp/zeus-sim --schedule Interleaved1F1B

The last line printed (by rank 0) is a JSON summary: job id, schedule, steps, first and last
loss, and per rank the actions run, their simulated energy, the clocks they ran at, the actions
begun before their planned clock was locked, the first step of each schedule version, and the
last step's actions (name, the plan's clock, the clock run) with its schedule version.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
             "ZBVZeroBubble", "DualPipeV")
"""`--schedule` values: torch's `Schedule<name>` classes."""
V_SHAPE = ("ZBVZeroBubble", "DualPipeV")
SINGLE = ("GPipe", "1F1B")


class Block(nn.Module):
    """A pre-norm transformer block with causal self-attention."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPTStage(nn.Module):
    """One pipeline stage: the embeddings on the first, the head on the last, blocks on all."""

    def __init__(self, index: int, stages: int, vocab: int, length: int, width: int,
                 heads: int, blocks: int) -> None:
        super().__init__()
        self.first, self.last = index == 0, index == stages - 1
        if self.first:
            self.tokens = nn.Embedding(vocab, width)
            self.positions = nn.Embedding(length, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(blocks)))
        if self.last:
            self.ln = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.tokens(x) + self.positions(torch.arange(x.shape[1], device=x.device))
        x = self.blocks(x)
        return self.head(self.ln(x)) if self.last else x


def stage_indices(schedule: str, rank: int, world: int) -> list[int]:
    """The (virtual) stages this rank runs: its rank; looped `r, r + W`; the V `r, 2W - 1 - r`."""
    if schedule in SINGLE:
        return [rank]
    if schedule in V_SHAPE:
        return [rank, 2 * world - 1 - rank]
    return [rank, rank + world]


class ActionLog:
    """Passes a rank's events on to Perseus and keeps its last step's actions.

    Each action is kept as [name, the plan's clock (None before a plan), the clock the
    simulated GPU ran it at (None unpaced)]: what the rank ran, against what it was served.
    `versions` holds the first step run under each schedule version.
    """

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.step: list[list[Any]] = []
        self.last_step: list[list[Any]] = []
        self.last_version: int | None = None
        self.versions: dict[int | None, int] = {}
        self.steps = 0
        self.late_clocks = 0
        """Actions of a plan begun before the agent had locked their clock (waited 50 ms)."""

    @property
    def frequency(self) -> int | None:
        return self.optimizer.frequency

    def on_step_begin(self) -> None:
        self.optimizer.on_step_begin()
        self.versions.setdefault(self.optimizer.schedule_version, self.steps)
        self.step = []

    def on_step_end(self) -> None:
        self.optimizer.on_step_end()
        self.last_step, self.last_version = self.step, self.optimizer.schedule_version
        self.steps += 1

    def on_instruction_begin(self, name: str) -> None:
        self.optimizer.on_instruction_begin(name)
        self.step.append([name, self.frequency, None])

    def on_instruction_end(self, name: str) -> None:
        self.optimizer.on_instruction_end(name)

    def ran(self, mhz: int, locked: bool) -> None:
        """The action begun last ran at `mhz`, its clock `locked` as planned when it began."""
        if self.step:
            self.step[-1][2] = mhz
            self.late_clocks += self.step[-1][1] is not None and not locked


class Pacer:
    """Paces a stage's compute calls by the simulated GPU (the work the simulator runs)."""

    def __init__(self, sim_state_dir: str, gpu_index: int, profile: str, stages: int,
                 time_scale: float, optimizer: ActionLog) -> None:
        from zeus_agent.gpu.sim import SimGPU
        from zeus_agent.gpu.sim.instructions import stage_workloads

        self.gpu = SimGPU.open(sim_state_dir, gpu_index)
        self.workloads = stage_workloads(profile, stages)
        self.scale, self.optimizer = time_scale, optimizer
        self.energy_j, self.actions = 0.0, 0
        self.clocks: set[int] = set()

    def wrap(self, stage: Any) -> None:
        """Pace `stage`'s three compute entry points (wrapped before the instrumentation)."""
        work = self.workloads[stage.stage_index]
        for method, kind, share in (("forward_one_chunk", "forward", 1.0),
                                    ("backward_one_chunk", "backward", None),
                                    ("backward_weight_one_chunk", "backward", 0.5)):
            setattr(stage, method, self._paced(getattr(stage, method), work[kind], share))

    def _paced(self, call: Any, workload: Any, share: float | None) -> Any:
        @functools.wraps(call)
        def paced(*args: Any, **kwargs: Any) -> Any:
            part = share
            if part is None:  # backward_one_chunk: full, or the input half of a split one
                full = kwargs.get("full_backward", args[2] if len(args) > 2 else True)
                part = 1.0 if full else 0.5
            locked = self._wait_for_clock()
            start = time.monotonic()
            done = self.gpu.run_work(workload, scale=self.scale * part)
            result = call(*args, **kwargs)
            time.sleep(max(0.0, start + done.duration_s - time.monotonic()))
            self.energy_j += done.energy_j
            self.actions += 1
            self.clocks.add(done.sm_clock_mhz)
            self.optimizer.ran(done.sm_clock_mhz, locked)
            return result

        return paced

    def _wait_for_clock(self, timeout_s: float = 0.05) -> bool:
        """Let the agent lock the clock the plan gives the action just begun (a few ms).

        Returns:
            Whether that clock (if any) is locked.
        """
        mhz = self.optimizer.frequency
        deadline = time.monotonic() + timeout_s
        while mhz is not None and self.gpu.get_locked_sm_clocks_mhz() != (mhz, mhz):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0002)
        return True


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--schedule", choices=SCHEDULES, default="1F1B")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--microbatch-size", type=int, default=2)
    p.add_argument("--sim-state-dir", default="/tmp/zeus-sim",
                   help="the simulated GPUs' state directory; '' to run unpaced")
    p.add_argument("--profile", default="gpt3-175b+a100_sxm",
                   help="stage profile the simulated work comes from "
                   "(zeus_agent.gpu.sim.instructions.STAGE_PROFILES)")
    p.add_argument("--time-scale", type=float, default=0.1,
                   help="factor on every action's simulated duration and energy")
    p.add_argument("--socket", default=None,
                   help="the agent's socket (default $ZEUS_AGENT_SOCKET, else the default)")
    p.add_argument("--job-metadata", default=None,
                   help="appended to the job id (default pipeline_gpt-SCHEDULE)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--summary", default=None, help="rank 0 also writes its JSON summary here")
    return p


def _schedule(args: argparse.Namespace, rank: int, world: int) -> tuple[Any, list[Any]]:
    indices = stage_indices(args.schedule, rank, world)
    stages = world * len(indices)
    modules = [GPTStage(i, stages, vocab=64, length=16, width=32, heads=2, blocks=1)
               for i in indices]
    pipeline_stages = [pipelining.PipelineStage(m, i, stages, torch.device("cpu"))
                       for m, i in zip(modules, indices, strict=True)]

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    cls = getattr(pipelining.schedules, f"Schedule{args.schedule}")
    first = pipeline_stages[0] if args.schedule in SINGLE else pipeline_stages
    return cls(first, args.microbatches, loss_fn=loss_fn), modules


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from zeus_agent.integrations import PerseusOptimizer, instrument_pipeline

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dist.init_process_group("gloo")
    torch.manual_seed(args.seed)
    socket_path = args.socket or os.environ.get("ZEUS_AGENT_SOCKET")
    perseus = PerseusOptimizer(
        rank, 0, rank, 0, local_rank, 1, world, 1, world,
        f"unix://{socket_path}" if socket_path else "unix:///run/zeus-agent/agent.sock",
        job_metadata=args.job_metadata or f"pipeline_gpt-{args.schedule}")
    log = ActionLog(perseus)
    schedule, modules = _schedule(args, rank, world)
    from zeus_agent.integrations.pipelining import schedule_stages

    pacer = None
    if args.sim_state_dir:
        stages = world * len(stage_indices(args.schedule, rank, world))
        pacer = Pacer(args.sim_state_dir, local_rank, args.profile, stages, args.time_scale,
                      log)
        for stage in schedule_stages(schedule):
            pacer.wrap(stage)
    handle = instrument_pipeline(schedule, optimizer=log)
    optimizer = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=3e-3)
    batch = args.microbatches * args.microbatch_size
    losses: list[float] = []
    started = time.monotonic()
    for step in range(args.steps):
        ids = (torch.arange(17).unsqueeze(0) + torch.arange(batch).unsqueeze(1) * 7 + step) % 64
        step_losses: list[torch.Tensor] = []
        optimizer.zero_grad()
        schedule.step(ids[:, :16], target=ids[:, 1:], losses=step_losses)
        optimizer.step()
        if step_losses:
            losses.append(float(torch.stack([x.detach() for x in step_losses]).mean()))
    elapsed = time.monotonic() - started
    handle.remove()
    mine = {"rank": rank, "actions": pacer.actions if pacer else None,
            "energy_j": pacer.energy_j if pacer else None,
            "clocks_mhz": sorted(pacer.clocks) if pacer else [],
            "schedule_version": perseus.schedule_version, "late_clocks": log.late_clocks,
            "versions": [[v, first] for v, first in log.versions.items()],
            "last_step": {"version": log.last_version, "actions": log.last_step},
            "losses": losses}
    ranks: list[Any] = [None] * world
    dist.all_gather_object(ranks, mine)
    perseus.close()
    dist.barrier()  # Every rank done with the group before any tears its side down.
    dist.destroy_process_group()
    if rank != 0:
        return 0
    last = [r for r in ranks if r["losses"]]
    summary = {"job_id": perseus.job_id, "schedule": args.schedule, "steps": args.steps,
               "seconds": round(elapsed, 3),
               "first_loss": last[0]["losses"][0] if last else None,
               "last_loss": last[0]["losses"][-1] if last else None,
               "ranks": [{k: v for k, v in r.items() if k != "losses"} for r in ranks]}
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump(summary, f)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
