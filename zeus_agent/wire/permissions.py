"""NATS permissions of each role, derived from `subjects` (pure: no I/O, no NATS).

Three roles share one NATS account, each with its own users:

* **agent** (one user per node, `agent-<node>`): publishes only its own node's subjects
  (`<p>.gpu.<node>.*.{sample,error}`, `<p>.agent.<node>.{hello,power,error}`,
  `<p>.coord.{jobs,ranks}.register.<node>`, `<p>.job.*.ev.*.<node>`, `<p>.job.*.meas.<node>`),
  serves only its own GPUs' commands (`<p>.gpu.<node>.*.cmd`, and its node's batches
  `<p>.agent.<node>.cmd`), hears lease renewals and pings,
  and reads replies only under its own inbox prefix `_INBOX.<p>.node.<node>`. So a compromised
  node can neither command another node's GPUs, nor speak for another node, nor read anybody
  else's replies.
* **coordinator** (`coordinator`): commands every GPU (`<p>.gpu.*.*.cmd`, and node batches
  `<p>.agent.*.cmd`), renews leases, publishes job status and schedules, pings agents, serves
  `<p>.coord.*` requests and reads every node's measurements and events; its replies arrive
  under `_INBOX.<p>.coord`. Straggler notices (`<p>.coord.jobs.straggler`,
  `zeus-coordinator straggler`) change clocks, so they are sent with these credentials (an
  operator's), not the observer's.
* **observer** (`observer`, for `zeus-coordinator watch` and dashboards): read-only: asks
  `<p>.coord.jobs.query`, reads job status, agent announcements, GPU samples and the nodes'
  measurements (`<p>.job.*.meas.*`); replies under `_INBOX.<p>.observer`.
* **operator** (`operator-<name>`, only those named: `zeus-coordinator nats-auth --operator`):
  sets, shows and lifts power budgets (`<p>.coord.budget`), asks job queries and reads job
  status; replies under `_INBOX.<p>.operator`. No other role may send a budget request.

Replies to requests a client *received* (command replies, registration replies, `$SRV`
discovery answers) are allowed by NATS's `allow_responses` (one reply per request received),
not by a publish right on `_INBOX.>`. Each role subscribes to its own inbox prefix only, so
clients must connect with `inbox_prefix=` set to `inbox(role, ...)` (nats-py's default
`_INBOX.<random>` is refused).

Services built with `nats.micro` (the agent's GPU commands, the coordinator's endpoints) also
subscribe to the discovery subjects `$SRV.{PING,INFO,STATS}[.<service>[.<id>]]`; each role
may subscribe to those of its own service name only.

`render_authorization(nodes, prefix)` writes the `authorization { users = [...] }` block of a
nats-server configuration: one user per node's agent, a coordinator and an observer, each
password read from an environment variable (`password_variable`). Names are derived from the
node's subject token (`subjects.token`): user `agent-<token>` with characters other than
letters, digits, `-`, `_` and `~` replaced by `_`; variable `ZEUS_NATS_AGENT_<TOKEN>_PASSWORD`
with the token upper-cased and every character other than A-Z and 0-9 replaced by `_`. Two
nodes whose names map to the same user or variable are refused.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from zeus_agent.wire import subjects

Role = Literal["agent", "coordinator", "observer", "operator"]

AGENT_SERVICE = "zeus-agent"
"""`nats.micro` service name of the node agent (`zeus_agent.agent.server`)."""
COORDINATOR_SERVICE = "zeus-coordinator"
"""`nats.micro` service name of the coordinator (`coordinator.service`)."""
SRV_PREFIX = "$SRV"
"""Root of `nats.micro`'s discovery subjects (`nats.micro.service.DEFAULT_PREFIX`)."""

AGENT_INBOX_ROLE = "node"
COORDINATOR_INBOX_ROLE = "coord"
OBSERVER_INBOX_ROLE = "observer"
OPERATOR_INBOX_ROLE = "operator"

COORDINATOR_USER = "coordinator"
OBSERVER_USER = "observer"
AGENT_USER_PREFIX = "agent-"
OPERATOR_USER_PREFIX = "operator-"
PASSWORD_VARIABLE_PREFIX = "ZEUS_NATS_"


