"""A fake agent for the emit tests: a bound Unix datagram socket served by a thread, recording
what a publisher sends and answering its requests with a handler (`default_handler`: what a
healthy agent and coordinator answer; `rapl_agent`: one on a node with two CPU packages)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable

from zeus_agent import emit
from zeus_agent.wire.codec import validate
from zeus_agent.wire.messages import RegisterJob, RegisterRank, Reply
from zeus_agent.wire.trainer import (
    EventDatagram,
    Kind,
    RequestDatagram,
    TrainerHello,
    WindowRequest,
    decode_datagram,
    encode_reply,
)
from zeus_demo.cluster import wait_for

Handler = Callable[[RequestDatagram], "Reply | None"]


CLOCKS = [1410, 1395, 1200]
TOKEN = "fake-join-token-0123"  # what the coordinator returns with a job id


def default_handler(req: RequestDatagram) -> Reply | None:
    """What a healthy agent (and coordinator) answers."""
    if req.kind is Kind.REGISTER_JOB:
        validate(RegisterJob, req.payload)
        return Reply.success(job_id="job-1", join_token=TOKEN)
    if req.kind is Kind.HELLO:
        validate(TrainerHello, req.payload)
        return Reply.success(node="node-a", supported_graphics_clocks_mhz=CLOCKS)
    if req.kind is Kind.REGISTER_RANK:
        validate(RegisterRank, req.payload)
        return Reply.success()
    if req.kind is Kind.WINDOW:
        window = validate(WindowRequest, req.payload)
        return Reply.success(energy_j=[10.0 * (g + 1) for g in window.gpus])
    return None  # BYE


class FakeAgent:
    """Receives, decodes and records datagrams; answers requests with `handler`."""

    def __init__(self, path: str, handler: Handler = default_handler) -> None:
        self.path = path
        self.handler = handler
        self.events: list[EventDatagram] = []
        self.requests: list[RequestDatagram] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.02)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, addr = self.sock.recvfrom(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            dg = decode_datagram(data)
            if isinstance(dg, EventDatagram):
                self.events.append(dg)
            elif isinstance(dg, RequestDatagram):
                self.requests.append(dg)
                reply = self.handler(dg)
                if reply is not None:
                    with contextlib.suppress(OSError):  # the publisher may have gone already
                        self.sock.sendto(encode_reply(dg.request_id, reply), addr)

    def wait_events(
        self, n: int, pub: emit.Publisher | None = None, timeout_s: float = 2.0
    ) -> list[EventDatagram]:
        """Wait for `n` events, flushing `pub`'s backlog (a burst outruns the 10-deep queue)."""
        def arrived() -> bool:
            if len(self.events) >= n:
                return True
            if pub is not None:
                pub.flush()
            return False

        wait_for(arrived, timeout_s, interval_s=0.002, fail=False)
        return self.events

    def wait_requests(self, kind: Kind, timeout_s: float = 2.0) -> list[RequestDatagram]:
        """The requests of `kind` once there is one (up to `timeout_s`; else none)."""
        return wait_for(lambda: [r for r in self.requests if r.kind is kind], timeout_s,
                        interval_s=0.002, fail=False)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()
        if os.path.exists(self.path):
            os.unlink(self.path)


NODE_CPUS = {0: (30.0, 4.0), 1: (20.0, None)}  # package 1 has no DRAM domain (an AMD CPU)


def rapl_agent(req: RequestDatagram) -> Reply | None:
    """An agent on a node with two packages, answering `cpus` as the real one does."""
    if req.kind is not Kind.WINDOW:
        return None
    window = validate(WindowRequest, req.payload)
    result: dict = {"energy_j": [1.5 for _ in window.gpus]}
    if window.cpus is not None:
        wanted = sorted(NODE_CPUS) if window.cpus == "all" else window.cpus
        cpus = [i for i in wanted if i in NODE_CPUS]
        result |= {"cpus": cpus, "cpu_energy_j": [NODE_CPUS[i][0] for i in cpus],
                   "dram_energy_j": [NODE_CPUS[i][1] for i in cpus]}
        if len(cpus) < len(wanted):
            result["cpu_error"] = "CPU indices [7] are not on this node"
    return Reply.success(**result)
