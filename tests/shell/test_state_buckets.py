"""Opening the state buckets: replicas racing to create them, a busy cluster, no JetStream.

A replica that starts while another creates the buckets on a 3-server cluster once died of a
timed-out request (`NoJetStreamError`): binding now tries again through busy moments
(`coordinator.state.buckets`), while a server without JetStream is said at once.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
from typing import Any

import pytest
from nats.js.errors import BucketNotFoundError, ServiceUnavailableError

from coordinator.state import buckets
from coordinator.state.buckets import NoJetStreamError, bind_buckets
from coordinator.state.jetstream import JetStreamState
from zeus_agent.broker import EmbeddedNats, connect, find_nats_server


class FlakyJs:
    """A JetStream context whose first `fails` requests raise `error` (a busy cluster)."""

    def __init__(self, fails: int, error: BaseException) -> None:
        self.fails = fails
        self.error = error
        self.created: dict[str, Any] = {}
        self.requests = 0

    def _request(self) -> None:
        self.requests += 1
        if self.requests <= self.fails:
            raise self.error

    async def key_value(self, name: str) -> Any:
        self._request()
        if name not in self.created:
            raise BucketNotFoundError
        return self.created[name]

    async def create_key_value(self, config: Any) -> Any:
        self._request()
        return self.created.setdefault(config.bucket, ("kv", config.bucket, config.replicas))


@pytest.fixture(autouse=True)
def quick_pauses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(buckets, "FIRST_PAUSE_S", 0.01)
    monkeypatch.setattr(buckets, "MAX_PAUSE_S", 0.02)


async def test_timeouts_while_the_cluster_is_busy_are_tried_again() -> None:
    js = FlakyJs(fails=3, error=TimeoutError())
    kv, owners = await bind_buckets(js, ["s", "s-owners"], replicas=3, retry_s=10.0)
    assert (kv, owners) == (("kv", "s", 3), ("kv", "s-owners", 3))
    assert js.requests == 3 + 4  # (Three refused; then a lookup and a create per bucket.)


async def test_a_cluster_not_ready_is_tried_again_but_a_single_server_without_jetstream_is_not(
) -> None:
    js = FlakyJs(fails=2, error=ServiceUnavailableError())
    assert (await bind_buckets(js, ["s"], replicas=3, retry_s=10.0)) == [("kv", "s", 3)]
    single = FlakyJs(fails=1, error=ServiceUnavailableError())
    with pytest.raises(NoJetStreamError, match="start nats-server with -js"):
        await bind_buckets(single, ["s"], replicas=1, retry_s=10.0)
    assert single.requests == 1


async def test_busy_for_longer_than_retry_s_is_an_error_that_says_what_to_do() -> None:
    js = FlakyJs(fails=10**9, error=TimeoutError())
    with pytest.raises(NoJetStreamError, match="did not answer JetStream requests"):
        await bind_buckets(js, ["s"], replicas=3, retry_s=0.1)
    assert js.requests >= 2


async def test_replicas_that_open_the_buckets_together_all_bind_them(
        nats_server: EmbeddedNats) -> None:
    conns = [await connect(nats_server.url, f"replica-{i}") for i in range(4)]
    try:
        states = [JetStreamState(nc, "race", bucket="zeus-race") for nc in conns]
        await asyncio.gather(*(state.open() for state in states))
        await states[0].kv.put("probe", b"1")
        for state in states[1:]:
            assert (await state.kv.get("probe")).value == b"1"
            assert state.owners is not None
        for state in states:
            await state.close()
    finally:
        for nc in conns:
            await nc.drain()


async def test_a_server_without_jetstream_is_said_at_once() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([find_nats_server(), "-a", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        nc = None
        for _ in range(100):
            try:
                nc = await connect(f"nats://127.0.0.1:{port}", "no-js")
                break
            except Exception:  # noqa: BLE001 - not listening yet
                await asyncio.sleep(0.05)
        assert nc is not None
        try:
            state = JetStreamState(nc, "nojs", bucket="zeus-nojs", retry_s=60.0)
            with pytest.raises(NoJetStreamError, match="start nats-server with -js"):
                await asyncio.wait_for(state.open(), 30.0)
        finally:
            await nc.drain()
    finally:
        proc.terminate()
        proc.wait(10)
