"""A node's batch reply: its ranks' replies as plain dicts, encoded as their dumps were."""

from __future__ import annotations

from coordinator.jobs import DuplicateError
from coordinator.service.endpoints import plain_reply, plain_success
from zeus_agent.errors import reply_for
from zeus_agent.wire import codec
from zeus_agent.wire.messages import Reply


def test_a_node_batchs_replies_encode_as_their_dumps() -> None:
    """`plain_reply` leaves the encoding of a node's batch reply as it was (each `model_dump`)."""
    replies = [Reply.success(job_id="j+1", rank=3, registered=9, world_size=16),
               Reply.failure("conflict", "GPU 3 on n\u00f6de has uuid x"),
               reply_for(DuplicateError("rank 4 twice"), "internal"),
               Reply.success(nested={"a": [1, 2.5, None]}, model=Reply.success(x=1))]
    for reply in replies[:3]:  # (A model in a result stays one: dumped when encoded.)
        assert plain_reply(reply) == reply.model_dump()
    assert codec.encode(Reply.success(replies=[plain_reply(r) for r in replies])) == \
        codec.encode(Reply.success(replies=[r.model_dump() for r in replies]))


def test_a_plain_success_is_the_successful_replys_plain_form() -> None:
    result = {"job_id": "j+1", "rank": 3, "registered": 9, "world_size": 16}
    assert plain_success(**result) == plain_reply(Reply.success(**result))
    assert Reply.model_validate(plain_success(**result)) == Reply.success(**result)
    assert plain_success(rank=1)["result"] is not plain_success(rank=1)["result"]
