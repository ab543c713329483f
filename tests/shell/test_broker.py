import asyncio
import json
import time
import urllib.request

import pytest
from nats import errors as nats_errors

from zeus_agent.broker import (
    EmbeddedNats,
    PermissionRefusedError,
    _connect_failure,
    connect,
    refuse_if_not_permitted,
)
from zeus_agent.errors import BrokerError, reply_for
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import CommandEnvelope, InfoCmd, Reply
from zeus_demo.cluster import free_port


async def test_publish_and_request_through_a_real_server():
    async with EmbeddedNats() as server:
        assert server.running
        nc = await connect(server.url, "test")
        got: asyncio.Queue = asyncio.Queue()

        async def on_cmd(msg):
            env = codec.decode(msg.data, CommandEnvelope)
            await msg.respond(codec.encode(Reply.success(op=env.cmd.op)))

        await nc.subscribe(subjects.gpu_command("n1", 0), cb=on_cmd)
        await nc.subscribe("zeus.gpu.*.*.sample", cb=got.put)
        await nc.publish(subjects.gpu_samples("n1", 0), codec.encode({"v": 1}))
        msg = await asyncio.wait_for(got.get(), 2)
        assert msg.subject == "zeus.gpu.n1.0.sample"
        raw = await nc.request(
            subjects.gpu_command("n1", 0), codec.encode(CommandEnvelope(cmd=InfoCmd())), timeout=2
        )
        assert codec.decode(raw.data, Reply).result == {"op": "info"}
        await nc.drain()
    assert not server.running


async def test_connect_fails_fast_with_a_clear_message():
    start = time.monotonic()
    with pytest.raises(BrokerError, match="could not connect to NATS"):
        await connect("nats://127.0.0.1:1", "nobody", timeout_s=0.5)
    assert time.monotonic() - start < 3


def test_url_before_start_is_an_error():
    with pytest.raises(BrokerError, match="start"):
        _ = EmbeddedNats().url


async def test_confirmed_subscriptions_see_the_very_next_publish(nats_server):
    """nats-py's flush() can return before the server has a SUB; confirm_subscriptions can't."""
    from zeus_agent.broker import confirm_subscriptions

    listener = await connect(nats_server.url, "listener")
    talker = await connect(nats_server.url, "talker")
    try:
        for i in range(50):
            sub = await listener.subscribe(f"zeus.test.confirm.{i}")
            await confirm_subscriptions(listener)
            await talker.publish(f"zeus.test.confirm.{i}", b"x")
            assert (await sub.next_msg(timeout=2)).data == b"x"
            await sub.unsubscribe()
    finally:
        await listener.drain()
        await talker.drain()


@pytest.mark.parametrize(
    ("error", "refused"),
    [
        (nats_errors.AuthorizationError(), True),  # a refusal on an open connection: its class
        (nats_errors.Error("nats: 'Authorization Violation'"), True),  # the handshake's -ERR
        (nats_errors.Error("nats: 'Authentication Timeout'"), True),
        (nats_errors.Error("nats: 'User Authentication Expired'"), True),
        (nats_errors.Error("nats: 'Permissions Violation for Publish to \"x\"'"), False),
        (OSError("the authorization server is down"), False),  # only nats' -ERR is read
        (ConnectionRefusedError(111, "Connect call failed"), False),
    ],
)
def test_a_refusal_of_the_credentials_is_told_by_class_or_by_the_servers_error(error, refused):
    assert ("refused the credentials" in _connect_failure("nats://h:4222", 1, error)) is refused


class _Connection:
    def __init__(self, last_error: BaseException | None) -> None:
        self.last_error = last_error


@pytest.mark.parametrize(
    ("error", "refused"),
    [
        (nats_errors.Error("nats: permissions violation for publish to \"x.y\""), True),
        (nats_errors.Error("nats: 'Permissions Violation for Subscription to \"x\"'"), True),
        (nats_errors.Error("nats: 'Authorization Violation'"), False),
        (nats_errors.AuthorizationError(), False),
        (OSError("permissions violation"), False),  # only nats' -ERR is read
        (None, False),
    ],
)
def test_a_permissions_violation_is_a_forbidden_error(error, refused):
    if not refused:
        refuse_if_not_permitted(_Connection(error), "why")
        return
    with pytest.raises(PermissionRefusedError) as raised:
        refuse_if_not_permitted(_Connection(error), "may not")
    assert reply_for(raised.value) == Reply.failure("forbidden", "may not")


@pytest.mark.parametrize("sync, always, interval_ns", [
    ("always", True, 120_000_000_000),  # the default: fsync before acknowledging
    ("2m", None, 120_000_000_000),
    ("500ms", None, 500_000_000),
])
def test_jetstream_syncs_as_asked(sync: str, always: bool | None, interval_ns: int) -> None:
    """What the running server reports (`/varz`), not what was written: `always` by default,
    and a duration is read as one (unquoted, nats-server reads `2m` as 2 million)."""
    port = free_port()
    kwargs = {} if sync == "always" else {"jetstream_sync": sync}
    with EmbeddedNats(monitor_port=port, **kwargs) as server:
        assert server.jetstream_sync == sync
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/varz", timeout=5) as r:
            config = json.load(r)["jetstream"]["config"]
    assert config.get("sync_always") is always and config["sync_interval"] == interval_ns


@pytest.mark.parametrize("bad", ["", "never", "2", "-1s", "always ", "1d"])
def test_a_sync_nats_server_would_refuse_is_refused_first(bad: str) -> None:
    with pytest.raises(ValueError, match="give 'always'"):
        EmbeddedNats(jetstream_sync=bad)
