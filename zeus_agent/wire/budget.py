"""Power budgets on the wire: what an operator asks the coordinator (`<p>.coord.budget`).

A budget names a group of GPUs (the whole cluster, a list of nodes, or the nodes whose agent
announced a label `key=value`, `zeus-agent run --labels`), a cap in watts or a cut in percent of
the group's measured draw when the budget is set, and optionally a start and an end (Unix
seconds). Everything an operator can get wrong in one request is refused here, before the
coordinator looks at it: negative, NaN or absurd values, an end before its start, a malformed
group. What needs the cluster (an unknown group, a cap below the group's floor) is refused by
the coordinator (`coordinator.budget.budgets`).

Two budgets may cover one GPU: the lower cap wins there (`coordinator.budget.budgets`).
"""

from __future__ import annotations

import math
import re
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from zeus_agent.models import MAX_POWER_W
from zeus_agent.wire.messages import MAX_NAME_CHARS, AddedFields, Id, Message, Name, Text

MAX_CAP_W = 100_000_000.0
"""Largest cap (100 MW): a cap above what any facility draws is a typo, not a budget."""
MAX_NODES = 10_000
"""Most nodes one budget may list."""
MAX_SHARES = 10_000
"""Most jobs one budget's status lists."""
MAX_TIME_S = 2.0**33
"""Latest start or end (Unix seconds, year 2242)."""
MEASURED_RANGE = (1.0, 10.0)
"""A measured option's step time over the job's at its own point, kept within (a measure
outside says more about the host than the caps: `coordinator.budget.timing`)."""
MAX_MEASURED = 256
"""Most options one job's `BudgetTiming` keeps: a frontier offers at most a few dozen points
and a throttled option every 25 W."""
MAX_FRONTIER_INDEX = 1_000_000
"""Largest frontier index a measure may name."""
MAX_SLOWDOWN = 1e6
"""Largest slowdown a budget's status says (a larger one is said as this)."""
LABEL = re.compile(r"^[A-Za-z0-9_.\-/]{1,63}=[A-Za-z0-9_.\-]{0,63}$")
"""`key=value`, as Kubernetes labels spell them (no '=' or white space inside)."""

BudgetId = Annotated[
    str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")
]
"""A budget's name: letters, digits, '-' and '_' (it is a key token in the state bucket)."""
Label = Annotated[str, StringConstraints(max_length=MAX_NAME_CHARS, pattern=LABEL.pattern)]


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class BudgetGroup(_Part):
    """Which GPUs a budget covers: every one, those of some nodes, or those of labelled nodes."""

    kind: Literal["cluster", "nodes", "label"] = "cluster"
    nodes: list[Name] = Field(default=[], max_length=MAX_NODES)
    label: Label | None = None

    @model_validator(mode="after")
    def _consistent(self) -> BudgetGroup:
        if self.kind == "nodes" and (not self.nodes or any(not n for n in self.nodes)):
            raise ValueError("a group of nodes needs at least one node name")
        if self.kind != "nodes" and self.nodes:
            raise ValueError(f"a {self.kind} group names no nodes")
        if (self.kind == "label") != (self.label is not None):
            raise ValueError("a label group, and only it, names a label key=value")
        return self

    def describe(self) -> str:
        """The group in a few words, for people."""
        if self.kind == "nodes":
            return f"nodes {', '.join(self.nodes[:8])}{' ...' if len(self.nodes) > 8 else ''}"
        return f"nodes labelled {self.label}" if self.kind == "label" else "the whole cluster"


class Budget(_Part):
    """One budget: a group, a cap (or a cut) and its time window."""

    budget_id: BudgetId
    group: BudgetGroup = BudgetGroup()
    cap_w: float | None = Field(default=None, gt=0, le=MAX_CAP_W)
    cut_pct: float | None = Field(default=None, gt=0, lt=100)
    start_s: float | None = Field(default=None, ge=0, le=MAX_TIME_S)
    end_s: float | None = Field(default=None, ge=0, le=MAX_TIME_S)
    note: Text = ""

    @model_validator(mode="after")
    def _consistent(self) -> Budget:
        if (self.cap_w is None) == (self.cut_pct is None):
            raise ValueError("give either cap_w (W) or cut_pct (% of the group's draw), not both")
        if self.end_s is not None and self.start_s is not None and self.end_s <= self.start_s:
            raise ValueError(f"end_s {self.end_s} is not after start_s {self.start_s}")
        for value in (self.cap_w, self.cut_pct, self.start_s, self.end_s):
            if value is not None and not math.isfinite(value):  # pragma: no cover - pydantic
                raise ValueError("budgets take finite numbers only")
        return self

    def active(self, now_s: float) -> bool:
        """Whether the budget holds at `now_s` (Unix seconds)."""
        started = self.start_s is None or self.start_s <= now_s
        return started and (self.end_s is None or now_s < self.end_s)


