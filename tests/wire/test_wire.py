import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeus_agent.errors import PayloadError
from zeus_agent.models import FrequencySchedule, JobInfo
from zeus_agent.wire import codec, subjects
from zeus_agent.wire import trainer as dg
from zeus_agent.wire.messages import (
    GPU_COMMAND,
    CommandEnvelope,
    InstallScheduleCmd,
    LeaseRenewal,
    RegisterJob,
    Reply,
    SetPowerLimitCmd,
)


def test_subjects_sanitise_user_tokens():
    unsafe = subjects.token("node.a b*>")
    assert unsafe.startswith("node_a_b__~") and len(unsafe) == len("node_a_b__~") + 16
    assert subjects.token("node_a_b__") == "node_a_b__"  # a verbatim token never has "~"
    assert subjects.token("") == "_"
    assert subjects.gpu_command("n1", 3) == "zeus.gpu.n1.3.cmd"
    assert subjects.job_events("2024+dp1+x", 0, "n1", prefix="t1") == "t1.job.2024+dp1+x.ev.0.n1"
    assert subjects.lease_renewal("a>b").startswith("zeus.lease.a_b~")
    with pytest.raises(ValueError, match="prefix"):
        subjects.agent_hello("n", prefix="bad prefix")


@settings(max_examples=200, deadline=None)
@given(job=st.text(max_size=80), rank=st.integers(0, 2**40), node=st.text(max_size=80),
       gpu=st.integers(0, 1024), prefix=st.from_regex(r"[a-z]{1,8}(\.[a-z0-9]{1,8}){0,2}",
                                                       fullmatch=True))
def test_subject_parsers_read_back_what_the_builders_wrote(job, rank, node, gpu, prefix):
    ev = subjects.parse_job_events(subjects.job_events(job, rank, node, prefix))
    assert ev == (subjects.token(job), subjects.token(rank), subjects.token(node))
    meas = subjects.parse_job_measurements(subjects.job_measurements(job, node, prefix))
    assert meas == (subjects.token(job), subjects.token(node))
    for build, leaf in ((subjects.gpu_samples, "sample"), (subjects.gpu_errors, "error"),
                        (subjects.gpu_command, "cmd")):
        parsed = subjects.parse_gpu_subject(build(node, gpu, prefix))
        assert parsed == (subjects.token(node), str(gpu), leaf) and parsed.gpu_index == gpu
    assert subjects.parse_agent_hello(subjects.agent_hello(node, prefix)) == subjects.token(node)


def test_subject_parsers_refuse_other_shapes():
    assert subjects.parse_job_events("zeus.job.j.status") is None
    assert subjects.parse_job_events("job.j.ev.0.n") is None  # no prefix
    assert subjects.parse_gpu_subject("zeus.agent.n.hello") is None
    assert subjects.parse_gpu_subject("zeus.gpu.n.².error").gpu_index is None  # not ASCII
    assert subjects.parse_job_measurements("zeus.job.j.ev.0.n") is None
    assert subjects.parse_job_measurements("zeus.job.j.status") is None
    assert subjects.parse_job_measurements("job.j.meas.n") is None  # no prefix
    assert subjects.parse_job_measurements("zeus.gpu.n.0.meas") is None  # the old per-GPU one
    assert subjects.parse_agent_hello("zeus.agent.n.error") is None


def test_long_user_values_give_short_distinct_tokens():
    long_a, long_b = "j" * 5000, "j" * 4999 + "k"
    ta, tb = subjects.token(long_a), subjects.token(long_b)
    assert ta != tb and len(ta) <= subjects.MAX_TOKEN_CHARS and len(tb) <= subjects.MAX_TOKEN_CHARS
    assert len(subjects.job_events(long_a, 2**40, "n" * 300)) < 200
    assert subjects.token("x" * subjects.MAX_TOKEN_CHARS) == "x" * subjects.MAX_TOKEN_CHARS
    assert "~" in subjects.token("x" * (subjects.MAX_TOKEN_CHARS + 1))
    assert subjects.token("a.b") != subjects.token("a_b")


def test_golden_round_trip_of_a_command():
    env = CommandEnvelope(cmd=SetPowerLimitCmd(power_limit_w=200, holder="job", lease_s=5.0))
    raw = codec.encode(env)
    assert msgpack.unpackb(raw) == {
        "v": 1,
        "cmd": {"holder": "job", "lease_s": 5.0, "op": "set_power_limit", "power_limit_w": 200},
    }
    assert codec.decode(raw, CommandEnvelope) == env


