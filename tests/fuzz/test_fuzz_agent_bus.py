"""Fuzzing the agent's bus subjects: GPU commands `<p>.gpu.<node>.<i>.cmd`, lease renewals
`<p>.lease.<holder>` and `<p>.agent.ping`, with random bytes, wrong shapes, near-valid payloads with
one field mutated, out-of-range limits, clocks and leases.

Properties (besides `Bus.check_healthy` after every example):
* a command gets a `Reply`: ok exactly when the command is valid for the GPU, otherwise a stable
  code (never "internal"), "bad_request" when it does not decode, "out_of_range" for a limit
  or clock the GPU does not support;
* a lease renewal or ping never answers, never stretches a lease beyond what a valid renewal of
  its own holder asks, never revives or touches another holder's lease;
* a malformed renewal is counted where the agent shows its counters (/metrics).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from tests.fuzz.fuzz_kit import (
    CLOCK,
    CLOCKS,
    HOLDERS,
    JOB_IDS,
    LEASES,
    OK,
    POWER,
    RANDOM,
    STABLE_CODES,
    STAMPS,
    Bus,
    Case,
    counter_delta,
    fuzz,
    huge_text,
    lease_ok,
    mutated,
)
from zeus_agent.errors import PayloadError
from zeus_agent.wire import codec, subjects
from zeus_agent.wire.messages import (
    MAX_LEASE_S,
    CommandEnvelope,
    EnergyCmd,
    InstallScheduleCmd,
    LeaseRenewal,
    LockClocksCmd,
    SetPowerLimitCmd,
)

pytestmark = pytest.mark.timeout(180)


# ---------------------------------------------------------------------------- strategies
def _cmd(what: str, bad: bool = False, **cmd: Any) -> Case:
    return Case(what, {"v": 1, "cmd": cmd}, bad=bad)


def _leased(what: str, op: str, holder: str, lease: Any, **fields: Any) -> Case:
    return _cmd(what, bad=not lease_ok(lease), op=op, holder=holder, lease_s=lease, **fields)


SCHEDULES = st.fixed_dictionaries({
    "rank": st.integers(-1, 3),
    "frequencies": st.lists(
        st.tuples(st.sampled_from(["forward", "backward", ""]), CLOCK).map(list), max_size=5
    ),
})  # fmt: skip

COMMANDS = st.one_of(
    st.sampled_from(["info", "reset_power_limit", "reset_clocks", "clear_schedule", "unbind"])
    .map(lambda op: _cmd(op, op=op)),
    st.builds(lambda w, h, lease: _leased("set_power_limit", "set_power_limit", h, lease,
                                          power_limit_w=w), POWER, HOLDERS, LEASES),
    st.builds(lambda a, b, h, lease: _leased("lock_clocks", "lock_clocks", h, lease, min_mhz=a,
                                             max_mhz=b), CLOCK, CLOCK, HOLDERS, LEASES),
    st.builds(lambda j, s, h, lease: _leased("install_schedule", "install_schedule", h, lease,
                                             job_id=j, schedule=s), JOB_IDS, SCHEDULES, HOLDERS,
              LEASES),
    st.builds(lambda j, r: _cmd("bind", op="bind", job_id=j, rank=r), JOB_IDS,
              st.sampled_from([0, 1, -1, 2**24 - 1, 2**24])),
    st.builds(lambda a, b: _cmd("energy", op="energy", t0_ns=a, t1_ns=b), STAMPS, STAMPS),
    st.builds(lambda h, lease: _cmd("renew", bad=not lease_ok(lease, optional=False), op="renew",
                                    holder=h, lease_s=lease), HOLDERS, LEASES),
    st.one_of(st.text(max_size=20), huge_text()).map(
        lambda op: _cmd("unknown op", bad=op not in _OPS, op=op)),
)  # fmt: skip
"""Well-shaped commands with values in and out of the GPU's ranges."""
_OPS = {
    "info", "set_power_limit", "reset_power_limit", "lock_clocks", "reset_clocks",
    "install_schedule", "clear_schedule", "bind", "unbind", "energy", "renew",
}  # fmt: skip

COMMAND_CASES = st.one_of(RANDOM, COMMANDS, COMMANDS, mutated(COMMANDS), mutated(COMMANDS))