class BudgetRequest(Message):
    """An operator's request on `<p>.coord.budget`: set (or change), show or lift budgets.

    `set` with `cut_pct` is answered with the cap it became (the group's measured draw then,
    less the cut); the budget is kept with that cap. `show` without `budget_id` lists every
    budget. `lift` removes one: its GPUs' caps end and their jobs return to their optimum.
    """

    action: Literal["set", "show", "lift"]
    budget: Budget | None = None
    budget_id: BudgetId | None = None

    @model_validator(mode="after")
    def _consistent(self) -> BudgetRequest:
        if self.action == "set" and self.budget is None:
            raise ValueError("set needs a budget")
        if self.action == "lift" and self.budget_id is None:
            raise ValueError("lift needs the budget_id")
        if self.action != "set" and self.budget is not None:
            raise ValueError(f"{self.action} takes a budget_id, not a budget")
        return self


class BudgetShare(_Part):
    """One job's share of a budget: the limit its GPUs are capped to and what it costs it."""

    job_id: Id
    gpus: int = Field(ge=0, le=1_000_000)
    limit_w: int = Field(ge=0, le=100_000)
    expected_w: float = Field(ge=0, le=MAX_CAP_W)
    """The job's expected draw at that limit, all its GPUs in the group."""
    slowdown: float | None = Field(default=None, ge=0, le=MAX_SLOWDOWN)
    """Expected time per step / time at its own optimum - 1 (None: the job has no profile
    yet and is capped proportionally)."""


class BudgetStatus(Message):
    """A governing budget as the replica applying it plans it, published every round.

    `<p>.budget.<id>.status`, for `zeus-coordinator watch` and people: the cap, the room the
    allocation had (the cap less what other budgets' GPUs may draw and the tightener's
    backoff), the group's measured and expected draw, and each job's share.
    """

    budget_id: BudgetId
    replica: Name
    cap_w: float = Field(ge=0, le=MAX_CAP_W)
    room_w: float = Field(ge=0, le=MAX_CAP_W)
    measured_w: float | None = Field(default=None, ge=0, le=MAX_CAP_W)
    """The group's draw in its GPUs' last samples (None: one has not been sampled)."""
    expected_w: float = Field(ge=0, le=MAX_CAP_W)
    floor_w: float = Field(ge=0, le=MAX_CAP_W)
    gpus: int = Field(ge=0, le=1_000_000)
    idle_gpus: int = Field(default=0, ge=0, le=1_000_000)
    shares: list[BudgetShare] = Field(default=[], max_length=MAX_SHARES)


class MeasuredOption(_Part):
    """One option of a Perseus job as it ran under a budget (`coordinator.budget.timing`)."""

    key: int = Field(ge=-MAX_POWER_W, le=MAX_FRONTIER_INDEX)
    """A frontier point's index, or minus a throttled option's cap (W)."""
    relative_time: float = Field(ge=MEASURED_RANGE[0], le=MEASURED_RANGE[1])
    """Its step time over the job's at its own point."""
    power_w: float | None = Field(default=None, gt=0, le=MAX_POWER_W)
    """Its draw per GPU (W); None: no energy measured."""


