"""`ColumnsChoice` and the `Zeus-Reads` header: a job's batches in columns only while its owner
is heard reading them and no coordinator heard does not.

An agent in `auto` sends a job's batches as rows until a renewal of the job (its holder) from a
coordinator that reads columns is heard, in columns while that renewal's lease lasts, and as
rows again for the lease of any renewal from one that does not (an older replica), whatever
else is heard meanwhile. A job whose owner is not heard (no lease of it held here) gets rows.
`on` and `off` ignore what is heard. The header is read leniently: absent, empty, another
layout or a garbled value mean rows. A node's rank registrations try columns (`try_columns`: a
refusal is answered in rows) unless a coordinator that does not read them is in its lease.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zeus_agent.agent.core.formats import ColumnsChoice
from zeus_agent.wire.formats import COLUMNS, READS_HEADER, reads_columns, reads_headers


def test_auto_sends_rows_until_a_coordinator_that_reads_columns_is_heard() -> None:
    choice = ColumnsChoice()
    assert not choice.columns(0.0) and not choice.columns(0.0, "j")
    choice.heard(True, 30.0, 1.0, "j")
    assert choice.columns(1.0, "j") and choice.columns(30.9, "j") and choice.columns(30.9)
    assert not choice.columns(31.0, "j") and not choice.columns(31.0)  # its lease ran out


def test_a_job_whose_owner_is_not_heard_gets_rows() -> None:
    """Its rank is bound here, but it holds no lease here: its owner may be an older replica."""
    choice = ColumnsChoice()
    choice.heard(True, 30.0, 0.0, "j")
    assert choice.columns(1.0, "j") and choice.columns(1.0)
    assert not choice.columns(1.0, "unheard")


def test_a_job_handed_to_an_older_replica_gets_rows_from_its_first_renewal() -> None:
    choice = ColumnsChoice()
    choice.heard(True, 60.0, 0.0, "j")
    choice.heard(False, 10.0, 5.0, "j")  # its new owner's word, not the longer lease before
    assert not choice.columns(5.0, "j") and not choice.columns(16.0, "j")
    choice.heard(True, 60.0, 20.0, "j")  # handed back
    assert choice.columns(20.0, "j")


def test_an_older_coordinator_heard_sends_rows_for_its_lease() -> None:
    choice = ColumnsChoice()
    choice.heard(True, 60.0, 0.0, "j")
    choice.heard(False, 10.0, 5.0, "k")  # another job's owner: any job may go to it next
    assert not choice.columns(5.0, "j") and not choice.columns(5.0)
    choice.heard(True, 60.0, 6.0, "j")  # a newer one renewing meanwhile does not override it
    assert not choice.columns(14.9, "j")
    assert choice.columns(15.0, "j") and not choice.columns(15.0, "k")


def test_on_and_off_ignore_what_is_heard() -> None:
    on, off = ColumnsChoice("on"), ColumnsChoice("off")
    for choice in (on, off):
        choice.heard(False, 60.0, 0.0, "j")
        choice.heard(True, 60.0, 0.0, "k")
    assert on.columns(1.0) and on.columns(1.0, "j") and not off.columns(1.0, "k")
    with pytest.raises(ValueError, match="auto, on, off"):
        ColumnsChoice("yes")  # type: ignore[arg-type]


HEARD = st.lists(st.tuples(st.booleans(), st.floats(0.1, 100.0), st.floats(0.0, 100.0),
                           st.sampled_from(["a", "b", "c"])), max_size=12)


@given(heard=HEARD, now=st.floats(0.0, 250.0))
def test_columns_exactly_when_the_jobs_owner_reads_them_and_no_other_heard_does_not(
        heard: list[tuple[bool, float, float, str]], now: float) -> None:
    """The rule, against every renewal heard (in any order of arrival).

    A job's owner is its latest renewal's sender; any renewal without the header, in its
    lease, means rows for every job.
    """
    choice = ColumnsChoice()
    owners: dict[str, tuple[bool, float]] = {}
    for reads, lease_s, at, holder in heard:
        choice.heard(reads, lease_s, at, holder)
        owners[holder] = (reads, at + lease_s)
    older = any(not reads and now < at + lease_s for reads, lease_s, at, _ in heard)
    for job in ("a", "b", "c"):
        reads, until = owners.get(job, (False, 0.0))
        assert choice.columns(now, job) == (not older and reads and now < until)
    assert choice.columns(now) == any(choice.columns(now, job) for job in ("a", "b", "c"))


def test_the_owners_of_jobs_gone_are_forgotten() -> None:
    """A long-lived agent hears thousands of jobs' owners over time: not all kept."""
    choice = ColumnsChoice()
    for i in range(10_000):
        choice.heard(True, 1.0, float(i), f"job{i}")
    assert len(choice._owners) <= 2 * 64
    assert choice.columns(9_999.5, "job9999") and not choice.columns(9_999.5, "job9998")


def test_the_header_says_columns_only_when_it_names_them() -> None:
    assert reads_columns(reads_headers())
    assert reads_columns({READS_HEADER: f"rows/9 {COLUMNS} later/3"})
    for headers in (None, {}, {READS_HEADER: ""}, {READS_HEADER: "columns/2"},
                    {READS_HEADER: "columns/10"}, {"Zeus-Lease": COLUMNS},
                    {READS_HEADER: " " * 300 + COLUMNS}):
        assert not reads_columns(headers), headers


@given(heard=HEARD, now=st.floats(0.0, 250.0))
def test_registrations_try_columns_unless_an_older_coordinator_is_in_its_lease(
        heard: list[tuple[bool, float, float, str]], now: float) -> None:
    """`try_columns` (a refusal is seen and answered in rows): none heard is no reason not to."""
    choice = ColumnsChoice()
    for reads, lease_s, at, holder in heard:
        choice.heard(reads, lease_s, at, holder)
    older = any(not reads and now < at + lease_s for reads, lease_s, at, _ in heard)
    assert choice.try_columns(now) == (not older)
    on, off = ColumnsChoice("on"), ColumnsChoice("off")
    for reads, lease_s, at, holder in heard:
        on.heard(reads, lease_s, at, holder)
    assert on.try_columns(now) and not off.try_columns(now)
