"""`PowerLimitJob`: one data-parallel job's power-limit optimisation across ranks (sans-I/O).

It wraps a `PowerLimitStateMachine` and turns windows over the job's GPUs into measurements:

* rank 0's trainer events pace the machine (`step_begin` -> `on_step_begin`, `epoch_end` ->
  `on_epoch_end`); the other ranks step together with it;
* a window opened at rank 0's step `a` and closed at its step `b` covers, on every rank, the
  interval between that rank's own `step_begin` marks of steps `a` and `b` (identified by the
  (epoch, step) counters); the marks come on their own stream, after the events, and
  `WindowJoin` (`coordinator.power_limit.window_join`) joins them with the windows: a window's
  time is the maximum over ranks, its energy the sum over the job's GPUs, measured once every
  rank's two marks have arrived, in whatever order the ranks' marks and the events interleave.
  Why a step's boundary travels twice (an event at once, a mark once the counter was read):
  docs/concepts/architecture.md, "Why a step boundary travels twice";
* steps are counted by the ranks' own step counters, not by delivered events: a duplicate or
  stale event is ignored, steps whose events were lost (a broker restart) are still counted,
  and an epoch whose end event was lost still ends (the next step's epoch counter says so);
  a count that jumps far ahead or goes back (a trainer restarted, a bogus counter) is
  re-anchored: the open window is redone (the join drops marks of a rank's old count);
  a window that does not cover exactly its intended steps is normalised to them;
* a closed window whose marks can never come is redone at rank 0's next step: an agent sends
  its GPU's marks in step order over one connection, so a rank's mark missing behind a later
  mark of that rank was lost (its agent restarted, the bus was down, no energy reading); only
  when nothing proves the loss, a window whose marks have not all arrived `mark_timeout_s`
  after it closed is redone (`tick`). Meanwhile nothing is measured and the machine keeps the
  GPUs at the maximum limit (`PowerLimitStateMachine`);
* a window whose closing marks say the GPU ran at another limit is redone: after a broker
  outage, agents deliver their buffered events late and at once, and the machine would
  otherwise close windows for steps that all ran at an earlier limit (marks carry the limit);
* a window shorter than a few periods of the GPUs' energy counters makes `profile_steps` a
  minimum: windows are lengthened, short ones redone, said (`power_limit.window_length`);
* when nothing can be measured (every window unusable), the optimiser gives up: the GPUs go
  back to the maximum limit and the status says why (`gave_up`);
* one input sends at most one power-limit command, the limit it ends at: a step count that
  jumps (lost steps replayed) or a batch of late events (`on_events`) can move the machine
  through several windows at once, all already past, and a command for them would only hold the
  GPUs at limits nobody measures (`coordinator.power_limit.commands`). A window opened on a
  replayed step has its first marks checked: its limit was commanded after that step at best.

It implements `coordinator.optimizer.JobOptimizer`: methods return `Action`s for the shell:
`ApplyPowerLimit` (command every GPU of the job), `SaveProfile` (profiling finished),
`SaveProgress` (after each measured window: what a replica taking the job over resumes from) and
`StatusUpdate` (for people and dashboards).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from coordinator.optimizer import (
    Action,
    ApplyPowerLimit,
    JobSnapshot,
    SaveProfile,
    SaveProgress,
    StatusUpdate,
)
from coordinator.power_limit.capped import cap_message
from coordinator.power_limit.commands import latest_limit_only
from coordinator.power_limit.job_parts import (
    NotAPipeline,
    gave_up_message,
    give_up_reason,
    machine_for,
    progress_of,
    snapshot_of,
)
from coordinator.power_limit.machine import (
    BeginWindow,
    Done,
    Effect,
    EndWindow,
    PowerLimitError,
    Profiling,
    Ready,
    SetPowerLimit,
    Warmup,
)
from coordinator.power_limit.search import WindowResult
from coordinator.power_limit.trainer_choice import TrainerChoice
from coordinator.power_limit.window_join import MAX_LATE_STEPS, RESTART_RUN, StepKey, WindowJoin
from coordinator.power_limit.window_length import Verdict, WindowLength
from zeus_agent.models import PowerLimitMeasurement
from zeus_agent.wire.event_columns import EventLike
from zeus_agent.wire.messages import PowerLimitOptions
from zeus_agent.wire.node_columns import MarkLike

MAX_REPLAYED_STEPS = 1_000
"""Most lost steps replayed into the machine at once: a longer jump ahead re-anchors the count."""
DEFAULT_MARK_TIMEOUT_S = 10.0
"""Last resort: later marks prove most losses at the next step."""


class PowerLimitJob(NotAPipeline):
    """The power-limit optimiser of one job over all of its ranks.

    Args:
        job_id: The job.
        options: Selector and step counts.
        ranks: The job's ranks (each drives one GPU).
        min_power_limit_w: Highest minimum limit over the job's GPUs.
        max_power_limit_w: Lowest maximum limit over the job's GPUs.
        measurements: A loaded profile (then the job starts done at its optimum).
        resume: Windows measured before a coordinator restart (a list), or `persisted()` of
            the job's previous owner.
        mark_timeout_s: How long a closed window waits for marks that nothing proved lost
            before it is redone.
        chosen: With a user's own selector ("Custom"): the limit it chose before a takeover.
        energy_period_s: The longest energy-counter period of the job's GPUs (s), as their
            agents announced it (None: not known; 0: continuous): windows must span several.

    Raises:
        ValueError, TypeError, KeyError: `resume` is not readable.
    """

    kind = "power_limit"
    """Its progress goes under `power_limit` in a query's reply."""

    def __init__(
        self, job_id: str, options: PowerLimitOptions, ranks: Iterable[int],
        min_power_limit_w: int, max_power_limit_w: int,
        measurements: list[PowerLimitMeasurement] | None = None,
        resume: Sequence[WindowResult] | dict[str, Any] = (),
        mark_timeout_s: float = DEFAULT_MARK_TIMEOUT_S, chosen: int | None = None,
        energy_period_s: float | None = None,
    ) -> None:
        self.job_id = job_id
        self.options = options
        self.ranks = sorted(ranks)
        world_size = len(self.ranks)
        self.machine = machine_for(options, world_size, min_power_limit_w, max_power_limit_w,
                                   measurements, resume)
        self._join = WindowJoin(self.ranks, mark_timeout_s)
        self._length = WindowLength(energy_period_s)
        self._saved = measurements is not None
        self.last_step: StepKey | None = None
        self._ended_epoch = -1  # Highest epoch whose end the machine has seen.
        self._stale_steps: list[StepKey] = []  # Late steps of rank 0 skipped in a row.
        self._stale_since: float | None = None  # When the skipping began (coordinator time).
        self._behind: list[StepKey] = []  # Steps of rank 0 behind the last one, in a row.
        self._now_s = 0.0
        self._resend = False  # This input sends the limit again (a command did not land).
        self._replayed = 0  # Lost steps this input replayed (at most MAX_REPLAYED_STEPS).
        self.gave_up: str | None = None
        """Why the optimiser gave up (the GPUs are back at the maximum limit), or None."""
        self.choice = (TrainerChoice.of(options, self.ranks[0], world_size, chosen)
                       if options.selector == "Custom" else None)
        """Where a user's own selector's choice stands (None: a built-in selector)."""

    @property
    def mark_timeout_s(self) -> float:
        """How long a closed window waits for marks (and late steps are skipped), in s."""
        return self._join.mark_timeout_s

    @property
    def done(self) -> bool:
        """Whether the optimal limit is known (or the optimiser gave up)."""
        return self.profiled and (self.choice is None or self.choice.chosen is not None
                                  or self.gave_up is not None)

    @property
    def profiled(self) -> bool:
        """Whether profiling is over (a user's own selector may still be choosing)."""
        return isinstance(self.machine.state, Done) or self.gave_up is not None

    @property
    def optimal_power_limit(self) -> int | None:
        """The chosen limit (W), None until known (while rank 0 chooses, too)."""
        return self.machine.optimal_power_limit if self.done and self.gave_up is None else None

    @property
    def desired_power_limit(self) -> int | None:
        """The limit every GPU of the job should be at now (W), None before `start()`."""
        if self.gave_up is not None:
            return self.machine.max_power_limit
        return self.machine.current_power_limit

    def start(self) -> list[Action]:
        """Start the machine (when every rank is registered)."""
        actions = self._translate(self.machine.start(), step=None)
        if self.choice is not None and self.profiled:
            return actions + self._choose_again()
        limit = self.machine.optimal_power_limit
        resumed = len(self.machine.window_results)
        if self.done and self._saved:
            actions.append(StatusUpdate("done", f"loaded profile: optimal power limit {limit} W",
                                        self.progress()))
        elif self.done:
            assert limit is not None
            self._saved = True
            actions.append(SaveProfile(tuple(self.machine.measurements), limit))
            actions.append(StatusUpdate(
                "done", f"every limit was measured before a restart: optimal power limit {limit} W",
                self.progress(),
            ))
        else:
            again = f", resuming after {resumed} measured window(s)" if resumed else ""
            minimum = self._length.describe()
            actions.append(StatusUpdate(
                "profiling",
                f"profiling {len(self.machine.power_limits)} power limits "
                f"({self.machine.power_limits[0]}..{self.machine.power_limits[-1]} W, "
                f"{self.options.search} search{again}{', ' if minimum else ''}{minimum})",
                self.progress(),
            ))
        return actions

    def on_event(self, rank: int, event: EventLike, now_s: float | None = None) -> list[Action]:
        """Feed a trainer event of `rank` (`_feed_event`); `SaveProgress` after a window."""
        return self._input(lambda: self._feed_event(rank, event, now_s))

    def on_events(
        self, rank: int, events: Iterable[EventLike], now_s: float | None = None
    ) -> list[Action]:
        """Feed a batch of `rank`'s trainer events, oldest first, as one input.

        As `on_event` for each, but the batch sends at most one power-limit command: the limit
        its last event leaves the machine at. A batch delivered late (after a broker outage) may
        close several windows on steps long past; commands for them would come too late for
        their steps anyway (those steps' marks show the limit they really ran at, and such
        windows are profiled again).
        """
        return self._input(lambda: [a for e in events for a in self._feed_event(rank, e, now_s)])

    def tick(self, now_s: float) -> list[Action]:
        """Let time pass: redo closed windows whose marks are overdue."""
        return self._input(lambda: self._tick(now_s))

    def set_cap(self, cap_w: int | None) -> list[Action]:
        """A budget's cap on the job's GPUs (None: lifted): until profiled, profile under it."""
        if cap_w == self.machine.cap_w or self.profiled:
            return []
        return self._input(lambda: self._capped(cap_w))

    def _capped(self, cap_w: int | None) -> list[Action]:
        effects = self.machine.cap(cap_w)
        for name in [e.name for e in effects if isinstance(e, EndWindow)]:  # (Said below.)
            self._join.drop(name)
        return [*self._translate(effects, step=self.last_step),
                StatusUpdate("profiling", cap_message(self.machine), self.progress())]

    def on_mark(self, rank: int, mark: MarkLike) -> list[Action]:
        """Feed a GPU mark of `rank`; may complete windows (then `SaveProgress`)."""
        return self._input(lambda: self._feed_mark(rank, mark))

    def _input(self, feed: Callable[[], list[Action]]) -> list[Action]:
        """One input: at most one power-limit command (`latest_limit_only`), its progress kept.

        The progress is recorded when a window was measured: it survives a takeover.
        """
        windows, limit = len(self.machine.window_results), self.desired_power_limit
        self._resend = False
        self._replayed = 0
        actions = latest_limit_only(feed(), limit, resend=self._resend)
        if len(self.machine.window_results) > windows:
            state = self.persisted()
            if state is not None:
                actions.append(SaveProgress("windows", state))
        return actions

    def _feed_event(self, rank: int, event: EventLike, now_s: float | None = None) -> list[Action]:
        """Feed a trainer event of `rank`; only rank 0 paces the machine.

        Steps are counted by the event's (epoch, step) counters: a step at or a little before
        the last one seen is ignored (a duplicate or a late event); within an epoch, steps
        skipped since the last one are replayed (a trainer may restart its step count each
        epoch, so nothing is replayed across epochs). A count that jumps more than
        `MAX_REPLAYED_STEPS` ahead, or goes back (more than `MAX_LATE_STEPS` in its epoch, or
        `RESTART_RUN` ascending steps in a row) is re-anchored there: the open window is
        redone from the next step, the GPUs at the maximum limit meanwhile.
        """
        if now_s is not None:
            self._now_s = now_s
        if event.kind == "selection":
            return self._on_selection(rank, event)
        if rank != self.ranks[0] or self.profiled:
            return []
        if event.kind == "epoch_end":
            if event.epoch <= self._ended_epoch:
                return []  # Already ended (a duplicate, or inferred from a later step).
            self._ended_epoch = event.epoch
            return self._translate(self.machine.on_epoch_end(), step=None)
        if event.kind != "step_begin":
            return []
        actions: list[Action] = []
        last = self.last_step
        key = (event.epoch, event.step)
        if last is not None and key <= last:
            if not self._restarted(last, key):
                return []  # A duplicate or a late, reordered event.
            return self._reanchor(key, f"went back to step {key[1]} (epoch {key[0]}) from "
                                       f"step {last[1]} (epoch {last[0]})")
        self._behind = []
        if (last is not None and last[0] == event.epoch
                and event.step - last[1] > MAX_REPLAYED_STEPS - self._replayed):
            # (At most MAX_REPLAYED_STEPS lost steps per input, however many events it holds:
            # one batch cannot make the replica replay a million steps.)
            return self._reanchor(key, f"jumped from step {last[1]} to step {key[1]} "
                                       f"(epoch {key[0]})")
        if last is not None and event.epoch > last[0] > self._ended_epoch:
            # The epoch's end event was lost: its steps say it ended.
            self._ended_epoch = last[0]
            actions += self._translate(self.machine.on_epoch_end(), step=None)
        if self._ran_before_its_limit(event):
            # A late event (buffered through a broker outage): its step ran before the limit
            # being warmed up or profiled was set. It counts toward nothing; an open window
            # starts again at the first step that ran at its limit.
            self.last_step = key
            self._stale_steps.append(key)
            return actions
        if self._stale_steps:
            actions += self._restart_open_window(key)
            if self.last_step == key:
                return actions  # The window's first step: its opening was counted already.
        first = event.step
        if last is not None and last[0] == event.epoch:
            first = max(last[1] + 1, event.step - MAX_REPLAYED_STEPS)
        self._replayed += event.step - first
        for step in range(first, event.step + 1):
            if self.profiled:
                break
            self.last_step = (event.epoch, step)
            actions += self._step(self.last_step, live=step == event.step)
        return actions

    def _tick(self, now_s: float) -> list[Action]:
        self._now_s = now_s
        if self.choice is not None and self.choice.overdue(now_s):
            return self._settle(None, f"rank {self.choice.rank}'s process did not answer within "
                                f"{self.choice.timeout_s:g} s")
        if self.profiled:
            return []
        actions: list[Action] = []
        for w in self._join.overdue(now_s):
            self._join.drop(w.name)
            missing = sorted(w.missing)
            actions.append(StatusUpdate(
                "profiling",
                f"window {w.name}: no marks from rank(s) {missing[:8]} within "
                f"{self.mark_timeout_s:g} s (an agent restarted?); profiling that limit again",
                self.progress(),
            ))
            actions += self._machine(self.machine.redo, w.name, self.last_step)[0]
        return actions

    def _feed_mark(self, rank: int, mark: MarkLike) -> list[Action]:
        """The join takes the mark; windows it completed are measured."""
        return self._complete_windows() if self._join.add_mark(rank, mark) else []

    def on_agent_error(self, rank: int, code: str, message: str, now_s: float) -> list[Action]:
        """A rank's trainer died (`trainer_gone`) before profiling was over: stop and say why.

        Its agent restored its GPU; the others go back to the maximum limit (a data-parallel
        job cannot go on without a rank: `torchrun` tears the group down). Other error events
        do not change the plan: marks and timeouts do.
        """
        if code != "trainer_gone" or self.profiled or rank not in self.ranks:
            return []
        self.gave_up = f"rank {rank}'s trainer is gone"
        self._join.clear()
        limit = self.machine.max_power_limit
        return [
            ApplyPowerLimit(limit),
            StatusUpdate(
                "stopped",
                f"rank {rank} is gone while profiling ({message[:200]}): profiling stopped, "
                f"GPUs restored to the maximum limit {limit} W; register the job again to "
                "profile it",
                self.progress(),
            ),
        ]

    def persisted(self) -> dict[str, Any] | None:
        """While profiling, what a replica taking the job over resumes from.

        The windows measured so far, how far the search got and what is to be profiled again
        (`PowerLimitStateMachine.resume_state`).
        """
        if self.done:
            return None
        state = self.machine.resume_state()
        return state if state["windows"] or state["redo"] or state["completed"] else None

    def snapshot(self) -> JobSnapshot:
        """Its phase, limits and the saving its profile measured (for dashboards)."""
        phase = "gave_up" if self.gave_up is not None else self._phase().lower()
        return snapshot_of(self.machine, self.job_id, self.kind, phase,
                           self.optimal_power_limit, self.desired_power_limit)

    def waiting_for(self) -> dict[str, list[int]]:
        """Closed windows still missing marks: window name -> ranks."""
        return self._join.waiting_for()

    def progress(self) -> dict[str, Any]:
        """A snapshot for status events and queries."""
        return progress_of(self.machine, self._phase(), self.optimal_power_limit, self.gave_up)

    def _phase(self) -> str:
        """The machine's state, or "Selecting" while a user's own selector chooses."""
        if self.choice is not None and self.choice.waiting:
            return "Selecting"
        return type(self.machine.state).__name__

    # ------------------------------------------------------------------ internals
    def _step(self, key: StepKey, live: bool) -> list[Action]:
        """One step of rank 0: windows proved lost are redone at its boundary, else it paces.

        Only at a step whose event came (`live`): the marks of replayed steps, whose events
        were lost, were most likely lost too, and a redo there would be lost again. A redo
        that starts the machine again (it was waiting for records) takes the step, as a
        closing step takes the next limit's first warm-up step.
        """
        lost = self._join.lost() if live else []
        if not lost:
            return self._translate(self.machine.on_step_begin(), step=key, live=live)
        waiting = self._waiting()
        actions: list[Action] = []
        for w in lost:
            self._join.drop(w.name)
            actions.append(StatusUpdate(
                "profiling",
                f"window {w.name}: marks of rank(s) {sorted(w.lost)[:8]} were lost (later ones "
                f"came: an agent restarted, or the bus was down); profiling that limit again "
                f"from step {key[1]}",
                self.progress(),
            ))
            done, ok = self._machine(self.machine.redo, w.name, key)
            actions += done
            if not ok:
                return actions
        if self.profiled or (waiting and not self._waiting()):
            return actions
        return actions + self._translate(self.machine.on_step_begin(), step=key)

    def _waiting(self) -> bool:
        """Whether the machine waits for records (nothing is measured)."""
        state = self.machine.state
        return isinstance(state, Ready) and state.next_power_limit is None

    def _ran_before_its_limit(self, event: EventLike) -> bool:
        """Whether a step of rank 0 began before the limit being warmed up or profiled was set.

        Its agent says which limit the GPU had when the step began. Such steps are skipped for
        at most `mark_timeout_s` (coordinator time) in a row: a backlog comes at once, while a
        GPU that really stays at another limit must not stall the search (its windows are then
        redone by the marks' check).
        """
        want = self.machine.current_power_limit
        if (event.power_limit_w is None or want is None or event.power_limit_w == want
                or not isinstance(self.machine.state, Warmup | Profiling)):
            self._stale_since = None
            return False
        if self._stale_since is None:
            self._stale_since = self._now_s
        return self._now_s - self._stale_since < self.mark_timeout_s

    def _restarted(self, last: StepKey, key: StepKey) -> bool:
        """Whether rank 0's step `key`, at or behind the last one, restarts its step count.

        A duplicate or a step a little behind in the same epoch is a late event (ignored);
        one far behind, or `RESTART_RUN` ascending steps in a row behind the last, say the
        count restarted (a trainer started again, or the last step was bogus).
        """
        if key == last:
            return False
        if key[0] == last[0] and last[1] - key[1] > MAX_LATE_STEPS:
            return True
        if self._behind and key <= self._behind[-1]:
            self._behind = []
        self._behind.append(key)
        return len(self._behind) >= RESTART_RUN

    def _reanchor(self, key: StepKey, what: str) -> list[Action]:
        """Rank 0's step count restarted or jumped: count on from step `key`.

        No step is replayed across the jump: the open window (if any) is abandoned and its
        limit warmed up and profiled again from the next step, the GPUs at the maximum limit
        meanwhile (as after an epoch end).
        """
        self.last_step = key
        self._behind, self._stale_steps, self._stale_since = [], [], None
        actions: list[Action] = [StatusUpdate(
            "profiling",
            f"rank {self.ranks[0]}'s step count {what} (a trainer restart, or a bogus step): "
            "counting from there; a limit being measured is profiled again",
            self.progress(),
        )]
        actions += self._translate(self.machine.on_epoch_end(), step=None)
        return actions

    def _restart_open_window(self, key: StepKey) -> list[Action]:
        """After skipped late steps: the open window (if any) begins at step `key` instead."""
        skipped, self._stale_steps = self._stale_steps, []
        window = self._join.restart_open(key)
        if window is None:
            return []
        self.last_step = key
        return [StatusUpdate(
            "profiling",
            f"steps {skipped[0][1]}..{skipped[-1][1]} (epoch {skipped[0][0]}) ran before "
            f"{window.power_limit} W was set (events delivered late, e.g. after a broker "
            f"outage): window {window.name} starts at step {key[1]} instead",
            self.progress(),
        )]

    def _translate(self, effects: list[Any], step: StepKey | None,
                   live: bool = True) -> list[Action]:
        """The machine's effects at rank 0's step `step` as actions.

        `live`: whether `step` is the one whose event came; a replayed step is past, so a limit
        set there reaches the GPUs later (`_input` sends only the input's last limit) and a
        window opened there has its first marks checked.
        """
        actions: list[Action] = []
        set_now = False  # a limit set on this very step: its begin mark may predate it
        for effect in effects:
            if isinstance(effect, SetPowerLimit):
                actions.append(ApplyPowerLimit(effect.watts))
                set_now = True
            elif isinstance(effect, BeginWindow):
                assert step is not None, "windows open on step_begin"
                state = self.machine.state
                steps = state.profile_steps if isinstance(state, Profiling) else 0
                self._join.open(effect.name, begin_step=step, steps=steps,
                                power_limit=self.machine.current_power_limit,
                                check_begin=not (set_now and live))
                limit = self.machine.current_power_limit
                actions.append(StatusUpdate(
                    "profiling",
                    f"measuring {limit} W from step {step[1]} (epoch {step[0]})",
                    self.progress(),
                ))
            elif isinstance(effect, EndWindow):
                if effect.name not in self._join:
                    continue
                if effect.cancel or step is None:
                    self._join.drop(effect.name)
                    actions.append(StatusUpdate(
                        "profiling",
                        f"window {effect.name} cancelled (epoch ended); it will be redone"
                        f"{self._length.epoch_note(self.options, self.machine.min_window_steps)}",
                        self.progress(),
                    ))
                else:
                    self._join.close(effect.name, step, self._now_s)
        if effects or (self.profiled and not self._saved):
            # Also when the machine finished with no effect (a limit left out, the optimum
            # already set): the profile is saved and the job says it is done.
            actions += self._complete_windows()
        return actions

    def _complete_windows(self) -> list[Action]:
        """Measure the windows whose marks are all in (`WindowJoin.measure`) and record them.

        A window whose marks say its steps ran at another limit is redone; one that measured
        nothing (no time or no energy) is discarded.
        """
        actions: list[Action] = []
        for w in self._join.windows():
            if not w.complete:
                continue
            name = w.name
            m = self._join.measure(w)
            if m.ran_at:
                actions.append(StatusUpdate(
                    "profiling",
                    f"window {name}: its steps ran at {list(m.ran_at)} W, not {m.power_limit} W "
                    "(events delivered late, e.g. after a broker outage); profiling it again",
                    self.progress(),
                ))
                done, ok = self._machine(self.machine.redo, name, self.last_step)
                actions += done
                if not ok:
                    continue
                if self.desired_power_limit is not None and not any(
                        isinstance(a, ApplyPowerLimit) for a in actions):
                    # A command did not land (lost while the broker was away): the machine
                    # sends a limit only when it changes, so send the current one again.
                    actions.append(ApplyPowerLimit(self.desired_power_limit))
                    self._resend = True
                continue
            time_s, energy_j = m.time_s, m.energy_j
            if m.normalised:
                actions.append(StatusUpdate(
                    "profiling",
                    f"window {name} covered {m.covered} steps, not {m.steps}: normalised",
                    self.progress(),
                ))
            if time_s <= 0 or energy_j <= 0:
                actions.append(StatusUpdate(
                    "error",
                    f"window {name} measured {time_s:.3f} s and {energy_j:.1f} J: unusable, its "
                    "limit is left out (windows this short need more profile_steps)",
                    self.progress(),
                ))
                actions += self._machine(self.machine.discard, name, self.last_step)[0]
                continue
            span_s = time_s * m.covered / m.steps if m.normalised else time_s
            verdict = self._length.judge(name, m.steps, m.covered, span_s,
                                         self.machine.min_window_steps)
            if verdict is not None:
                actions += self._too_short(name, verdict)
                if verdict.redo:
                    continue
            effects = self.machine.record(name, time_s, energy_j)
            actions.append(StatusUpdate(
                "profiling",
                f"{name}: {time_s:.3f} s, {energy_j:.1f} J over {len(self.ranks)} GPU(s)",
                self.progress(),
            ))
            actions += self._translate(effects, step=self.last_step)
        if self.profiled and not self._saved and self.gave_up is None:
            if self.choice is not None:
                if self.choice.asked is None:
                    actions += self.choice.ask(self.machine.measurements, self._now_s,
                                               self.progress())
                return actions
            self._saved = True
            optimal = self.machine.optimal_power_limit
            assert optimal is not None
            actions.append(SaveProfile(tuple(self.machine.measurements), optimal))
            actions.append(StatusUpdate("done", f"optimal power limit {optimal} W pinned",
                                        self.progress()))
        return actions

    def _too_short(self, name: str, verdict: Verdict) -> list[Action]:
        """Window `name` lasted less than the minimum: lengthen the windows; redo it if short."""
        self.machine.lengthen(verdict.min_steps)
        state = self.machine.state
        if isinstance(state, Profiling):
            self._join.lengthen_open(state.profile_steps)
        actions: list[Action] = [StatusUpdate("profiling", verdict.message, self.progress())]
        if verdict.redo:
            actions += self._translate(self.machine.redo(name, counted=False), step=self.last_step)
        return actions

    # ------------------------------------------------------------------ a user's own selector
    def selector_unreachable(self, request: int, why: str) -> list[Action]:
        """Rank 0's process cannot be asked (`AskSelector` `request`): the fallback chooses."""
        if self.choice is None or not self.choice.answers(self.choice.rank, request):
            return []
        return self._input(lambda: self._settle(None, why))

    def _choose_again(self) -> list[Action]:
        """At start, profiling over: pin the choice made before a takeover, or ask for it."""
        assert self.choice is not None
        effects, said = self.choice.pin_recorded(self.machine)
        if effects is None:
            notes = [StatusUpdate("selecting", said, self.progress())] if said else []
            return notes + self.choice.ask(self.machine.measurements, self._now_s,
                                           self.progress())
        self._saved = True
        return [*self._translate(effects, step=None),
                StatusUpdate("done", said, self.progress())]

    def _on_selection(self, rank: int, event: EventLike) -> list[Action]:
        """Rank 0's answer: pin its limit, or fall back (it failed, or chose no measured one)."""
        choice = self.choice
        if choice is None or not choice.answers(rank, event.index):
            return []  # (A stale answer, or one nobody asked for.)
        if event.power_limit_w is None:
            return self._settle(None, f"{choice.description} failed in rank {rank}'s process: "
                                f"{event.name or 'no reason given'}")
        return self._settle(event.power_limit_w, "")

    def _settle(self, limit: int | None, why: str) -> list[Action]:
        """Pin `limit` (chosen by rank 0), or the fallback's choice because of `why`."""
        assert self.choice is not None
        effects, how = self.choice.settle(self.machine, limit, why)
        self._saved = True
        chosen = self.machine.optimal_power_limit
        assert chosen is not None
        return [*self._translate(effects, step=None),
                SaveProfile(tuple(self.machine.measurements), chosen, chosen_by_trainer=True),
                StatusUpdate("done", f"optimal power limit {chosen} W pinned, {how}",
                             self.progress())]

    def _machine(self, call: Callable[[str], list[Effect]], window: str,
                 step: StepKey | None) -> tuple[list[Action], bool]:
        """A machine input about `window` (redo, discard): its effects as actions, and True.

        If the machine refuses the input, the optimiser gives up: (its actions, False).
        """
        try:
            effects = call(window)
        except PowerLimitError as e:
            return self._give_up(give_up_reason(e)), False
        return self._translate(effects, step=step), True

    def _give_up(self, why: str) -> list[Action]:
        """Stop optimising: every GPU back to the maximum limit, and say so."""
        if self.gave_up is not None:
            return []
        self.gave_up = why
        self._join.clear()
        limit = self.machine.max_power_limit
        return [ApplyPowerLimit(limit), StatusUpdate("gave_up", gave_up_message(why, limit),
                                                     self.progress())]
