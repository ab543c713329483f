"""`CommandFence`: a GPU refuses a command whose sender's ownership lease is over.

The chaos soak (issue 38) found agents applying commands seconds after the sender's lease had
ended: held in a TCP connection through a partition, or queued in a paused replica, and
delivered late. The rules, on hand-made fencing tokens (times are the agent's clock).
"""

from __future__ import annotations

import math

import pytest

from zeus_agent.agent.core.fencing import CommandFence
from zeus_agent.wire.fencing import SenderLease, parse_lease_header

JOB = "5f3a9c"


def lease(owner: str, revision: int, until: float, inc: str = "i1", key: str = JOB) -> SenderLease:
    return SenderLease(owner, inc, revision, until, key)


def test_a_live_lease_is_taken_and_an_ended_one_refused() -> None:
    fence = CommandFence(skew_s=0.0)
    assert fence.admit(lease("r1", 5, until=110.0), now_s=100.0) is None
    refused = fence.admit(lease("r1", 5, until=110.0), now_s=118.0)
    assert refused is not None and "ended 8.000 s ago" in refused.reason
    assert fence.admit(lease("r1", 5, until=110.0), now_s=110.0) is not None  # (at its end)


def test_the_skew_allowance_refuses_a_lease_about_to_end_by_a_lagging_clock() -> None:
    fence = CommandFence(skew_s=0.5)
    assert fence.admit(lease("r1", 5, until=100.6), now_s=100.0) is None
    refused = fence.admit(lease("r1", 5, until=100.4), now_s=100.0)
    assert refused is not None and "clock skew" in refused.reason


def test_a_newer_owner_wins_and_an_older_owners_live_lease_is_refused() -> None:
    fence = CommandFence(skew_s=0.0)
    assert fence.admit(lease("r1", 5, until=130.0), now_s=100.0) is None
    assert fence.admit(lease("r2", 9, until=131.0), now_s=101.0) is None
    # r1's lease has not ended by this clock, yet r2 took the job after it: refused.
    refused = fence.admit(lease("r1", 5, until=130.0), now_s=102.0)
    assert refused is not None and "r2, revision 9" in refused.reason
    assert fence.admit(lease("r2", 9, until=131.0), now_s=103.0) is None
    assert fence.newest(JOB) == lease("r2", 9, until=131.0)


def test_a_restarted_replica_is_another_owner() -> None:
    fence = CommandFence(skew_s=0.0)
    assert fence.admit(lease("r1", 5, until=130.0, inc="old"), now_s=100.0) is None
    assert fence.admit(lease("r1", 7, until=131.0, inc="new"), now_s=101.0) is None
    assert fence.admit(lease("r1", 5, until=130.0, inc="old"), now_s=102.0) is not None


def test_the_same_owners_earlier_revision_is_taken_while_live() -> None:
    """A renewal raises the revision; a command sent just before it is the same owner's."""
    fence = CommandFence(skew_s=0.0)
    assert fence.admit(lease("r1", 8, until=131.0), now_s=100.0) is None
    assert fence.admit(lease("r1", 7, until=130.0), now_s=100.5) is None
    assert fence.newest(JOB) == lease("r1", 8, until=131.0)


def test_other_keys_are_fenced_apart() -> None:
    fence = CommandFence(skew_s=0.0)
    assert fence.admit(lease("r2", 90, until=130.0, key="jobB"), now_s=100.0) is None
    assert fence.admit(lease("r1", 5, until=130.0, key=JOB), now_s=100.0) is None


def test_a_key_is_forgotten_once_its_newest_lease_ended() -> None:
    """Revisions that start again (a state bucket made anew) are not refused forever."""
    fence = CommandFence(skew_s=0.0)
    assert fence.admit(lease("r1", 500, until=110.0), now_s=100.0) is None
    assert fence.admit(lease("r1", 3, until=130.0, inc="i2"), now_s=111.0) is None
    assert fence.newest(JOB) == lease("r1", 3, until=130.0, inc="i2")


def test_memory_is_bounded() -> None:
    fence = CommandFence(skew_s=0.0, capacity=4)
    for i in range(10):
        assert fence.admit(lease("r1", i, until=200.0, key=f"k{i}"), now_s=100.0) is None
    assert [fence.newest(f"k{i}") is not None for i in range(10)] == [False] * 6 + [True] * 4


@pytest.mark.parametrize("skew", [-0.1, math.nan])
def test_a_bad_skew_is_refused(skew: float) -> None:
    with pytest.raises(ValueError, match="skew_s"):
        CommandFence(skew_s=skew)


def test_the_header_carries_the_lease_key_and_reads_older_four_field_headers() -> None:
    token = lease("replica-a", 17, until=1234.5)
    assert parse_lease_header(token.header()) == token
    assert parse_lease_header("r1 - 3 99.5") == SenderLease("r1", "", 3, 99.5, "")
    assert parse_lease_header("r1 - x 99.5") is None
    assert parse_lease_header("a b c d e f") is None