def expected_outcomes(data: bytes, case: Case) -> set[str]:
    """What the agent may answer: `OK` and/or error codes (independent of the agent's code)."""
    try:
        cmd = codec.decode(data, CommandEnvelope).cmd
    except PayloadError:
        return {"bad_request"}
    if case.bad:
        return set(STABLE_CODES)  # The schema accepted what the contract refuses: not ok.
    lo, hi = 100, 300
    match cmd:
        case SetPowerLimitCmd():
            return {OK} if lo <= cmd.power_limit_w <= hi else {"out_of_range"}
        case LockClocksCmd():
            valid = cmd.min_mhz in CLOCKS and cmd.max_mhz in CLOCKS and cmd.min_mhz <= cmd.max_mhz
            return {OK} if valid else {"out_of_range"}
        case EnergyCmd():
            return {"bad_request"} if cmd.t1_ns < cmd.t0_ns else {OK, "out_of_range"}
        case InstallScheduleCmd():
            pairs = cmd.schedule.frequencies
            valid = bool(pairs) and all(name and f in CLOCKS for name, f in pairs)
            return {OK} if valid else {"out_of_range", "bad_request"}
    return {OK}


# ---------------------------------------------------------------------------- commands
def _set(watts: Any, lease: Any = 30.0, holder: str = "fuzz-holder") -> Case:
    return _leased("set_power_limit", "set_power_limit", holder, lease, power_limit_w=watts)


def _lock(lo: Any, hi: Any, lease: Any = 30.0) -> Case:
    return _leased("lock_clocks", "lock_clocks", "fuzz-holder", lease, min_mhz=lo, max_mhz=hi)


@fuzz(150)
@example(case=_cmd("unknown op", bad=True, op="z" * 5000), gpu=0)
@example(case=_set(99), gpu=0)
@example(case=_set(301), gpu=0)
@example(case=_set(2**63 - 1), gpu=0)
@example(case=_set(250, lease=float("nan")), gpu=0)
@example(case=_set(250, lease=float("inf")), gpu=0)
@example(case=_set(250, lease=0), gpu=0)
@example(case=_set(250, lease=-1), gpu=0)
@example(case=_set(250, lease=3600.001), gpu=0)
@example(case=_set(250, lease=1e300), gpu=0)
@example(case=_set(250, lease=5e-324), gpu=1)
@example(case=_lock(1740, 1741), gpu=0)
@example(case=_lock(1740, 210), gpu=0)
@example(case=_lock(210, 1740, lease=5e-324), gpu=1)
@example(case=_cmd("energy", op="energy", t0_ns="$NOW", t1_ns="$NOW-1s"), gpu=0)
@example(case=_cmd("energy", op="energy", t0_ns="$NOW-1h", t1_ns="$NOW"), gpu=0)
@given(case=COMMAND_CASES, gpu=st.sampled_from([0, 1]))
def test_gpu_commands_get_coded_replies_and_gpus_stay_safe(bus: Bus, case: Case, gpu: int):
    mark = bus.mark()
    data = case.encode(bus.env())
    expected = expected_outcomes(data, case)
    reply = bus.ask(subjects.gpu_command(bus.node, gpu), data)
    outcome = OK if reply.ok else reply.code
    assert outcome in expected, (
        f"GPU {gpu} answered {outcome!r} ({reply.error[:300]!r}), expected one of "
        f"{sorted(expected)} for {case!r}"
    )
    if not reply.ok:
        assert reply.code in STABLE_CODES, f"unstable code {reply.code!r} for {case!r}"
    bus.check_healthy(mark, repr(case))


# ---------------------------------------------------------------------------- renewals, ping
RENEW_HOLDER = "fuzz-renew"

RENEWALS = st.builds(
    lambda h, lease: Case("lease renewal", {"v": 1, "holder": h, "lease_s": lease},
                          bad=not lease_ok(lease, optional=False)),
    st.sampled_from([RENEW_HOLDER, RENEW_HOLDER, "", "other-holder", "h" * 257, "anonymous"]),
    LEASES,
)  # fmt: skip
RENEWAL_CASES = st.one_of(RANDOM, RENEWALS, RENEWALS, mutated(RENEWALS), mutated(RENEWALS))


