"""LeaseTable: grant, replace, renew, release, expire, deadlines, validation."""

from __future__ import annotations

import math

import pytest

from zeus_agent.agent.core.leases import LEASE_KINDS, MAX_TTL_S, Lease, LeaseTable, check_ttl

S = 1_000_000_000


def test_kinds() -> None:
    assert LEASE_KINDS == ("power_limit", "sm_clocks", "schedule")


def test_grant_sets_deadline_and_is_held() -> None:
    table = LeaseTable()
    lease = table.grant("power_limit", "coord-1", now_ns=10, ttl_s=2.5)
    assert lease == Lease("power_limit", "coord-1", 10 + 2_500_000_000)
    assert table.held() == [lease]
    assert table.get("power_limit") == lease
    assert table.next_deadline_ns() == lease.deadline_ns
    assert len(table) == 1


def test_lease_is_frozen() -> None:
    lease = Lease("power_limit", "a", 1)
    with pytest.raises(AttributeError):
        lease.holder = "b"  # type: ignore[misc]


def test_new_grant_replaces_previous_holder() -> None:
    table = LeaseTable()
    table.grant("sm_clocks", "job-a", 0, 5)
    new = table.grant("sm_clocks", "job-b", S, 1)
    assert table.held() == [new]
    assert table.renew("job-a", S, 10) == []  # job-a no longer holds anything
    assert table.expire(2 * S) == [new]


@pytest.mark.parametrize(
    ("ttl_s", "ok"),
    [
        (1, True),
        (0.001, True),
        (1e-12, True),
        (0, False),
        (-1, False),
        (math.inf, False),
        (math.nan, False),
        (True, False),
        ("1", False),
    ],
)
def test_ttl_validation(ttl_s: object, ok: bool) -> None:
    table = LeaseTable()
    if ok:
        lease = table.grant("schedule", "h", 100, ttl_s)  # type: ignore[arg-type]
        assert lease.deadline_ns > 100
    else:
        with pytest.raises(ValueError, match="ttl_s must be a finite number of seconds > 0"):
            table.grant("schedule", "h", 100, ttl_s)  # type: ignore[arg-type]
        table.grant("schedule", "h", 100, 1)
        with pytest.raises(ValueError, match="> 0"):
            table.renew("h", 100, ttl_s)  # type: ignore[arg-type]


@pytest.mark.parametrize("ttl_s", [MAX_TTL_S + 1, 1e300, 10**400])
def test_ttl_above_the_maximum_is_refused_and_leaves_the_table_unchanged(ttl_s: float) -> None:
    table = LeaseTable()
    held = table.grant("power_limit", "h", 0, 5)
    with pytest.raises(ValueError, match="at most 3600 s"):
        table.grant("power_limit", "other", 0, ttl_s)
    with pytest.raises(ValueError, match="at most 3600 s"):
        table.renew("h", 0, ttl_s)
    assert table.held() == [held]
    assert table.grant("power_limit", "h", 0, MAX_TTL_S).deadline_ns == 3600 * S


def test_a_smaller_maximum_and_check_ttl() -> None:
    table = LeaseTable(max_ttl_s=10)
    with pytest.raises(ValueError, match="at most 10 s"):
        table.grant("sm_clocks", "h", 0, 11)
    assert check_ttl(2.5) == 2.5
    with pytest.raises(ValueError):
        LeaseTable(max_ttl_s=math.inf)


def test_reinstate_puts_back_the_previous_lease_or_none() -> None:
    table = LeaseTable()
    first = table.grant("power_limit", "first", 0, 5)
    table.grant("power_limit", "second", S, 5)
    table.reinstate("power_limit", first)
    assert table.held() == [first]
    table.grant("schedule", "j", 0, 1)
    table.reinstate("schedule", None)
    assert table.get("schedule") is None
    with pytest.raises(ValueError, match="Cannot reinstate"):
        table.reinstate("sm_clocks", first)


