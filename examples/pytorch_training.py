"""A real PyTorch training loop, instrumented with `zeus_agent.emit`, driving a simulated GPU.

The model (a small MLP regressing a noisy linear function of synthetic data) trains on the CPU.
Each step also runs one step of a simulated workload on a simulated GPU (the state files a
`zeus-agent --backend sim` creates), so the node's agent has energy to measure, and sleeps for
the rest of the simulated step time, as a trainer waits for its GPU.

Instrumentation (four calls, the same on a real GPU):

* `emit.init(job_info=..., power_limit=...)` registers the job with the coordinator through the
  agent (with a coordinator the job's power limit is optimised; without one, the example warns
  and keeps measuring windows only);
* `epoch_begin`/`epoch_end` and `step_begin`/`step_end` around epochs and steps (the agent
  measures every step and publishes it on `zeus.job.<job>.meas.<node>`);
* `emit.window("epoch-N")`: a profiling window (time and per-GPU energy of the block).

Run it against an agent (see examples/README.md):

    zeus-agent run --embedded-nats --backend sim --sim-state-dir /tmp/zeus-sim \\
        --socket-path /tmp/zeus-agent.sock &
    python examples/pytorch_training.py --socket /tmp/zeus-agent.sock --sim-state-dir /tmp/zeus-sim

The last line printed is a JSON summary (job id, losses, window energies).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
from torch import nn

from zeus_agent import JobInfo, PowerLimitOptions, emit


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--socket", default=None,
                   help="the agent's socket (default $ZEUS_AGENT_SOCKET, else the agent's default)")
    p.add_argument("--sim-state-dir", default="/tmp/zeus-sim",
                   help="the simulated GPUs' state directory (the agent's --sim-state-dir); "
                        "'' to train without a simulated GPU")
    p.add_argument("--gpu-index", type=int, default=0, help="simulated GPU this process drives")
    p.add_argument("--workload", default="A40+resnet50+gpu0",
                   help="simulated workload run on the GPU each step")
    p.add_argument("--scale", type=float, default=0.1,
                   help="factor on the simulated step time")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps", type=int, default=50, help="steps (batches) per epoch")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64, help="hidden units of the MLP")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-power-limit", action="store_true",
                   help="register the job without asking for power-limit optimisation")
    p.add_argument("--warmup-steps", type=int, default=2,
                   help="power-limit optimizer: warm-up steps per limit")
    p.add_argument("--profile-steps", type=int, default=5,
                   help="power-limit optimizer: profiled steps per limit")
    return p


def synthetic_data(n: int, features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x ~ N(0, 1); y = x . w + 0.1 noise, for a fixed random w."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    y = x @ w + 0.1 * torch.randn(n, 1, generator=g)
    return x, y


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.manual_seed(args.seed)

    gpu = workload = None
    if args.sim_state_dir:
        from zeus_agent.gpu.sim import SimGPU
        from zeus_agent.gpu.sim.presets import WORKLOADS

        gpu = SimGPU.open(args.sim_state_dir, args.gpu_index)
        workload = WORKLOADS[args.workload]

    job = JobInfo(pp_degree=1, dp_degree=1, tp_degree=1, world_size=1,
                  job_metadata="pytorch-example")
    power_limit = None if args.no_power_limit else PowerLimitOptions(
        warmup_steps=args.warmup_steps, profile_steps=args.profile_steps)
    try:
        pub = emit.init(job_info=job, power_limit=power_limit, rank=0,
                        gpu_index=args.gpu_index, socket_path=args.socket, timeout_s=5.0)
    except emit.RegistrationError as e:
        if e.code not in ("unavailable", "timeout"):
            raise
        print(f"warning: no coordinator ({e}); training without a job, measuring windows only")
        pub = emit.init(gpu_index=args.gpu_index, socket_path=args.socket)

    x, y = synthetic_data(args.steps * args.batch_size, 16, args.seed)
    model = nn.Sequential(nn.Linear(16, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss_fn = nn.MSELoss()

    losses: list[float] = []
    windows: list[dict[str, float]] = []
    for epoch in range(args.epochs):
        pub.epoch_begin()
        total = 0.0
        with pub.window(f"epoch-{epoch}") as w:
            for i in range(args.steps):
                pub.step_begin()
                t0 = time.monotonic()
                if gpu is not None and workload is not None:
                    work = gpu.run_work(workload, scale=args.scale)
                xb = x[i * args.batch_size:(i + 1) * args.batch_size]
                yb = y[i * args.batch_size:(i + 1) * args.batch_size]
                optimizer.zero_grad()
                loss = loss_fn(model(xb), yb)
                loss.backward()
                optimizer.step()
                total += loss.item()
                if gpu is not None:  # Wait for the (simulated) GPU, as .item() would.
                    time.sleep(max(0.0, work.duration_s - (time.monotonic() - t0)))
                pub.step_end()
        pub.epoch_end()
        losses.append(total / args.steps)
        result = w.result
        energy = sum(result.energy) if result is not None else math.nan
        windows.append({"time_s": result.time if result else math.nan, "energy_j": energy})
        print(f"epoch {epoch}: loss {losses[-1]:.4f}, {windows[-1]['time_s']:.2f} s, "
              f"{energy:.1f} J"
              + (f", power limit {gpu.get_power_limit_w()} W" if gpu is not None else ""))

    stats = pub.stats()
    summary = {
        "job_id": pub.job_id,
        "losses": losses,
        "windows": windows,
        "events": stats.events,
        "dropped": stats.dropped,
    }
    pub.close()
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