def test_schedule_command_round_trip():
    cmd = InstallScheduleCmd(
        job_id="j", schedule=FrequencySchedule(rank=2, frequencies=[("forward", 1410)])
    )
    assert codec.validate(GPU_COMMAND, codec.unpack(codec.encode(cmd))) == cmd


def test_register_job_carries_seed_job_info():
    msg = RegisterJob(job=JobInfo(pp_degree=1, dp_degree=2, tp_degree=1, world_size=2))
    back = codec.decode(codec.encode(msg), RegisterJob)
    assert back.job.world_size == 2
    bad = codec.encode({"v": 1, "job": {"pp_degree": 1, "dp_degree": 2, "tp_degree": 1,
                                        "world_size": 3}})
    with pytest.raises(PayloadError, match="world_size") as info:
        codec.decode(bad, RegisterJob)
    assert info.value.field == "job.world_size"


@pytest.mark.parametrize(
    "raw, match",
    [
        (b"\xc1", "not valid msgpack"),
        (msgpack.packb([1, 2]), "must be a map"),
        (msgpack.packb({"v": 2, "cmd": {"op": "info"}}), "schema version 2"),
        (msgpack.packb({"v": 1, "cmd": {"op": "explode"}}), "cmd"),
        (msgpack.packb({"v": 1, "cmd": {"op": "info"}, "extra": 1}), "extra"),
        (msgpack.packb({"v": 1, "cmd": {"op": "set_power_limit", "power_limit_w": "x"}}),
         "power_limit_w"),
    ],
)
def test_bad_payloads_raise_one_error_type_naming_the_problem(raw, match):
    with pytest.raises(PayloadError, match=match):
        codec.decode(raw, CommandEnvelope)


def test_reply_helpers():
    assert Reply.success(job_id="x").result == {"job_id": "x"}
    fail = codec.decode(codec.encode(Reply.failure("unknown_job", "no job 'x'")), Reply)
    assert (fail.ok, fail.code) == (False, "unknown_job")


def test_lease_renewal_needs_holder():
    with pytest.raises(PayloadError, match="holder"):
        codec.validate(LeaseRenewal, {"v": 1, "holder": "", "lease_s": 1})


def test_datagram_event_round_trip():
    raw = dg.encode_event(dg.Kind.INSTRUCTION_BEGIN, 42, 123456789, 7, 3, "forward")
    ev = dg.decode_datagram(raw)
    assert isinstance(ev, dg.EventDatagram)
    assert (ev.kind, ev.pid, ev.t_ns, ev.a, ev.b, ev.name) == (
        dg.Kind.INSTRUCTION_BEGIN, 42, 123456789, 7, 3, "forward")


def test_datagram_request_and_reply_round_trip():
    hello = dg.TrainerHello(job_id="j", rank=1, gpu_index=0)
    req = dg.decode_datagram(dg.encode_request(dg.Kind.HELLO, 5, 9, hello))
    assert isinstance(req, dg.RequestDatagram)
    assert dg.TrainerHello(**req.payload) == hello
    rep = dg.decode_datagram(dg.encode_reply(9, Reply.success(node="n")))
    assert isinstance(rep, dg.ReplyDatagram)
    assert rep.request_id == 9 and rep.reply.result == {"node": "n"}


@pytest.mark.parametrize(
    "raw, match",
    [
        (b"garbage\xc1", "not valid msgpack"),
        (msgpack.packb({"a": 1}), "array"),
        (msgpack.packb([9, 3, 1, 1, 1, 1, ""]), "protocol version 9"),
        (msgpack.packb([1, 99, 1, 1]), "unknown datagram kind"),
        (msgpack.packb([1, 3, 1, "t", 1, 1, ""]), "t_ns"),
        (msgpack.packb([1, 3, 1, 1, 1, 1]), "7 items"),
        (msgpack.packb([1, 5, 1, 1, 1, 1, 5]), "name"),
        (msgpack.packb([1, 20, 1, 1, [1]]), "HELLO"),
    ],
)
def test_bad_datagrams(raw, match):
    with pytest.raises(PayloadError, match=match):
        dg.decode_datagram(raw)


def test_an_event_name_with_control_characters_is_malformed():
    """Found by the fuzz tests: such a name passed the datagram decoder and failed later."""
    from zeus_agent.errors import PayloadError
    from zeus_agent.wire.trainer import Kind, decode_datagram, encode_event

    with pytest.raises(PayloadError, match="control characters"):
        decode_datagram(encode_event(int(Kind.INSTRUCTION_BEGIN), 1, 1, 0, 0, "\x99\tX"))
    assert decode_datagram(encode_event(int(Kind.INSTRUCTION_BEGIN), 1, 1, 0, 0, "forward")).name