def lease_table(bus: Bus) -> dict[tuple[int, str], tuple[str, int]]:
    return {
        (index, lease.kind): (lease.holder, lease.deadline_ns)
        for index, agent in bus.agent.agents.items()
        for lease in agent.leases.held()
    }


def hold_a_lease(bus: Bus, fresh: bool = False) -> None:
    """Make sure GPU 1 has a power limit held by RENEW_HOLDER (a renewal has work to do);
    `fresh`: for 30 s from now (a fuzzed renewal may have shortened it to lapse at once)."""
    if not fresh and (1, "power_limit") in bus.call(lease_table, bus):
        return
    cmd = SetPowerLimitCmd(power_limit_w=250, holder=RENEW_HOLDER, lease_s=30.0)
    reply = bus.ask(subjects.gpu_command(bus.node, 1), codec.encode(CommandEnvelope(cmd=cmd)))
    assert reply.ok, reply


@fuzz(100)
@given(
    case=RENEWAL_CASES,
    subject=st.sampled_from(["lease", "lease", "lease", "ping"]),
    holder_token=st.sampled_from([RENEW_HOLDER, "other-holder", "_"]),
)
def test_lease_renewals_and_pings_never_answer_nor_stretch_leases(
    bus: Bus, case: Case, subject: str, holder_token: str
):
    hold_a_lease(bus)
    mark = bus.mark()
    data = case.encode(bus.env())
    valid: LeaseRenewal | None = None
    if subject == "lease":
        with_subject = subjects.lease_renewal(holder_token)
        with contextlib.suppress(PayloadError):
            valid = codec.decode(data, LeaseRenewal)
    else:
        with_subject = subjects.agent_ping()
    before = bus.call(lease_table, bus)
    t0 = time.monotonic_ns()
    bus.publish(with_subject, data)
    bus.info(0)  # The agent has handled the renewal when it answers a later request.
    t1 = time.monotonic_ns()
    after = bus.call(lease_table, bus)

    if valid is not None and case.bad:
        raise AssertionError(f"the agent's schema accepts a renewal the contract refuses: {case!r}")
    for key, (holder, deadline) in after.items():
        previous = before.get(key)
        assert previous is not None, f"a renewal created lease {key} out of nothing: {case!r}"
        assert previous[0] == holder, f"a renewal changed the holder of {key}: {case!r}"
        if previous[1] == deadline:
            continue
        renewable = valid is not None and valid.holder == holder and previous[1] > t0
        assert renewable, (
            f"lease {key} of {holder!r} moved from {previous[1]} to {deadline} after "
            f"{with_subject} {case!r}, which does not renew it"
        )
        assert valid is not None
        lo = t0 + int(valid.lease_s * 1e9) - 1_000_000
        # A lease may be held at least one expiry period (0.1 s), never longer than asked else.
        hi = t1 + int(max(valid.lease_s, 0.1) * 1e9) + 1_000_000
        assert lo <= deadline <= hi, f"lease {key} renewed to the wrong deadline by {case!r}"
        assert deadline - t1 <= MAX_LEASE_S * 1e9, f"lease {key} stretched beyond an hour"
    bus.check_healthy(mark, f"{with_subject} {case!r}")


@fuzz(15)
@example(case=Case("empty", raw=b""))
@example(case=Case("NaN lease", {"v": 1, "holder": RENEW_HOLDER, "lease_s": float("nan")}))
@example(case=Case("long lease", {"v": 1, "holder": RENEW_HOLDER, "lease_s": 1e300}))
@given(case=RENEWAL_CASES)
def test_malformed_lease_renewals_are_counted(bus: Bus, case: Case):
    """A dropped renewal must be counted where the agent shows its counters (/metrics)."""
    data = case.encode(bus.env())
    try:
        codec.decode(data, LeaseRenewal)
        assume(False)  # Only renewals the agent must drop.
    except PayloadError:
        pass
    hold_a_lease(bus, fresh=True)  # (The agent hears its leases' holders' renewals only.)
    before = bus.metrics_counters()
    bus.publish(subjects.lease_renewal(RENEW_HOLDER), data)
    bus.info(0)
    after = bus.metrics_counters()
    delta = counter_delta(after, before)
    assert sum(v for v in delta.values() if v > 0) >= 1, (
        f"the agent dropped a malformed lease renewal {case!r} without counting it: no counter "
        f"of its /metrics moved (counters: {sorted(after)})"
    )