@dataclass(frozen=True)
class Permissions:
    """What one NATS user may do: subject allow (and deny) lists and `allow_responses`."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    publish_deny: tuple[str, ...] = ()
    subscribe_deny: tuple[str, ...] = ()
    allow_responses: bool = False


@dataclass(frozen=True)
class User:
    """One user of the generated configuration."""

    name: str
    password_variable: str
    role: Role
    permissions: Permissions
    node: str | None = field(default=None)


# --- subject patterns, derived from the subject functions ---------------------------------


class _Any:
    """Placeholder for "any value" of one argument of a subject function."""


ANY = _Any()


def pattern(fn: Callable[..., str], *args: object, prefix: str = subjects.DEFAULT_PREFIX) -> str:
    """`fn(*args, prefix)` with every `ANY` argument's token replaced by the wildcard `*`.

    The subject is built twice, with two different values in place of the `ANY` arguments;
    the tokens that differ are theirs. So the pattern follows the subject function's layout
    whatever it is, and a fixed argument (a node name) is never mistaken for a wildcard.
    """

    def build(value: str) -> list[str]:
        return fn(*[value if a is ANY else a for a in args], prefix=prefix).split(".")

    first, second = build("a"), build("b")
    if len(first) != len(second):  # pragma: no cover - subject functions keep one token each
        raise ValueError(f"{fn.__name__}: a wildcard argument spans several tokens")
    return ".".join("*" if x != y else x for x, y in zip(first, second, strict=True))


def inbox(role: Role, node: str = "", prefix: str = subjects.DEFAULT_PREFIX) -> str:
    """The `inbox_prefix` a client of `role` must connect with (agents: their node's).

    Raises:
        ValueError: An agent's inbox without a node.
    """
    if role == "agent":
        if not node:
            raise ValueError("an agent's inbox prefix needs its node's name")
        return subjects.inbox_prefix(AGENT_INBOX_ROLE, node, prefix)
    if role == "coordinator":
        return subjects.inbox_prefix(COORDINATOR_INBOX_ROLE, "", prefix)
    if role == "operator":
        return subjects.inbox_prefix(OPERATOR_INBOX_ROLE, "", prefix)
    return subjects.inbox_prefix(OBSERVER_INBOX_ROLE, "", prefix)


def _below(subject: str) -> str:
    return f"{subject}.>"


def srv_subjects(service: str) -> tuple[str, ...]:
    """Discovery subjects a `nats.micro` service named `service` subscribes to.

    `$SRV.<VERB>`, `$SRV.<VERB>.<service>` and `$SRV.<VERB>.<service>.<id>` for the verbs
    PING, INFO and STATS (`nats.micro.service.Service.start`).
    """
    verbs = ("PING", "INFO", "STATS")  # literal: "$SRV.*" would also admit "$SRV.>"-like reach
    return tuple(
        subject
        for verb in verbs
        for subject in (
            f"{SRV_PREFIX}.{verb}",
            f"{SRV_PREFIX}.{verb}.{service}",
            f"{SRV_PREFIX}.{verb}.{service}.*",
        )
    )


# --- roles ----------------------------------------------------------------------------------


def agent(node: str, prefix: str = subjects.DEFAULT_PREFIX) -> Permissions:
    """Permissions of `node`'s agent: its own node's subjects only."""
    p = prefix
    return Permissions(
        publish=(
            subjects.agent_hello(node, p),
            subjects.agent_power(node, p),
            subjects.agent_errors(node, p),
            pattern(subjects.gpu_samples, node, ANY, prefix=p),
            pattern(subjects.gpu_errors, node, ANY, prefix=p),
            subjects.coord_register_job(node, p),
            subjects.coord_register_rank(node, p),
            subjects.coord_job_query(p),  # relays its trainers' job queries (their profiles)
            pattern(subjects.job_events, ANY, ANY, node, prefix=p),
            pattern(subjects.job_measurements, ANY, node, prefix=p),
            _below(inbox("agent", node, p)),  # requests to itself (confirm_subscriptions)
        ),
        subscribe=(
            pattern(subjects.gpu_command, node, ANY, prefix=p),
            subjects.node_command(node, p),
            subjects.all_lease_renewals(p),
            subjects.agent_ping(p),
            _below(inbox("agent", node, p)),
            *srv_subjects(AGENT_SERVICE),
        ),
        allow_responses=True,
    )


def jetstream_state(prefix: str = subjects.DEFAULT_PREFIX) -> tuple[str, ...]:
    """What the coordinator publishes to keep its state in JetStream KV.

    The JetStream API (bucket creation, reads, watches and their flow control) and writes to its
    own buckets (`subjects.state_buckets`). Agents and observers get none of it.
    """
    state, owners = subjects.state_buckets(prefix)
    return ("$JS.API.>", "$JS.FC.>", "$JS.ACK.>", f"$KV.{state}.>", f"$KV.{owners}.>")


def coordinator(prefix: str = subjects.DEFAULT_PREFIX) -> Permissions:
    """Permissions of the coordinator: commands every GPU, serves `<p>.coord.*`."""
    p = prefix
    return Permissions(
        publish=(
            subjects.all_gpu_commands(p),
            subjects.all_node_commands(p),
            subjects.all_lease_renewals(p),
            subjects.all_job_status(p),
            subjects.all_budget_status(p),
            subjects.agent_ping(p),
            subjects.coord_job_straggler(p),  # operators' notices (`zeus-coordinator straggler`)
            subjects.all_coord_replicas(p),  # requests forwarded to a job's owning replica
            f"{SRV_PREFIX}.>",  # discovery requests (read-only answers)
            *jetstream_state(p),
            _below(inbox("coordinator", prefix=p)),
        ),
        subscribe=(
            subjects.all_coord_register_job(p),
            subjects.all_coord_register_rank(p),
            subjects.coord_job_query(p),
            subjects.coord_job_straggler(p),
            subjects.coord_budget(p),
            subjects.all_coord_replicas(p),
            subjects.all_job_events(p),
            subjects.all_job_status(p),
            subjects.all_job_measurements(p),
            pattern(subjects.gpu_errors, ANY, ANY, prefix=p),
            pattern(subjects.gpu_samples, ANY, ANY, prefix=p),
            pattern(subjects.agent_hello, ANY, prefix=p),
            pattern(subjects.agent_power, ANY, prefix=p),
            pattern(subjects.agent_errors, ANY, prefix=p),
            _below(inbox("coordinator", prefix=p)),
            *srv_subjects(COORDINATOR_SERVICE),
        ),
        allow_responses=True,
    )


def observer(prefix: str = subjects.DEFAULT_PREFIX) -> Permissions:
    """Permissions of a read-only observer (`zeus-coordinator watch`, dashboards)."""
    p = prefix
    return Permissions(
        publish=(subjects.coord_job_query(p), _below(inbox("observer", prefix=p))),
        subscribe=(
            subjects.all_job_status(p),
            subjects.all_budget_status(p),
            pattern(subjects.agent_hello, ANY, prefix=p),
            pattern(subjects.agent_power, ANY, prefix=p),
            pattern(subjects.gpu_samples, ANY, ANY, prefix=p),
            subjects.all_job_measurements(p),
            _below(inbox("observer", prefix=p)),
        ),
    )


def operator(prefix: str = subjects.DEFAULT_PREFIX) -> Permissions:
    """Permissions of an operator (`zeus-coordinator budget`): power budgets, and job queries."""
    p = prefix
    return Permissions(
        publish=(subjects.coord_budget(p), subjects.coord_job_query(p),
                 _below(inbox("operator", prefix=p))),
        subscribe=(subjects.all_job_status(p), subjects.all_budget_status(p),
                   _below(inbox("operator", prefix=p))),
    )


# --- users and configuration ----------------------------------------------------------------

_USER_UNSAFE = re.compile(r"[^A-Za-z0-9_~\-]")
_VAR_UNSAFE = re.compile(r"[^A-Z0-9]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def agent_user(node: str) -> str:
    """NATS user name of `node`'s agent: `agent-<token>` (see the module's docstring)."""
    return AGENT_USER_PREFIX + _USER_UNSAFE.sub("_", subjects.token(node))


def password_variable(role: Role, node: str = "") -> str:
    """Environment variable holding a user's password, e.g. `ZEUS_NATS_AGENT_GPU_A_PASSWORD`."""
    if role in ("agent", "operator"):
        name = f"{role.upper()}_" + _VAR_UNSAFE.sub("_", subjects.token(node).upper())
    else:
        name = role.upper()
    return f"{PASSWORD_VARIABLE_PREFIX}{name}_PASSWORD"


