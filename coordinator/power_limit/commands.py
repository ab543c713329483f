"""One power-limit command per input: no command for a window already past (sans-I/O).

The shell executes an optimiser's actions in order, each `ApplyPowerLimit` a round trip to
every GPU of the job (tens of ms). One input can move the power-limit machine through several
windows at once: a step count that jumps after a broker outage (the steps whose events were
lost are replayed, and windows open and close on them), or a batch of events delivered late
and at once. Every window those steps opened and closed is already past: its steps ran
before any command could reach a GPU, so a command for it only holds the GPUs at a limit
nobody measures (seen: 175 W, then 150 W, for 50-100 ms each, after a nats-server restart,
before the windows' lost marks were noticed and 200 W was profiled again).

`latest_limit_only` keeps the one limit the input ends at, the limit needed now.
"""

from __future__ import annotations

from coordinator.optimizer import Action, ApplyPowerLimit

__all__ = ["latest_limit_only"]


def latest_limit_only(
    actions: list[Action], before: int | None, resend: bool = False
) -> list[Action]:
    """The actions of one input with at most one `ApplyPowerLimit`: the last, where it was.

    Args:
        actions: What the optimiser returned for one input, in order.
        before: The limit (W) the job had asked for before the input (None: none yet).
        resend: Whether the input meant to send the limit again even if unchanged (a command
            that did not land).

    Returns:
        `actions` with every `ApplyPowerLimit` but the last removed; the last one too when the
        input had several and ends at `before` (the limits in between were for windows already
        past) unless `resend`. Alone, an `ApplyPowerLimit` is kept as it is.
    """
    if len(actions) < 2:  # (Most inputs: nothing to keep apart, at no cost.)
        return actions
    commands = [i for i, a in enumerate(actions) if isinstance(a, ApplyPowerLimit)]
    if len(commands) < 2:
        return actions
    last = commands[-1]
    final = actions[last]
    assert isinstance(final, ApplyPowerLimit)
    keep_last = resend or final.watts != before
    return [a for i, a in enumerate(actions)
            if not isinstance(a, ApplyPowerLimit) or (i == last and keep_last)]
