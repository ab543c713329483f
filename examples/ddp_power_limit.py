"""Data-parallel training under `torchrun` with Zeus's power-limit optimizer (the drop-ins).

One process per GPU, launched by `torchrun`; each process monitors its own GPU and builds the
optimizer, exactly as Zeus 0.16's documentation writes the training loop (only the imports
change: `zeus_agent.integrations` instead of `zeus.monitor` and `zeus.optimizer.power_limit`):

    monitor = ZeusMonitor(gpu_indices=[local_rank])
    plo = GlobalPowerLimitOptimizer(monitor)
    for epoch in range(epochs):
        plo.on_epoch_begin()
        for x, y in train_loader:
            plo.on_step_begin()
            ...  # learn from x and y
            plo.on_step_end()
        plo.on_epoch_end()

Rank 0 registers one job of the whole world size (the other ranks get its id through
`torch.distributed`), every rank binds its GPU at its node's agent, and the coordinator
profiles the power limits on rank 0's steps and pins the chosen one on every GPU of the job.

The model (a small MLP on synthetic data) trains on the CPU with `gloo` (`nccl` on GPUs), as
`DistributedDataParallel` or, with `--parallel fsdp`, FSDP2's `fully_shard`. Without GPUs, each
step also runs one step of a simulated workload on this rank's simulated GPU (the state files
of `zeus-agent run --backend sim`) and sleeps for the rest of it, as a trainer waits for its
GPU, so the limits the coordinator sets change what the agent measures. Run it (see
examples/README.md):

    torchrun --standalone --nproc_per_node 4 examples/ddp_power_limit.py \\
        --sim-state-dir /tmp/zeus-sim

Rank 0 prints a JSON summary as its last line (job id, each rank's final power limit);
`--summary PATH` also writes it to a file.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from zeus_agent.integrations import (
    GlobalPowerLimitOptimizer,
    OptimumSelector,
    PowerLimitMeasurement,
    ZeusMonitor,
)


class LeastEnergyWithin(OptimumSelector):
    """A selector of your own (Zeus: "inherit from OptimumSelector"): the least energy among
    the limits at most `slowdown` times slower than the fastest. It runs in rank 0's process."""

    def __init__(self, slowdown: float = 1.2) -> None:
        self.slowdown = slowdown

    def select(self, measurements: list[PowerLimitMeasurement]) -> int:
        fastest = min(m.time for m in measurements)
        ok = [m for m in measurements if m.time <= self.slowdown * fastest]
        return min(ok, key=lambda m: m.energy).power_limit

    def __repr__(self) -> str:
        return f"LeastEnergyWithin(slowdown={self.slowdown})"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp",
                   help="DistributedDataParallel, or FSDP2's fully_shard")
    p.add_argument("--backend", default=None,
                   help="process group backend (default nccl with CUDA, else gloo)")
    p.add_argument("--sim-state-dir", default="/tmp/zeus-sim",
                   help="the simulated GPUs' state directory (the agent's --sim-state-dir); "
                        "'' on real GPUs")
    p.add_argument("--workload", default="A40+resnet50+gpu0,1,2,3",
                   help="simulated workload run on each rank's GPU every step")
    p.add_argument("--scale", type=float, default=0.5, help="factor on the simulated step time")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--steps", type=int, default=40, help="steps (batches) per epoch")
    p.add_argument("--batch-size", type=int, default=32, help="batch size of each rank")
    p.add_argument("--hidden", type=int, default=64, help="hidden units of the MLP")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-steps", type=int, default=2,
                   help="GlobalPowerLimitOptimizer's warmup_steps (per power limit)")
    p.add_argument("--profile-steps", type=int, default=5,
                   help="GlobalPowerLimitOptimizer's profile_steps (per power limit)")
    p.add_argument("--pl-step", type=int, default=25,
                   help="GlobalPowerLimitOptimizer's pl_step (W between profiled limits)")
    p.add_argument("--selector", choices=("default", "custom"), default="default",
                   help="the optimum selector: Zeus's default (ZeusCost, eta 0.5), or "
                        "LeastEnergyWithin(1.2), a selector of this script's own")
    p.add_argument("--summary", default=None, help="rank 0 also writes its JSON summary here")
    return p


