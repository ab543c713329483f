"""Trainer events and GPU marks as the power-limit job receives them, built by hand."""

from __future__ import annotations

from zeus_agent.wire.messages import Mark, TrainerEvent


def ev(step: int, kind: str = "step_begin", epoch: int = 0) -> TrainerEvent:
    # (The job paces windows by step counters, never by stamps: a stamp within int64 will do.)
    return TrainerEvent(kind=kind, t_ns=min(step, 10**9) * 10**9, epoch=epoch, step=step)


def mark(step: int, t_s: float, energy_j: float, kind: str = "step_begin", epoch: int = 0) -> Mark:
    return Mark(kind=kind, epoch=epoch, step=step, t_ns=round(t_s * 1e9), energy_j=energy_j)
