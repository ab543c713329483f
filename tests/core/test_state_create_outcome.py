"""`create_outcome`: what JetStream's acknowledgement of a KV create says, read from its bytes.

The acknowledgements are the ones nats-server 2.15 sends (a 3-server cluster, an R3 bucket).
A refusal carries `"seq":0` too, so a create must never be taken for stored because its
acknowledgement names a sequence; and the two refusals must be told apart, since only one of
them means the key can be read (tests/e2e/test_state_concurrent_creates.py races real writers).
"""

from __future__ import annotations

import pytest

from coordinator.state.jetstream import CREATED, EXISTS, IN_FLIGHT, OTHER, create_outcome


@pytest.mark.parametrize(("ack", "outcome"), [
    (b'{"stream":"KV_races","seq":7}', CREATED),
    (b'{"stream":"KV_races","domain":"hub","seq":7}', CREATED),
    (b'{"seq":7,"stream":"KV_races"}', CREATED),  # another field order: parsed
    # Another writer's write of the key is being replicated (not readable yet).
    (b'{"error":{"code":400,"err_code":10164,"description":"wrong last sequence"},'
     b'"stream":"KV_races","seq":0}', IN_FLIGHT),
    # The key has a message (a value, or a delete or purge marker) at sequence 1.
    (b'{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 1"},'
     b'"stream":"KV_races","seq":0}', EXISTS),
    (b'{"error":{"code":503,"err_code":10077,"description":"maximum messages exceeded"},'
     b'"stream":"KV_races","seq":0}', OTHER),
    (b"", OTHER),  # no responders
    (b"not json", OTHER),
    (b'{"error":"garbled"}', OTHER),
    (b"[]", OTHER),
])
def test_an_acknowledgement_says_stored_in_flight_exists_or_other(ack: bytes,
                                                                  outcome: str) -> None:
    assert create_outcome(ack) == outcome