def users(
    nodes: Iterable[str], prefix: str = subjects.DEFAULT_PREFIX, operators: Iterable[str] = ()
) -> list[User]:
    """Every user: one agent per node (in order), the coordinator, an observer, the operators.

    Operators (`operator-<name>`, password in `ZEUS_NATS_OPERATOR_<NAME>_PASSWORD`) set power
    budgets; there are none unless named.

    Raises:
        ValueError: No node, an invalid prefix, or two nodes sharing a user or variable name.
    """
    subjects.check_prefix(prefix)
    unique = list(dict.fromkeys(nodes))
    if not unique:
        raise ValueError("no node given: name every GPU node whose agent needs credentials")
    result: list[User] = []
    seen_user: dict[str, str] = {}
    seen_var: dict[str, str] = {}
    for node in unique:
        name, var = agent_user(node), password_variable("agent", node)
        for seen, key in ((seen_user, name), (seen_var, var)):
            if key in seen:
                raise ValueError(
                    f"nodes {seen[key]!r} and {node!r} would share the NATS name {key}; "
                    "rename one of them (names differing only in case or punctuation collide)"
                )
            seen[key] = node
        result.append(User(name, var, "agent", agent(node, prefix), node))
    result.append(
        User(COORDINATOR_USER, password_variable("coordinator"), "coordinator", coordinator(prefix))
    )
    result.append(User(OBSERVER_USER, password_variable("observer"), "observer", observer(prefix)))
    for name in dict.fromkeys(operators):
        user = OPERATOR_USER_PREFIX + _USER_UNSAFE.sub("_", subjects.token(name))
        var = password_variable("operator", name)
        if user in seen_user or var in seen_var:
            raise ValueError(f"operator {name!r} would share the NATS name {user} or {var}")
        seen_user[user], seen_var[var] = name, name
        result.append(User(user, var, "operator", operator(prefix), name))
    return result


