"""Role permissions follow the subject functions; the generated configuration and command."""

from __future__ import annotations

import argparse
import stat
from pathlib import Path

import pytest
from nats.micro.service import DEFAULT_PREFIX as MICRO_PREFIX
from nats.micro.service import ServiceVerb, control_subject

from coordinator import nats_auth
from zeus_agent.wire import permissions, subjects
from zeus_agent.wire.permissions import ANY, pattern


def matches(pattern_: str, subject: str) -> bool:
    """NATS subject matching (`*` one token, `>` one or more at the end)."""
    pat, sub = pattern_.split("."), subject.split(".")
    for i, p in enumerate(pat):
        if p == ">":
            return len(sub) > i
        if i >= len(sub) or (p != "*" and p != sub[i]):
            return False
    return len(pat) == len(sub)


def allowed(patterns: tuple[str, ...], subject: str) -> bool:
    return any(matches(p, subject) for p in patterns)


def test_pattern_wildcards_only_the_any_arguments():
    assert pattern(subjects.gpu_command, "gpu-a", ANY) == "zeus.gpu.gpu-a.*.cmd"
    assert pattern(subjects.job_events, ANY, ANY, "n", prefix="t.x") == "t.x.job.*.ev.*.n"
    # A node called like the placeholders stays a literal token.
    assert pattern(subjects.gpu_samples, "a", ANY) == "zeus.gpu.a.*.sample"
    assert pattern(subjects.gpu_samples, "b", ANY) == "zeus.gpu.b.*.sample"
    assert pattern(subjects.job_measurements, ANY, ANY) == subjects.all_job_measurements()
    assert pattern(subjects.job_measurements, ANY, "n") == subjects.all_node_measurements("n")
    assert pattern(subjects.job_measurements, "j/x", ANY) == subjects.all_measurements_of_job("j/x")


@pytest.mark.parametrize("node", ["gpu-a", "n1.cluster.local", "*", ">", "a b", "x" * 100])
def test_an_agent_holds_exactly_its_own_nodes_subjects(node):
    perms = permissions.agent(node)
    other = "gpu-b"
    own_pub = [
        subjects.gpu_samples(node, 3), subjects.job_measurements("any job / with spaces", node),
        subjects.gpu_errors(node, 1), subjects.agent_hello(node), subjects.agent_errors(node),
        subjects.coord_register_job(node), subjects.coord_register_rank(node),
        subjects.job_events("any job / with spaces", 7, node),
        subjects.coord_job_query(),  # relays its trainers' queries (their measured profiles)
        permissions.inbox("agent", node) + ".abc.1",
    ]  # fmt: skip
    for s in own_pub:
        assert allowed(perms.publish, s), s
    for s in (
        subjects.gpu_command(other, 0), subjects.gpu_command(node, 0),
        subjects.node_command(node), subjects.node_command(other),
        subjects.gpu_samples(other, 0), subjects.coord_register_rank(other),
        subjects.coord_register_job(other), subjects.job_events("j", 0, other),
        subjects.job_measurements("j", other),
        subjects.agent_hello(other), subjects.lease_renewal("h"), subjects.job_status("j"),
        subjects.agent_ping(),
        permissions.inbox("coordinator") + ".x", permissions.inbox("agent", other) + ".x",
        "_INBOX.x", "$SRV.PING",
    ):  # fmt: skip
        assert not allowed(perms.publish, s), s
    own_sub = [
        subjects.gpu_command(node, 0), subjects.lease_renewal("job"), subjects.agent_ping(),
        subjects.node_command(node), permissions.inbox("agent", node) + ".abc.*",
    ]  # fmt: skip
    for s in own_sub:
        assert allowed(perms.subscribe, s), s
    for s in (
        subjects.gpu_command(other, 0), subjects.gpu_samples(node, 0),
        subjects.node_command(other), subjects.all_node_commands(),
        permissions.inbox("coordinator") + ".x", permissions.inbox("agent", other) + ".x",
        "_INBOX.x", subjects.job_status("j"), subjects.coord_register_rank(node),
    ):  # fmt: skip
        assert not allowed(perms.subscribe, s), s
    assert perms.allow_responses
    # Every pattern is the node's own: no wildcard stands where the node token is.
    token = subjects.token(node)
    for p in perms.publish:
        assert (token in p.split(".") or p.startswith(permissions.inbox("agent", node))
                or p == subjects.coord_job_query()), p


