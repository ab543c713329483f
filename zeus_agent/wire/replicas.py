"""Coordinator replicas on the wire: how they learn of each other (`<p>.coord.replica.*.alive`).

Each replica announces itself every `lease_s / 3`, and once more when it stops (`leaving`), so
the replicas share the jobs out among those that are live (`coordinator.state.assignment`).
Only coordinators may publish there (`zeus_agent.wire.permissions.coordinator`).
"""

from __future__ import annotations

from pydantic import Field

from zeus_agent.wire.messages import Message, Name

__all__ = ["ReplicaAlive"]


class ReplicaAlive(Message):
    """A coordinator replica is live (or, `leaving`, stopping now)."""

    replica: Name = Field(min_length=1, description="The replica's name (--replica-name)")
    incarnation: Name = Field(description="Its process's random id (a restart is a new one)")
    period_s: float = Field(gt=0, le=3600, description="Seconds between its announcements")
    leaving: bool = Field(default=False, description="It is stopping: share its jobs out now")
