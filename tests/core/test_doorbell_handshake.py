"""The doorbell's handshake: its transition table, as written and as run, and its invariants."""

from __future__ import annotations

import itertools
import threading

import pytest

from zeus_agent.agent import doorbell_handshake
from zeus_agent.agent.doorbell_handshake import TRANSITIONS, Arm, Handshake, Phase

K, MHZ = 5, 1200
EVENTS = ("arm", "arm_next", "disarm", "forget", "take", "accept", "claim")
OUTSIDE_THE_PROTOCOL = {
    # The loop arms only an instruction IDLE or ARMED (the next after the last it claimed).
    *((p, "arm") for p in (Phase.TAKEN, Phase.RUNG, Phase.VETOED)),
    # Only the thread that read the arm takes it, and then the arm is gone.
    *((p, "take") for p in (Phase.TAKEN, Phase.RUNG, Phase.VETOED)),
    # The lane accepts once per ring of a taken change.
    (Phase.ARMED, "accept"), (Phase.RUNG, "accept"),
}


def _arm(instruction: int = K) -> Arm:
    return Arm(pid=1, instruction=instruction, name="forward", mhz=MHZ, epoch=0, asked=0)


def _in(phase: Phase) -> tuple[Handshake, Arm]:
    """A handshake with instruction K in `phase`, and the arm the thread read for K."""
    handshake, arm = Handshake(), _arm()
    if phase is Phase.IDLE:
        return handshake, arm  # (an arm no longer in place)
    handshake.set_arm(arm)
    if phase is not Phase.ARMED:
        assert handshake.take(arm)
    if phase is Phase.RUNG:
        assert handshake.accept(K, MHZ)
    elif phase is Phase.VETOED:
        assert handshake.claim(K) == (Phase.TAKEN, None)
    assert handshake.phase(K) is phase
    return handshake, arm


def _apply(handshake: Handshake, arm: Arm, event: str) -> str:
    """Run `event` for instruction K; its result as the table writes it."""
    if event in ("arm", "arm_next", "disarm"):
        handshake.set_arm({"arm": _arm(), "arm_next": _arm(K + 1), "disarm": None}[event])
        return "-"
    if event == "forget":
        handshake.forget()
        return "-"
    if event == "take":
        return str(handshake.take(arm))
    if event == "accept":
        return str(handshake.accept(K, MHZ))
    before = handshake.phase(K)
    found, mhz = handshake.claim(K)
    assert found is before
    return "mhz" if mhz == MHZ else str(mhz)


@pytest.mark.parametrize("phase, event", list(TRANSITIONS), ids=lambda x: getattr(x, "name", x))
def test_each_transition_runs_as_the_table_says(phase: Phase, event: str) -> None:
    handshake, arm = _in(phase)
    result = _apply(handshake, arm, event)
    assert (handshake.phase(K), result) == TRANSITIONS[phase, event]


def test_the_table_covers_every_event_of_the_protocol_in_every_phase() -> None:
    pairs = set(itertools.product(Phase, EVENTS))
    assert set(TRANSITIONS) | OUTSIDE_THE_PROTOCOL == pairs
    assert not set(TRANSITIONS) & OUTSIDE_THE_PROTOCOL


def test_the_module_docstring_documents_the_table() -> None:
    doc = doorbell_handshake.__doc__
    assert doc is not None
    lines = doc.splitlines()
    start = next(i for i, line in enumerate(lines)
                 if line.split() == ["phase", "event", "next", "result"])
    documented = {}
    for line in lines[start + 1:]:
        if not line.strip():
            break
        phase, event, after, result = line.split()
        documented[Phase[phase], event] = (Phase[after], result)
    assert documented == dict(TRANSITIONS)
    assert list(documented) == list(TRANSITIONS)


# Invariants ----------------------------------------------------------------------------------

def _applied_by(order: tuple[str, ...], ring_asks: bool = True) -> list[str]:
    """Who applies K's armed change when the thread's take and accept and the loop's claim
    run in `order` (each under the lock, as the doorbell runs them)."""
    handshake, arm = Handshake(), _arm()
    handshake.set_arm(arm)
    took = accepted = False
    claimed: int | None = None
    for step in order:
        if step == "take":
            took = handshake.take(arm)
        elif step == "accept":
            accepted = took and ring_asks and handshake.accept(K, MHZ)
        else:
            claimed = handshake.claim(K)[1]
    applied = ["thread"] if accepted else []
    if claimed is None:
        applied.append("loop")  # It applies its own clock.
    else:
        assert accepted and claimed == MHZ  # The loop is told the thread's clock.
    return applied


@pytest.mark.parametrize("ring_asks", [True, False])
def test_exactly_one_side_applies_an_armed_change_in_any_order(ring_asks: bool) -> None:
    for claim_at in range(3):
        order = ["take", "accept"]
        order.insert(claim_at, "claim")
        assert len(_applied_by(tuple(order), ring_asks)) == 1, (order, ring_asks)


def test_a_veto_outlives_the_next_arm() -> None:
    handshake, arm = _in(Phase.VETOED)
    handshake.set_arm(_arm(K + 1))  # the loop handled K and arms K + 1
    assert handshake.phase(K) is Phase.VETOED and handshake.phase(K + 1) is Phase.ARMED
    assert not handshake.accept(K, MHZ)  # the late ring of K
    assert handshake.phase(K + 1) is Phase.ARMED


def test_a_rung_change_is_told_once() -> None:
    handshake, _ = _in(Phase.RUNG)
    assert handshake.claim(K) == (Phase.RUNG, MHZ)
    assert handshake.claim(K) == (Phase.IDLE, None)


def test_forget_leaves_every_slot_empty() -> None:
    for phase in Phase:
        handshake, _ = _in(phase)
        handshake.set_arm(_arm(K + 1))
        handshake.forget()
        assert (handshake.arm, handshake.taken, handshake.rung, handshake.vetoed) == (
            None, None, None, None)


def test_threads_racing_for_each_change_apply_it_once() -> None:
    """The reading thread takes and accepts while the loop claims, each under one lock."""
    lock = threading.Lock()
    for instruction in range(1000):
        handshake = Handshake()
        arm = _arm(instruction)
        handshake.set_arm(arm)
        go = threading.Barrier(2)
        by_thread: list[bool] = []
        by_loop: list[int | None] = []

        def thread(arm: Arm = arm, handshake: Handshake = handshake,
                   go: threading.Barrier = go, by_thread: list[bool] = by_thread) -> None:
            go.wait()
            with lock:
                took = handshake.take(arm)
            with lock:
                by_thread.append(took and handshake.accept(arm.instruction, MHZ))

        worker = threading.Thread(target=thread)
        worker.start()
        go.wait()
        with lock:
            by_loop.append(handshake.claim(instruction)[1])
        worker.join()
        # The thread applied it exactly when the loop's claim says so (and then the loop
        # applies nothing); otherwise the loop applies it.
        assert by_thread[0] == (by_loop[0] == MHZ)