def test_no_wildcard_in_a_pattern_comes_from_a_user_value():
    for node in ("*", ">", "a.*", "a.>"):
        for p in permissions.agent(node).publish + permissions.agent(node).subscribe:
            assert ">" not in p.split(".")[:-1] and p.count(">") <= 1, p
        assert "zeus.gpu.*.*.cmd" not in permissions.agent(node).subscribe


def test_agents_micro_discovery_subjects_are_their_services_only():
    perms = permissions.agent("gpu-a")
    assert permissions.SRV_PREFIX == MICRO_PREFIX
    for verb in ServiceVerb:
        for name, id_ in ((None, None), ("zeus-agent", None), ("zeus-agent", "ID123")):
            assert allowed(perms.subscribe, control_subject(verb, name=name, id=id_)), verb
        coord = control_subject(verb, name=permissions.COORDINATOR_SERVICE)
        assert not allowed(perms.subscribe, coord)
        assert allowed(permissions.coordinator().subscribe, coord)


def test_coordinator_and_observer():
    coord = permissions.coordinator()
    for s in (
        subjects.gpu_command("n", 0), subjects.lease_renewal("j"), subjects.job_status("j"),
        subjects.agent_ping(), "$SRV.INFO.zeus-agent", subjects.node_command("n"),
        permissions.inbox("coordinator") + ".x.1",
    ):  # fmt: skip
        assert allowed(coord.publish, s), s
    for s in (subjects.gpu_samples("n", 0), subjects.coord_register_rank("n"), "_INBOX.x"):
        assert not allowed(coord.publish, s), s
    for s in (
        subjects.coord_register_job("n"), subjects.coord_register_rank("n"),
        subjects.coord_job_query(), subjects.job_events("j", 0, "n"),
        subjects.job_measurements("j", "n"), subjects.gpu_errors("n", 0),
        subjects.agent_hello("n"), permissions.inbox("coordinator") + ".x.*",
    ):  # fmt: skip
        assert allowed(coord.subscribe, s), s
    for s in (subjects.gpu_command("n", 0), subjects.node_command("n"), "_INBOX.x",
              permissions.inbox("agent", "n") + ".x"):
        assert not allowed(coord.subscribe, s), s

    obs = permissions.observer("t")
    assert obs.publish == ("t.coord.jobs.query", "_INBOX.t.observer.>")
    assert not obs.allow_responses
    assert allowed(obs.subscribe, subjects.job_status("j", "t"))
    assert allowed(obs.subscribe, subjects.job_measurements("j", "n", "t"))
    assert allowed(obs.subscribe, subjects.all_node_measurements("n", "t"))
    for s in (subjects.gpu_command("n", 0, "t"), subjects.job_events("j", 0, "n", "t"),
              subjects.node_command("n", "t")):
        assert not allowed(obs.subscribe, s)
        assert not allowed(obs.publish, s)


def test_inboxes_match_subjects_inbox_prefix():
    assert permissions.inbox("agent", "gpu-a") == subjects.inbox_prefix("node", "gpu-a")
    assert permissions.inbox("coordinator", prefix="t") == "_INBOX.t.coord"
    assert permissions.inbox("observer") == "_INBOX.zeus.observer"
    with pytest.raises(ValueError, match="node"):
        permissions.inbox("agent")


def test_user_and_variable_names():
    assert permissions.agent_user("gpu-a") == "agent-gpu-a"
    assert permissions.password_variable("agent", "gpu-a") == "ZEUS_NATS_AGENT_GPU_A_PASSWORD"
    assert permissions.password_variable("coordinator") == "ZEUS_NATS_COORDINATOR_PASSWORD"
    assert permissions.password_variable("observer") == "ZEUS_NATS_OBSERVER_PASSWORD"
    fqdn = "n1.cluster.local"
    token = subjects.token(fqdn)
    assert permissions.agent_user(fqdn) == "agent-" + token.replace(".", "_")
    assert permissions.password_variable("agent", fqdn).startswith("ZEUS_NATS_AGENT_N1_CLUSTER")
    assert permissions.agent_user("a:b@c") == "agent-a_b_c"  # usable in a URL