class BudgetTiming(Message, AddedFields):
    """What the budgets' owner measured of one Perseus job's options, kept for its successor.

    Not a subject's payload: the value of `budget_timing.<h>` in the coordinator's state
    bucket (`coordinator.budget.store.TimingStore`), written by the replica applying the
    budgets and read by the one that takes them over, which counts the job's options at
    these measures instead of measuring them again. `frontier` names the frontier they were
    measured on (`coordinator.budget.timing.frontier_digest`): a job that planned another
    frontier has other points under the same keys, and its measures are not used.
    """

    job_id: Id = Field(min_length=1)
    frontier: str = Field(pattern=r"^[0-9a-f]{32}$")
    options: list[MeasuredOption] = Field(default=[], max_length=MAX_MEASURED)
    ADDED: ClassVar[tuple[str, ...]] = ("own_step_s",)
    own_step_s: float | None = Field(default=None, gt=0, le=1e6)
    """The job's step time at its own point the measures are relative to (None: not said):
    a successor that drives the job under a budget has none of its own to measure by."""

    @model_validator(mode="after")
    def _one_per_key(self) -> BudgetTiming:
        if len({o.key for o in self.options}) != len(self.options):
            raise ValueError("an option is measured twice")
        return self


MAX_FRONTIER_POINTS = 2048
"""Most points of a frontier recorded for the budgets' owner (a planner's has hundreds; a
longer one is not recorded and its job is capped proportionally)."""
MAX_STEP_S = 1e6
"""Longest iteration time (s) a recorded frontier may name."""


class ThrottledPoint(_Part):
    """A frontier's slowest point under a lower node cap, as modelled with its profile."""

    cap_w: int = Field(ge=1, le=MAX_POWER_W)
    time_s: float = Field(gt=0, le=MAX_STEP_S)
    power_w: float = Field(ge=0, le=MAX_POWER_W)
    peak_w: float = Field(ge=0, le=MAX_POWER_W)


class BudgetFrontier(Message, AddedFields):
    """A Perseus job's frontier as the replica driving it records it for the budgets' owner.

    Not a subject's payload: the value of `budget_frontier.<h>` in the coordinator's state
    bucket, which every replica follows. The replica applying the budgets counts the job's
    frontier points as its options although another replica drives it
    (`coordinator.budget.frontier_options.FrontierView`: per point its planned time, its
    average and its highest instruction power per GPU, uncalibrated; the point it chose).
    """

    ADDED: ClassVar[tuple[str, ...]] = ("planned_capped",)

    job_id: Id = Field(min_length=1)
    times: list[float] = Field(min_length=1, max_length=MAX_FRONTIER_POINTS)
    powers: list[float] = Field(max_length=MAX_FRONTIER_POINTS)
    peaks: list[float | None] = Field(max_length=MAX_FRONTIER_POINTS)
    chosen: int = Field(ge=0)
    throttled: list[ThrottledPoint] = Field(default=[], max_length=MAX_MEASURED)
    own_draw_w: float | None = Field(default=None, gt=0, le=MAX_POWER_W)
    """The job's draw per GPU at its own point, from its ranks' step energies while nothing
    held it (None: not measured yet): what the owner calibrates the frontier's powers by."""
    planned_capped: bool = False
    """The frontier was planned from a profile a budget's caps throttled
    (`coordinator.budget.capped_profiles`): the budgets cap the job proportionally instead of
    planning on it. Sent only when true (a record without it, older, reads as false; a replica
    that predates it refuses such a record, so it caps the job proportionally too)."""

    @model_validator(mode="after")
    def _consistent(self) -> BudgetFrontier:
        n = len(self.times)
        if len(self.powers) != n or len(self.peaks) != n:
            raise ValueError("times, powers and peaks must have one value per point")
        if self.chosen >= n:
            raise ValueError(f"chosen point {self.chosen} is not one of the {n} points")
        if not all(0 < t <= MAX_STEP_S for t in self.times) or not all(
                0 <= w <= MAX_POWER_W for w in self.powers) or not all(
                w is None or 0 <= w <= MAX_POWER_W for w in self.peaks):
            raise ValueError(f"a time out of (0, {MAX_STEP_S:g}] s or a power out of "
                             f"[0, {MAX_POWER_W}] W")
        return self


class BudgetPoint(Message):
    """The frontier point the budgets' owner gives a Perseus job another replica drives.

    The value of `budget_point.<h>` in the state bucket: the replica driving the job serves it
    (`coordinator.budget.frontier_options.pick`) while a budget governs the job's GPUs; none:
    the job's own plan. `index`: a frontier point's, or minus a throttled option's cap (W).
    """

    job_id: Id = Field(min_length=1)
    index: int = Field(ge=-MAX_POWER_W, le=MAX_FRONTIER_INDEX)
    power_w: float = Field(gt=0, le=MAX_POWER_W)
    """The point's planned power per GPU (W)."""
