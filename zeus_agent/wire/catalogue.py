"""Every NATS subject of the contract, as data: its pattern, who talks, and its payloads.

The one list the documentation's subject reference is generated from (`tools/gen_docs.py`) and
that a test holds to the builders in `zeus_agent.wire.subjects` (each pattern, its placeholders
filled, is what its builder returns). A subject added to the contract without an entry here is
undocumented; `tests/wire/test_catalogue.py` lists the builders that lack one.

Pure data: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel

from zeus_agent.wire import messages as m
from zeus_agent.wire import subjects as s
from zeus_agent.wire.budget import BudgetRequest, BudgetStatus
from zeus_agent.wire.event_columns import TrainerEventColumns
from zeus_agent.wire.node_batch import NodeMeasurementBatch
from zeus_agent.wire.node_columns import NodeColumnBatch
from zeus_agent.wire.node_command import NodeCommandBatch, NodeCommandReply
from zeus_agent.wire.node_power import NodePower
from zeus_agent.wire.rank_batch import RegisterRanks
from zeus_agent.wire.rank_columns import RegisterRankColumns
from zeus_agent.wire.replicas import ReplicaAlive

__all__ = ["SUBJECTS", "SubjectSpec"]


@dataclass(frozen=True)
class SubjectSpec:
    """One subject of the contract.

    Attributes:
        pattern: The subject with `{placeholders}` (`{prefix}` first), as the docs show it.
        builder: The function of `zeus_agent.wire.subjects` that builds it.
        direction: Who publishes to whom (`agent -> coordinator`, ...).
        payload: The model of what is published (None: an empty payload).
        reply: The model of the reply for request/reply subjects (None: no reply).
        summary: One sentence: what goes there and when.
        also: Other payloads the subject takes (a node's batch of what `payload` is).
    """

    pattern: str
    builder: Callable[..., str]
    direction: str
    payload: type[BaseModel] | None
    reply: type[BaseModel] | None
    summary: str
    also: tuple[type[BaseModel], ...] = ()

    @property
    def placeholders(self) -> tuple[str, ...]:
        """The placeholders of the pattern after `{prefix}`, in order."""
        return tuple(part[1:-1] for part in self.pattern.split(".")
                     if part.startswith("{") and part != "{prefix}")


SUBJECTS: tuple[SubjectSpec, ...] = (
    SubjectSpec("{prefix}.agent.{node}.hello", s.agent_hello, "agent -> all", m.AgentHello, None,
                "An agent announces its GPUs (uuid, name, limits, clocks, whether it may "
                "control them); repeated as its heartbeat."),
    SubjectSpec("{prefix}.agent.{node}.power", s.agent_power, "agent ->", NodePower, None,
                "Each of a node's GPUs' latest power draw, one message per publish interval: "
                "what power budgets read (older agents send none: their per-GPU samples "
                "are followed instead)."),
    SubjectSpec("{prefix}.agent.ping", s.agent_ping, "anyone -> agents", None, None,
                "Asks every agent to announce itself now (a coordinator that starts)."),
    SubjectSpec("{prefix}.agent.{node}.error", s.agent_errors, "agent ->", m.ErrorEvent, None,
                "A node's errors that belong to no GPU: bad datagrams, trainers gone."),
    SubjectSpec("{prefix}.gpu.{node}.{gpu}.sample", s.gpu_samples, "agent ->", m.SampleBatch,
                None, "A GPU's batched samples: time, energy, power, limit, clocks."),
    SubjectSpec("{prefix}.gpu.{node}.{gpu}.cmd", s.gpu_command, "-> agent (request/reply)",
                m.CommandEnvelope, m.Reply,
                "A command to one GPU: info, set/reset power limit, lock/reset clocks, "
                "install/clear schedule, bind/unbind a rank, energy, renew, a budget's node cap."),
    SubjectSpec("{prefix}.agent.{node}.cmd", s.node_command, "-> agent (request/reply)",
                NodeCommandBatch, NodeCommandReply,
                "Commands for several GPUs of one node in one request: each item is what its "
                "GPU's `cmd` subject takes, run exactly as there (fencing included); the reply "
                "holds each item's `Reply` in order, or one `Reply` (`bad_request`) for a batch "
                "that does not validate, nothing run."),
    SubjectSpec("{prefix}.gpu.{node}.{gpu}.error", s.gpu_errors, "agent ->", m.ErrorEvent, None,
                "A GPU's rank errors: schedule mismatches, lapsed leases, measurement gaps."),
    SubjectSpec("{prefix}.lease.{holder}", s.lease_renewal, "coordinator -> agents",
                m.LeaseRenewal, None, "Renews every lease `holder` has on any agent (each agent "
                "follows it while it holds one). Header `Zeus-Reads: columns/1`: the sender "
                "reads columns (`NodeColumnBatch`, `TrainerEventColumns`); an agent sends a "
                "job's in columns only while the job's owner says so and no coordinator it "
                "hears says otherwise."),
    SubjectSpec("{prefix}.coord.jobs.register.{node}", s.coord_register_job,
                "node's agent -> coordinator (request/reply)", m.RegisterJob, m.Reply,
                "Registers a trainer's job; the reply carries the job id and join token."),
    SubjectSpec("{prefix}.coord.ranks.register.{node}", s.coord_register_rank,
                "node's agent -> coordinator (request/reply)", m.RegisterRank, m.Reply,
                "Registers a rank, only through the node its GPU is on; the node's ranks that "
                "register together in one `RegisterRanks` (or `RegisterRankColumns`: the same "
                "ranks in columns), answered with one reply per rank (`result.replies`, in "
                "order).", also=(RegisterRanks, RegisterRankColumns)),
    SubjectSpec("{prefix}.coord.jobs.query", s.coord_job_query,
                "anyone -> coordinator (request/reply)", m.JobQuery, m.Reply,
                "One job's state, progress and measured profile, or a page of job ids."),
    SubjectSpec("{prefix}.coord.jobs.straggler", s.coord_job_straggler,
                "operator -> coordinator (request/reply)", m.StragglerNotice, m.Reply,
                "Says a pipeline of a job is a straggler (or no longer is)."),
    SubjectSpec("{prefix}.coord.budget", s.coord_budget,
                "operator -> coordinator (request/reply)", BudgetRequest, m.Reply,
                "Sets, shows or lifts a power budget (a cap for a group of GPUs)."),
    SubjectSpec("{prefix}.budget.{budget}.status", s.budget_status, "coordinator ->",
                BudgetStatus, None,
                "A governing budget's cap, room, measured and expected draw and each job's "
                "share, every second from the replica applying it."),
    SubjectSpec("{prefix}.coord.replica.{replica}.{endpoint}", s.coord_replica,
                "replica -> replica (request/reply)", None, m.Reply,
                "A replica's own endpoints (`query`, `straggler`: the same payloads): a "
                "replica that does not own a job forwards requests about it to its owner; "
                "`take` (a `JobQuery`): a replica that registered a job asks the replica "
                "rendezvous hashing prefers to take it."),
    SubjectSpec("{prefix}.coord.replica.{replica}.alive", s.replica_alive,
                "replica -> replicas", ReplicaAlive, None,
                "A replica is live (every lease_s / 3) or leaving: the replicas share the jobs "
                "out among those live, by rendezvous hashing."),
    SubjectSpec("{prefix}.job.{job}.ev.{rank}.{node}", s.job_events, "node's agent ->",
                m.TrainerEventBatch, None,
                "A rank's batched trainer events with the rank's counters; as rows, or in "
                "columns (`TrainerEventColumns`: an array per field, told apart by its "
                "`columns` field) while the job's owner says it reads them and no coordinator "
                "the agent hears says otherwise (`--measurement-columns auto`, the "
                "`Zeus-Reads` header of their lease renewals).",
                also=(TrainerEventColumns,)),
    SubjectSpec("{prefix}.job.{job}.meas.{node}", s.job_measurements, "node's agent ->",
                NodeMeasurementBatch, None,
                "The step marks (time, energy, limit at a step's edge) and step and instruction "
                "measurements of the job's ranks on the node's GPUs, once counter reads bracket "
                "them: one batch per job per flush, a part per GPU; as rows, or in columns "
                "(`NodeColumnBatch`: an array per field, decoded several times faster; told "
                "apart by its `columns` field) while the job's owner says it reads them and no "
                "coordinator the agent hears says otherwise (`--measurement-columns auto`).",
                also=(NodeColumnBatch,)),
    SubjectSpec("{prefix}.job.{job}.status", s.job_status, "coordinator ->", m.JobStatus, None,
                "A job's state, message and progress."),
)
"""Every subject, in the order the reference shows them."""
