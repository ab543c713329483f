"""Exact windows on the wire: `WindowRequest.exact`, sent only when asked, and old agents."""

from __future__ import annotations

from pathlib import Path

from tests.core.emit_kit import FakeAgent
from zeus_agent import emit
from zeus_agent.wire.codec import validate
from zeus_agent.wire.messages import Reply
from zeus_agent.wire.trainer import Kind, RequestDatagram, WindowRequest


def old_agent(req: RequestDatagram) -> Reply | None:
    """An agent of protocol 1 as shipped: `exact` is an unknown field there."""
    if req.kind is not Kind.WINDOW:
        return None
    if "exact" in req.payload:
        return Reply.failure("bad_request", "WINDOW: exact: Extra inputs are not permitted")
    window = validate(WindowRequest, req.payload)
    return Reply.success(energy_j=[1.5 for _ in window.gpus])


def exact_agent(req: RequestDatagram) -> Reply | None:
    if req.kind is not Kind.WINDOW:
        return None
    window = validate(WindowRequest, req.payload)
    return Reply.success(energy_j=[2.5 if window.exact else 1.5 for _ in window.gpus])


def test_a_default_window_request_is_what_old_agents_accept() -> None:
    payload = WindowRequest(t0_ns=1, t1_ns=2, gpus=[0]).model_dump(mode="python")
    assert payload == {"t0_ns": 1, "t1_ns": 2, "gpus": [0]}  # byte for byte as before
    exact = WindowRequest(t0_ns=1, t1_ns=2, gpus=[0], exact=True).model_dump(mode="python")
    assert exact["exact"] is True
    assert validate(WindowRequest, {"t0_ns": 1, "t1_ns": 2, "gpus": [0]}).exact is False


def test_exact_travels_and_falls_back_on_an_agent_that_predates_it(tmp_path: Path) -> None:
    for handler, expected in ((exact_agent, 2.5), (old_agent, 1.5)):
        agent = FakeAgent(str(tmp_path / f"{handler.__name__}.sock"), handler)
        pub = emit.Publisher(socket_path=agent.path, gpu_index=0)
        try:
            assert pub.measure(0, 10, exact=True) == [expected]
            assert pub.measure(0, 10) == [1.5]
            pub.push_window("w")
            assert pub.pop_window("w", exact=True).energy == [expected]
        finally:
            pub.close()
            agent.stop()
        sent = [r.payload.get("exact") for r in agent.requests if r.kind is Kind.WINDOW]
        if handler is old_agent:  # each exact ask is repeated without it
            assert sent == [True, None, None, True, None]
        else:
            assert sent == [True, None, True]
