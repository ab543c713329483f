"""A Hugging Face `Trainer` with the drop-in power-limit callback, on a simulated GPU.

A tiny GPT-2 (built from a config: two layers, 32-wide, 64-token vocabulary; nothing is
downloaded) learns a synthetic language (counting modulo the vocabulary) on the CPU with
`transformers.Trainer`. Two callbacks:

* `HFGlobalPowerLimitOptimizer(ZeusMonitor(...))` from `zeus_agent.integrations`: the Zeus
  drop-in. It registers the job through the node's agent, and the coordinator profiles the
  power limits and pins the optimum (change the imports of a Zeus script, keep the rest);
* `SimulatedGPUWork`: for this CPU-only example, each training step also runs one step of a
  simulated workload on a simulated GPU and waits for it, so the power limit the coordinator
  sets changes something the agent can measure.

Run it against an agent and a coordinator (see examples/README.md), alone or one process per
GPU under `torchrun` (the `Trainer` starts the process group: `gloo` on the CPU):

    python examples/huggingface_trainer.py --socket /tmp/zeus-agent.sock \\
        --sim-state-dir /tmp/zeus-sim
    ZEUS_AGENT_SOCKET=/tmp/zeus-agent.sock torchrun --standalone --nproc_per_node 2 \\
        examples/huggingface_trainer.py --sim-state-dir /tmp/zeus-sim

The last line printed (by rank 0) is a JSON summary (job id, training loss, each rank's final
power limit); `--summary PATH` also writes it to a file.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from typing import Any

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from zeus_agent import emit


class CountingDataset(torch.utils.data.Dataset):
    """Sequences i, i+1, ... modulo the vocabulary: a language a tiny model can learn."""

    def __init__(self, size: int, length: int, vocab: int) -> None:
        self.size, self.length, self.vocab = size, length, vocab

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(self.length) + i) % self.vocab
        return {"input_ids": ids, "labels": ids.clone()}


class SimulatedGPUWork(TrainerCallback):
    """Run one simulated GPU step per training step and wait for it (CPU-only stand-in)."""

    def __init__(self, sim_state_dir: str, gpu_index: int, workload: str, scale: float) -> None:
        from zeus_agent.gpu.sim import SimGPU
        from zeus_agent.gpu.sim.presets import WORKLOADS

        self.gpu = SimGPU.open(sim_state_dir, gpu_index)
        self.workload = WORKLOADS[workload]
        self.scale = scale
        self._until = 0.0
        self.power_limits_w: list[int] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.power_limits_w.append(self.gpu.get_power_limit_w())
        work = self.gpu.run_work(self.workload, scale=self.scale)
        self._until = time.monotonic() + work.duration_s

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        time.sleep(max(0.0, self._until - time.monotonic()))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--socket", default=None,
                   help="the agent's socket (default $ZEUS_AGENT_SOCKET, else the agent's default)")
    p.add_argument("--sim-state-dir", default="/tmp/zeus-sim",
                   help="the simulated GPUs' state directory; '' for no simulated GPU")
    p.add_argument("--gpu-index", type=int, default=None,
                   help="GPU this process drives (default $LOCAL_RANK, else 0)")
    p.add_argument("--workload", default="A40+bert-base-uncased+gpu0",
                   help="simulated workload run on the GPU each step")
    p.add_argument("--scale", type=float, default=0.05, help="factor on the simulated step time")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--max-steps", type=int, default=-1,
                   help="stop after this many training steps (the Trainer's max_steps; it "
                   "overrides --epochs, repeating the data as needed); -1: train --epochs")
    p.add_argument("--samples", type=int, default=256, help="training sequences per epoch")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--warmup-steps", type=int, default=2,
                   help="power-limit optimizer: warm-up steps per limit")
    p.add_argument("--profile-steps", type=int, default=5,
                   help="power-limit optimizer: profiled steps per limit, a minimum: the "
                   "coordinator lengthens windows lasting under 5 periods of the GPUs' energy "
                   "counters (the job's status says so)")
    p.add_argument("--pl-step", type=int, default=25,
                   help="power-limit optimizer: W between profiled limits")
    p.add_argument("--selector", choices=("default", "energy"), default="default",
                   help="power-limit optimizer: the optimum selector, Zeus's default (ZeusCost, "
                   "eta 0.5: time weighs in, and steps bound by the CPU, as here, vary in time "
                   "by chance from one window to the next) or Energy (the least energy)")
    p.add_argument("--output-dir", default=None, help="Trainer output (default a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--summary", default=None, help="rank 0 also writes its JSON summary here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.socket:  # The drop-in, like Zeus's, takes no socket: it reads the environment.
        os.environ[emit.ENV_SOCKET] = args.socket

    from zeus_agent.integrations import Energy, HFGlobalPowerLimitOptimizer, ZeusMonitor

    gpu_index = int(os.environ.get("LOCAL_RANK", "0")) if args.gpu_index is None else args.gpu_index
    torch.manual_seed(args.seed)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)

    with tempfile.TemporaryDirectory(prefix="hf-example-") as tmp:
        # Under torchrun, the arguments start the process group: the optimizer built next
        # registers one job of the whole world size (rank 0 shares its id with the others).
        training_args = TrainingArguments(
            output_dir=args.output_dir or tmp,
            per_device_train_batch_size=args.batch_size,
            num_train_epochs=args.epochs,
            max_steps=args.max_steps,
            learning_rate=5e-3,
            logging_steps=10,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
            seed=args.seed,
        )
        monitor = ZeusMonitor(gpu_indices=[gpu_index])
        plo = HFGlobalPowerLimitOptimizer(
            monitor, warmup_steps=args.warmup_steps, profile_steps=args.profile_steps,
            pl_step=args.pl_step,
            optimum_selector=Energy() if args.selector == "energy" else None,
        )
        callbacks: list[TrainerCallback] = [plo]
        sim = None
        if args.sim_state_dir:
            sim = SimulatedGPUWork(args.sim_state_dir, gpu_index, args.workload, args.scale)
            callbacks.append(sim)
        trainer = Trainer(
            model=model,
            args=training_args,
            train_dataset=CountingDataset(args.samples, 16, config.vocab_size),
            callbacks=callbacks,
        )
        output = trainer.train()

    stats = plo.optimizer.publisher.stats()
    mine = {
        "rank": plo.optimizer.rank,
        "job_id": plo.optimizer.job_id,
        "power_limits_w": sorted(set(sim.power_limits_w)) if sim else [],
        "final_power_limit_w": sim.gpu.get_power_limit_w() if sim else None,
        "events": stats.events,
        "dropped": stats.dropped,
    }
    ranks = [mine]
    distributed = torch.distributed.is_initialized()
    if distributed:
        ranks = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(ranks, mine)
        torch.distributed.barrier()  # Every rank done with the group before any leaves.
    plo.optimizer.publisher.close()
    if plo.optimizer.rank == 0:
        print_summary(args, plo, trainer, output, mine, ranks)
    if distributed:
        leave(0)  # Before `trainer` (its DDP wrapper holds the process group) is freed.
    return 0


def print_summary(args: argparse.Namespace, plo: Any, trainer: Trainer, output: Any,
                  mine: dict[str, Any], ranks: list[Any]) -> None:
    """Rank 0's JSON summary: printed as the last line, and written to `--summary`."""
    summary = {
        "job_id": plo.optimizer.job_id,
        "world_size": len(ranks),
        "train_loss": output.training_loss,
        "steps": output.global_step,
        "first_loss": trainer.state.log_history[0].get("loss"),
        **{k: mine[k] for k in ("power_limits_w", "final_power_limit_w", "events", "dropped")},
        "ranks": ranks,
    }
    if args.summary:
        with open(args.summary, "w") as f:
            json.dump(summary, f)
    print(json.dumps(summary))


def leave(code: int) -> None:
    """Exit at once, everything flushed first, without freeing the Trainer.

    Under `torchrun` the Trainer's DDP wrapper holds the gloo process group (the Trainer
    started it). Freeing the wrapper destroys the group with the GIL held, and joins a gloo
    worker that may still need the GIL to free the tensors of the last collectives (py-spy:
    `AsyncBarrierWork` -> `AsyncAllgatherWork` -> `decref_pyobject`): the exit deadlocked,
    or aborted in the interpreter's teardown ("terminate called without an active
    exception"), a few times in a hundred runs, after training had finished and reported.
    `destroy_process_group()` cannot help while the wrapper keeps its reference.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    raise SystemExit(main())
