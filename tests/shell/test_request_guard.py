"""One request must not stop a service: every error text that echoes input is bounded at its
source, and a failure while handling or answering one request never leaves its handler.

Regression (issue "One request must not stop a coordinator", item 1): a msgpack request
`{"v": "x" * 5000}` on any coordinator endpoint made `codec.validate` raise with the whole
`repr` of `v`; the reply built from it was longer than a `Reply` may carry, so building it
raised inside the endpoint's `except`, in a task of the service's task group: the coordinator
exited. Against a real nats-server, real coordinator and real agent.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import pytest

from coordinator.service import CoordinatorService
from tests.shell.coordinator_kit import NODE, ask, register_job
from zeus_agent.agent.server import AgentServer
from zeus_agent.errors import PayloadError
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import (
    CommandEnvelope,
    InfoCmd,
    JobQuery,
    RegisterJob,
    Reply,
)
from zeus_agent.wire.text import MAX_TEXT_CHARS, SHOWN_CHARS, bounded, shown

HUGE = "x" * 5000
BAD_PAYLOADS: list[dict[str, Any]] = [
    {"v": HUGE},  # The schema version, echoed by the version check.
    {"v": 1, HUGE: 1},  # An unknown field whose name is the long part.
    {"v": 1, "job_id": HUGE},  # A field's value, echoed by pydantic's error.
    {"v": 1, "job": {"dp_degree": HUGE}},  # Nested.
    {"v": [HUGE] * 20},  # A long list of long values.
    {"v": {HUGE: [HUGE, {HUGE: HUGE}]}},  # Nested maps.
]


def coordinator_subjects(coord: CoordinatorService) -> list[str]:
    me = coord.settings.replica_name
    return [
        subjects.coord_job_query(),
        subjects.coord_job_straggler(),
        subjects.coord_register_job(NODE),
        subjects.coord_register_rank(NODE),
        subjects.coord_replica(me, "query"),
        subjects.coord_replica(me, "straggler"),
    ]


# ---------------------------------------------------------------------------- the sources
def test_shown_and_bounded_cut_what_they_echo() -> None:
    assert shown("x" * 5000) == repr("x" * 5000)[: SHOWN_CHARS - 3] + "..."
    assert len(shown("x" * 5000)) == SHOWN_CHARS
    assert shown(7) == "7"
    assert len(bounded("y" * 10_000)) == MAX_TEXT_CHARS
    assert bounded("y" * 10_000).endswith("(truncated)")
    assert bounded("short") == "short"


@pytest.mark.parametrize("payload", BAD_PAYLOADS)
def test_codec_errors_echo_only_a_short_form_of_the_input(payload: dict[str, Any]) -> None:
    with pytest.raises(PayloadError) as info:
        codec.validate(JobQuery, payload)
    assert len(str(info.value)) < 1000, str(info.value)[:200]
    assert HUGE not in str(info.value) and HUGE not in info.value.field
    # And the reply built from it is a valid `Reply`.
    reply = Reply.failure("bad_request", str(info.value))
    assert codec.decode(codec.encode(reply), Reply).code == "bad_request"


def test_a_failure_reply_is_cut_to_fit_whatever_it_is_given() -> None:
    reply = Reply.failure("internal", "z" * 50_000)
    assert len(reply.error) == MAX_TEXT_CHARS
    assert PayloadError("p" * 50_000).args[0].endswith("(truncated)")


# ---------------------------------------------------------------------------- the coordinator
async def test_huge_values_on_every_coordinator_endpoint_get_bad_request(
        coord: CoordinatorService, nc) -> None:
    serving = asyncio.all_tasks()
    for subject in coordinator_subjects(coord):
        for payload in BAD_PAYLOADS:
            msg = await nc.request(subject, msgpack.packb(payload), timeout=5)
            reply = codec.decode(msg.data, Reply)
            assert not reply.ok and reply.code == "bad_request", (subject, reply)
            assert HUGE not in reply.error and len(reply.error) <= MAX_TEXT_CHARS
    # Still serving: a real request is answered, and nothing of the service has ended.
    job_id = await register_job(nc)
    reply = await ask(nc, subjects.coord_job_query(), JobQuery(job_id=job_id))
    assert reply.ok and reply.result["job"]["job_id"] == job_id
    assert not [t for t in serving if t.done() and not t.cancelled() and t.exception()]


async def test_a_reply_that_cannot_be_built_is_answered_internal_and_the_service_serves_on(
        coord: CoordinatorService, nc, monkeypatch) -> None:
    """The class, not only the cause: whatever fails in one request stays in it."""

    async def unencodable(data: bytes, subject: str) -> Reply:
        return Reply.success(oops=object())  # msgpack cannot encode it.

    async def exploding(data: bytes, subject: str) -> Reply:
        raise RuntimeError("a bug in a handler")

    monkeypatch.setattr(coord.endpoints, "query", unencodable)
    monkeypatch.setattr(coord.endpoints, "straggler", exploding)
    # The endpoints were wrapped at start: wrap the patched handlers the same way.
    for subject, handler in ((subjects.coord_job_query(), unencodable),
                             (subjects.coord_job_straggler(), exploding)):
        sub = await nc.subscribe(subject + ".probe", cb=coord.endpoints.wrap_own(handler))
        for _ in range(3):
            msg = await nc.request(subject + ".probe", codec.encode(JobQuery()), timeout=5)
            reply = codec.decode(msg.data, Reply)
            assert reply.code == "internal" and "see its log" in reply.error
        await sub.unsubscribe()
    reply = await ask(nc, subjects.coord_register_job(NODE),
                      RegisterJob.model_validate(
                          {"job": {"dp_degree": 1, "pp_degree": 1, "tp_degree": 1,
                                   "world_size": 1}}))
    assert reply.ok, reply
    assert not coord.should_exit.is_set()


async def test_a_request_whose_answer_cannot_be_sent_stops_nothing(
        coord: CoordinatorService, nc) -> None:
    class Gone:
        subject = subjects.coord_job_query()
        data = msgpack.packb({"v": HUGE})

        class _msg:  # noqa: N801 - the shape `Endpoints.wrap` reads
            reply = "_INBOX.gone"

        async def respond(self, data: bytes) -> None:
            raise ConnectionError("the asker left")

    handler = coord.endpoints.wrap(coord.endpoints.query)
    await handler(Gone())
    await asyncio.sleep(0.2)  # The request's task runs.
    reply = await ask(nc, subjects.coord_job_query(), JobQuery())
    assert reply.ok


# ---------------------------------------------------------------------------- the agent
async def test_huge_values_on_an_agent_endpoint_get_bad_request(agent: AgentServer, nc) -> None:
    subject = subjects.gpu_command(NODE, 0)
    for payload in [*BAD_PAYLOADS, {"v": 1, "cmd": {"type": HUGE}},
                    {"v": 1, "cmd": {"type": "set_power_limit", "power_limit_w": HUGE}}]:
        msg = await nc.request(subject, msgpack.packb(payload), timeout=5)
        reply = codec.decode(msg.data, Reply)
        assert not reply.ok and reply.code == "bad_request", reply
        assert HUGE not in reply.error
    reply = await ask(nc, subject, CommandEnvelope(cmd=InfoCmd()))
    assert reply.ok