def _q(text: str) -> str:
    return json.dumps(text)


def _subject_list(key: str, allow: Sequence[str], deny: Sequence[str], indent: str) -> list[str]:
    lines = [f"{indent}{key}: {{"]
    for name, items in (("allow", allow), ("deny", deny)):
        if items or name == "allow":
            lines.append(f"{indent}  {name}: [")
            lines += [f"{indent}    {_q(s)}" for s in items]
            lines.append(f"{indent}  ]")
    lines.append(f"{indent}}}")
    return lines


def _comment(user: User) -> str:
    if user.role == "agent":
        return f"agent of node {_q(user.node or '')}: its own node's subjects only"
    if user.role == "coordinator":
        return "the coordinator: commands every GPU, serves registrations and queries"
    if user.role == "operator":
        return f"operator {_q(user.node or '')}: sets, shows and lifts power budgets"
    return "read-only observer: job status and queries, announcements, samples, measurements"


def render_authorization(
    nodes: Iterable[str],
    prefix: str = subjects.DEFAULT_PREFIX,
    command: str = "",
    operators: Iterable[str] = (),
) -> str:
    """The nats-server `authorization { users = [...] }` block for `nodes` (ends with a newline).

    Args:
        nodes: Node names, as the agents' `--node`.
        prefix: Subject prefix of the deployment.
        command: How the block was generated, quoted in its header comment.
        operators: Operators' names (users `operator-<name>`, who may set power budgets).

    Raises:
        ValueError: As `users`.
    """
    all_users = users(nodes, prefix, operators)
    command = _CONTROL.sub("?", command)  # one comment line, whatever the node names hold
    width = max(len(u.password_variable) for u in all_users)
    out = [
        "# NATS users of zeus-bus, one per node's agent, a coordinator and an observer.",
        f"# Generated{f' by `{command}`' if command else ''}: regenerate rather than edit",
        "# (zeus_agent/wire/permissions.py derives its subjects from zeus_agent/wire/subjects.py).",
        f"# Subject prefix: {_q(prefix)}. Clients must connect with their role's inbox prefix.",
        "# Passwords are read from these environment variables, which must be set wherever",
        "# nats-server reads this file (`nats-server -t -c ...` included):",
    ]
    out += [f"#   {u.password_variable:<{width}}  user {u.name}" for u in all_users]
    out += ["authorization {", "  users = ["]
    for u in all_users:
        perms = u.permissions
        out += [
            f"    # {_comment(u)}",
            "    {",
            f"      user: {_q(u.name)}",
            f"      password: ${u.password_variable}",
            "      permissions: {",
            *_subject_list("publish", perms.publish, perms.publish_deny, "        "),
            *_subject_list("subscribe", perms.subscribe, perms.subscribe_deny, "        "),
            f"        allow_responses: {'true' if perms.allow_responses else 'false'}",
            "      }",
            "    }",
        ]
    out += ["  ]", "}"]
    return "\n".join(out) + "\n"