def test_users_refuse_colliding_names_and_dedupe():
    with pytest.raises(ValueError, match="share"):
        permissions.users(["gpu-a", "GPU_A"])
    with pytest.raises(ValueError, match="no node"):
        permissions.users([])
    with pytest.raises(ValueError, match="prefix"):
        permissions.users(["a"], prefix="bad prefix")
    names = [u.name for u in permissions.users(["a", "b", "a"])]
    assert names == ["agent-a", "agent-b", "coordinator", "observer"]


def test_render_quotes_subjects_and_references_password_variables():
    text = permissions.render_authorization(["gpu-a"], command="x\ninclude /etc/passwd")
    assert "password: $ZEUS_NATS_AGENT_GPU_A_PASSWORD" in text
    assert '"zeus.gpu.gpu-a.*.cmd"' in text and '"$SRV.PING.zeus-agent"' in text
    assert '"$SRV.*"' not in text  # the verbs are literal
    assert "x?include /etc/passwd" in text  # a comment, not a directive
    assert text.count("allow_responses: true") == 2  # agent, coordinator
    assert text.count("allow_responses: false") == 1  # observer
    assert text.endswith("}\n")


def _args(**kw: object) -> argparse.Namespace:
    parser = nats_auth.build_parser()
    args = parser.parse_args([])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_command_writes_the_config_and_an_env_file(tmp_path: Path, capsys):
    out, env = tmp_path / "auth.conf", tmp_path / "nats.env"
    nodes_file = tmp_path / "nodes.txt"
    nodes_file.write_text("# cluster\ngpu-b\n\ngpu-c  # rack 2\n")
    assert nats_auth.main(_args(node=["gpu-a"], nodes_file=nodes_file, out=out, env_file=env)) == 0
    assert out.read_text() == permissions.render_authorization(
        ["gpu-a", "gpu-b", "gpu-c"],
        command="zeus-coordinator nats-auth --node gpu-a --node gpu-b --node gpu-c",
    )
    assert stat.S_IMODE(env.stat().st_mode) == 0o600
    values = dict(line.split("=", 1) for line in env.read_text().splitlines()[1:])
    assert set(values) == {
        u.password_variable for u in permissions.users(["gpu-a", "gpu-b", "gpu-c"])
    }
    assert all(v[0].isalpha() and v.isalnum() and len(v) >= 40 for v in values.values())
    # Adding a node keeps the passwords already handed out.
    assert (
        nats_auth.main(_args(node=["gpu-a", "gpu-d"], nodes_file=nodes_file, out=out, env_file=env))
        == 0
    )
    again = dict(line.split("=", 1) for line in env.read_text().splitlines()[1:])
    assert {k: again[k] for k in values} == values and "ZEUS_NATS_AGENT_GPU_D_PASSWORD" in again
    assert "agent-gpu-d" in capsys.readouterr().err


def test_command_prints_to_stdout_and_refuses_bad_input(capsys):
    assert nats_auth.main(_args(node=["gpu-a"], prefix="t")) == 0
    out = capsys.readouterr().out
    assert '"t.gpu.gpu-a.*.cmd"' in out and "--prefix t --node gpu-a" in out
    assert nats_auth.main(_args(node=[])) == 2
    assert "no node" in capsys.readouterr().err
    assert nats_auth.main(_args(node=["a-b", "A_B"])) == 2
    assert "share" in capsys.readouterr().err


def test_help_names_the_variables():
    text = nats_auth.build_parser().format_help()
    for word in ("ZEUS_NATS_AGENT_<NODE>_PASSWORD", "ZEUS_NATS_COORDINATOR_PASSWORD", "--out",
                 "nats-server -t -c"):  # fmt: skip
        assert word in text