@pytest.mark.parametrize(
    ("kind", "holder", "fragment"),
    [
        ("fan_speed", "h", "Unknown lease kind 'fan_speed'; expected one of power_limit"),
        ("power_limit", "", "holder must be a non-empty string"),
    ],
)
def test_grant_validation(kind: str, holder: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        LeaseTable().grant(kind, holder, 0, 1)


def test_renew_extends_every_live_lease_of_the_holder() -> None:
    table = LeaseTable()
    table.grant("schedule", "coord", 0, 1)
    table.grant("power_limit", "coord", 0, 1)
    table.grant("sm_clocks", "other", 0, 1)
    renewed = table.renew("coord", S // 2, 3)
    assert renewed == ["power_limit", "schedule"]  # LEASE_KINDS order
    deadline = S // 2 + 3 * S
    assert [(le.kind, le.deadline_ns) for le in table.held()] == [
        ("power_limit", deadline),
        ("sm_clocks", S),
        ("schedule", deadline),
    ]
    assert table.renew("nobody", S // 2, 3) == []


def test_renew_never_revives_a_lapsed_lease() -> None:
    table = LeaseTable()
    lease = table.grant("power_limit", "coord", 0, 1)
    # The renewal arrives at the deadline, before the shell's timer ran `expire`.
    assert table.renew("coord", S, 10) == []
    assert table.expire(S) == [lease]


# Table: (grants as (kind, holder, now_ns, ttl_s), expire_at, expected expired kinds, left).
EXPIRY_CASES = [
    ([], 10 * S, [], []),
    ([("power_limit", "a", 0, 1)], S - 1, [], ["power_limit"]),
    ([("power_limit", "a", 0, 1)], S, ["power_limit"], []),  # lapses at the deadline
    (
        [("schedule", "a", 0, 1), ("power_limit", "b", 0, 3), ("sm_clocks", "a", 0, 2)],
        2 * S,
        ["schedule", "sm_clocks"],  # earliest deadline first
        ["power_limit"],
    ),
    (
        [("schedule", "a", 0, 1), ("power_limit", "b", 0, 1)],
        S,
        ["power_limit", "schedule"],  # same deadline: kind order
        [],
    ),
]


@pytest.mark.parametrize(("grants", "at", "expired", "left"), EXPIRY_CASES)
def test_expire(
    grants: list[tuple[str, str, int, float]], at: int, expired: list[str], left: list[str]
) -> None:
    table = LeaseTable()
    for kind, holder, now, ttl in grants:
        table.grant(kind, holder, now, ttl)
    assert [le.kind for le in table.expire(at)] == expired
    assert [le.kind for le in table.held()] == left
    assert table.expire(at) == []  # idempotent


def test_next_deadline_follows_the_earliest() -> None:
    table = LeaseTable()
    assert table.next_deadline_ns() is None
    table.grant("power_limit", "a", 0, 5)
    table.grant("sm_clocks", "a", 0, 2)
    assert table.next_deadline_ns() == 2 * S
    table.release("sm_clocks")
    assert table.next_deadline_ns() == 5 * S
    table.expire(5 * S)
    assert table.next_deadline_ns() is None


def test_release() -> None:
    table = LeaseTable()
    lease = table.grant("sm_clocks", "a", 0, 1)
    assert table.release("sm_clocks", holder="b") is None  # not b's
    assert table.release("sm_clocks") == lease
    assert table.release("sm_clocks") is None
    with pytest.raises(ValueError, match="Unknown lease kind"):
        table.release("bogus")


def test_release_holder() -> None:
    table = LeaseTable()
    pl = table.grant("power_limit", "job", 0, 1)
    sc = table.grant("schedule", "job", 0, 1)
    other = table.grant("sm_clocks", "x", 0, 1)
    assert table.release_holder("job") == [pl, sc]
    assert table.held() == [other]