def build_model(args: argparse.Namespace, device: torch.device) -> nn.Module:
    model = nn.Sequential(nn.Linear(16, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 1))
    model.to(device)
    if args.parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    dist.init_process_group(args.backend or ("nccl" if cuda else "gloo"))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)

    gpu = workload = None
    if args.sim_state_dir:
        from zeus_agent.gpu.sim import SimGPU
        from zeus_agent.gpu.sim.presets import WORKLOADS

        gpu = SimGPU.open(args.sim_state_dir, local_rank)
        workload = WORKLOADS[args.workload]

    # Synthetic regression data: y = x . w + noise; each rank reads its shard of every epoch.
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.steps * args.batch_size * world, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(len(x), 1, generator=g)
    sampler = DistributedSampler(TensorDataset(x, y), seed=args.seed)
    train_loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, sampler=sampler)
    model = build_model(args, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss_fn = nn.MSELoss()

    # Zeus's documentation, with the imports changed.
    monitor = ZeusMonitor(gpu_indices=[local_rank])
    plo = GlobalPowerLimitOptimizer(
        monitor,
        optimum_selector=LeastEnergyWithin(1.2) if args.selector == "custom" else None,
        warmup_steps=args.warmup_steps,
        profile_steps=args.profile_steps,
        pl_step=args.pl_step,
    )

    losses: list[float] = []
    limits_w: list[int] = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        plo.on_epoch_begin()
        total = 0.0
        for xb, yb in train_loader:
            plo.on_step_begin()
            t0 = time.monotonic()
            if gpu is not None and workload is not None:
                limits_w.append(gpu.get_power_limit_w())
                work = gpu.run_work(workload, scale=args.scale)
            optimizer.zero_grad()
            loss = loss_fn(model(xb.to(device)), yb.to(device))
            loss.backward()
            optimizer.step()
            total += loss.item()
            if gpu is not None:  # Wait for the (simulated) GPU, as .item() would.
                time.sleep(max(0.0, work.duration_s - (time.monotonic() - t0)))
            plo.on_step_end()
        plo.on_epoch_end()
        losses.append(total / len(train_loader))
        if rank == 0:
            print(f"epoch {epoch}: loss {losses[-1]:.4f}"
                  + (f", power limit {limits_w[-1]} W" if limits_w else ""), flush=True)

    mine: dict[str, Any] = {
        "rank": rank,
        "job_id": plo.job_id,
        "final_power_limit_w": gpu.get_power_limit_w() if gpu is not None else None,
        "power_limits_w": sorted(set(limits_w)),
        "dropped": plo.publisher.stats().dropped,
    }
    ranks: list[Any] = [None] * world
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        summary = {"job_id": plo.job_id, "world_size": world, "parallel": args.parallel,
                   "losses": losses, "ranks": ranks}
        if args.summary:
            with open(args.summary, "w") as f:
                json.dump(summary, f)
        print(json.dumps(summary), flush=True)
    dist.barrier()  # Every rank done with the group before any leaves.
    plo.publisher.close()  # Its goodbye to the agent (`leave` skips the exit handlers).
    leave(0)  # Before `model` (its DDP wrapper holds the process group) is freed.
    return 0


def leave(code: int) -> None:
    """Exit at once, everything flushed first, without freeing the model.

    The DDP (or FSDP) wrapper holds the gloo process group: freeing it destroys the group
    with the GIL held and joins a gloo worker that may still need the GIL to free the tensors
    of the last collectives, so the exit can deadlock (seen with py-spy in the Hugging Face
    example: `AsyncBarrierWork` -> `AsyncAllgatherWork` -> `decref_pyobject`), and
    `destroy_process_group()` cannot help while the wrapper keeps its reference.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    raise SystemExit(main())
