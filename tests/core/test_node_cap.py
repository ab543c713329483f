"""A GPU's node cap: clamps limits while its own lease holds, whatever the jobs' leases do."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zeus_agent.agent.core.node_cap import CapHolder

S = 1_000_000_000


def test_limits_are_clamped_until_the_caps_lease_ends() -> None:
    holder = CapHolder(100, 300)
    assert holder.clamp(280, 0) == 280
    holder.set(200, "grid", lease_s=10, now_ns=0)
    assert holder.clamp(280, 5 * S) == 200
    assert holder.clamp(150, 5 * S) == 150
    assert holder.renew("grid", 10, 9 * S)
    assert holder.clamp(280, 15 * S) == 200  # renewed to 19 s
    assert holder.expire(18 * S) is None
    dropped = holder.expire(19 * S)
    assert dropped is not None and dropped.cap_w == 200
    assert holder.clamp(280, 20 * S) == 280


def test_only_its_holder_renews_or_lifts_it_and_it_stays_in_range() -> None:
    holder = CapHolder(100, 300)
    assert holder.set(50, "grid", 10, 0).cap_w == 100
    assert not holder.renew("other", 10, S)
    assert not holder.lift("other")
    assert holder.lift("grid") and holder.cap is None
    with pytest.raises(ValueError):
        holder.set(200, "grid", 0, 0)


@given(st.integers(1, 1000), st.integers(1, 1000), st.integers(0, 20))
def test_a_clamped_limit_never_exceeds_a_live_cap(cap: int, want: int, at_s: int) -> None:
    holder = CapHolder(1, 1000)
    holder.set(cap, "b", 10, 0)
    got = holder.clamp(want, at_s * S)
    assert got <= want
    if at_s < 10:
        assert got <= cap
    else:
        assert got == want
