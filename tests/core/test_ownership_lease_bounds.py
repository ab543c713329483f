"""The ownership lease in force stays long enough for the agents' fencing: a replica stops
acting a third of its lease before the end, and agents refuse commands whose lease ends within
their clock-skew allowance (0.1 s), so a lease cut to `lease_s / 2` of a very short GPU lease
(0.15 s for 0.3 s) had every command refused as stale_lease."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from coordinator.config import MIN_OWNERSHIP_LEASE_S, CoordinatorSettings
from zeus_agent.agent.core.fencing import DEFAULT_SKEW_S

pytestmark = pytest.mark.core


@pytest.mark.parametrize("lease_s, ownership_s, effective", [
    (30.0, 10.0, 10.0),  # the defaults
    (8.0, 10.0, 4.0),  # capped at half the GPU lease
    (0.3, 10.0, MIN_OWNERSHIP_LEASE_S),  # never under the floor
    (0.3, 0.9, MIN_OWNERSHIP_LEASE_S),
])
def test_the_lease_in_force(lease_s: float, ownership_s: float, effective: float) -> None:
    settings = CoordinatorSettings(lease_s=lease_s, ownership_lease_s=ownership_s)
    assert settings.effective_ownership_lease_s == effective


def test_the_floor_leaves_room_for_the_agents_skew_and_transit() -> None:
    fence_s = MIN_OWNERSHIP_LEASE_S / 3
    assert fence_s >= DEFAULT_SKEW_S + 0.15


def test_a_shorter_ownership_lease_is_refused_naming_the_bound() -> None:
    with pytest.raises(ValidationError, match="greater than or equal to 0.9"):
        CoordinatorSettings(ownership_lease_s=0.5)
