"""`ColumnsChoice` and the `Zeus-Reads` header: columns only while every coordinator heard reads
them.

An agent in `auto` sends rows until a renewal from a coordinator that reads columns is heard,
columns while that renewal's lease lasts, rows again for the lease of any renewal from one that
does not (an older replica), whatever else is heard meanwhile. `on` and `off` ignore what is
heard. The header is read leniently: absent, empty, another layout or a garbled value mean rows.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zeus_agent.agent.core.formats import ColumnsChoice
from zeus_agent.wire.formats import COLUMNS, READS_HEADER, reads_columns, reads_headers


def test_auto_sends_rows_until_a_coordinator_that_reads_columns_is_heard() -> None:
    choice = ColumnsChoice()
    assert not choice.columns(0.0)
    choice.heard(True, 30.0, 1.0)
    assert choice.columns(1.0) and choice.columns(30.9)
    assert not choice.columns(31.0)  # its lease ran out, none heard since


def test_an_older_coordinator_heard_sends_rows_for_its_lease() -> None:
    choice = ColumnsChoice()
    choice.heard(True, 60.0, 0.0)
    choice.heard(False, 10.0, 5.0)
    assert not choice.columns(5.0)
    choice.heard(True, 60.0, 6.0)  # a newer one renewing meanwhile does not override it
    assert not choice.columns(14.9)
    assert choice.columns(15.0)


def test_on_and_off_ignore_what_is_heard() -> None:
    on, off = ColumnsChoice("on"), ColumnsChoice("off")
    for choice in (on, off):
        choice.heard(False, 60.0, 0.0)
        choice.heard(True, 60.0, 0.0)
    assert on.columns(1.0) and not off.columns(1.0)
    with pytest.raises(ValueError, match="auto, on, off"):
        ColumnsChoice("yes")  # type: ignore[arg-type]


HEARD = st.lists(st.tuples(st.booleans(), st.floats(0.1, 100.0), st.floats(0.0, 100.0)),
                 max_size=12)


@given(heard=HEARD, now=st.floats(0.0, 250.0))
def test_columns_exactly_when_a_reader_is_in_its_lease_and_no_other_is(
        heard: list[tuple[bool, float, float]], now: float) -> None:
    """The rule, against every renewal heard (in any order of arrival)."""
    choice = ColumnsChoice()
    for reads, lease_s, at in heard:
        choice.heard(reads, lease_s, at)
    live = [reads for reads, lease_s, at in heard if now < at + lease_s]
    assert choice.columns(now) == (any(live) and all(live))


def test_the_header_says_columns_only_when_it_names_them() -> None:
    assert reads_columns(reads_headers())
    assert reads_columns({READS_HEADER: f"rows/9 {COLUMNS} later/3"})
    for headers in (None, {}, {READS_HEADER: ""}, {READS_HEADER: "columns/2"},
                    {READS_HEADER: "columns/10"}, {"Zeus-Lease": COLUMNS},
                    {READS_HEADER: " " * 300 + COLUMNS}):
        assert not reads_columns(headers), headers
