"""`RaiseAhead`: when to raise a schedule's clock so that it is in before its instruction begins.

In a Perseus plan a clock *raise* that lands late slows the instruction (it runs at the lower
clock until the change is in), while a late *lowering* only costs a little energy. A change
issued on the trainer's `instruction_begin` lands a reaction time later (the event's trip, the
GPU's thread, the setter's own cost: about 1-2 ms on the `h200` model, more behind a counter
read). So the agent issues a raise a lead *before* the instruction is forecast to begin and
lowers only on the event.

* Forecast: a rank repeats the same iteration, so the time from the instruction at schedule
  position `i` to the next `instruction_begin` is what it was in the last iterations; the
  shortest of the last `GAPS_KEPT` is used (a forecast that comes early costs a little energy,
  one that comes late is caught by the event, as without this).
* Lead: a high quantile (`quantile`) of the agent's own event -> applied latencies, plus
  `slack_ns` for the loop timer's granularity (1 ms on uvloop) and wake-up, plus the same
  quantile of how much earlier than forecast the last `EARLY_KEPT` instructions began (a
  trainer whose gaps jitter by a millisecond needs a millisecond more), clamped to
  `[min_lead_ns, max_lead_ns]`; `max_lead_ns` until `MIN_SAMPLES` latencies are known.

Pure: positions and times in (monotonic ns, as the trainer stamps its events), instants out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

__all__ = ["EARLY_KEPT", "GAPS_KEPT", "MIN_SAMPLES", "RaiseAhead"]

GAPS_KEPT = 3
"""Gaps remembered per schedule position (the forecast takes the shortest)."""
MIN_SAMPLES = 8
"""Latencies needed before the lead is calibrated from them."""
EARLY_KEPT = 256
"""Instructions whose earliness against their forecast is remembered (for the lead)."""
MAX_POSITIONS = 4096
"""Schedule positions forecast at most (a longer schedule is raised ahead in part)."""


class RaiseAhead:
    """Forecasts the next instruction's begin and says when to issue its raise."""

    def __init__(
        self,
        min_lead_ns: int = 1_000_000,
        max_lead_ns: int = 10_000_000,
        quantile: float = 0.99,
        slack_ns: int = 1_000_000,
    ) -> None:
        """Create a forecast with nothing seen yet (nothing is raised ahead until one gap is).

        Args:
            min_lead_ns: Shortest lead, whatever the latencies say.
            max_lead_ns: Longest lead (and the lead before calibration).
            quantile: Quantile of the event -> applied latencies the lead covers.
            slack_ns: Added to that quantile: the timer's granularity and wake-up.
        """
        if not 0 < min_lead_ns <= max_lead_ns or not 0 < quantile <= 1 or slack_ns < 0:
            raise ValueError("RaiseAhead needs 0 < min_lead <= max_lead, 0 < quantile <= 1")
        self.min_lead_ns = min_lead_ns
        self.max_lead_ns = max_lead_ns
        self.quantile = quantile
        self.slack_ns = slack_ns
        self.lead_ns = max_lead_ns
        """How long before the forecast instant a raise is issued (`calibrate` sets it)."""
        self._gaps: dict[int, deque[int]] = {}
        self._prev: tuple[int, int] | None = None
        self._early: deque[int] = deque(maxlen=EARLY_KEPT)
        """How much earlier than forecast recent instructions began (ns; 0: on time or late)."""

    def clear(self) -> None:
        """Forget the forecast (another schedule: other positions). The lead is kept."""
        self._gaps = {}
        self._prev = None

    def calibrate(self, latencies_ns: Sequence[int]) -> int:
        """Set the lead from recent event -> applied latencies (ns); returns it."""
        if len(latencies_ns) < MIN_SAMPLES:
            self.lead_ns = self.max_lead_ns
        else:
            lead = self._quantile(latencies_ns) + self.slack_ns + self._quantile(self._early)
            self.lead_ns = max(self.min_lead_ns, min(self.max_lead_ns, lead))
        return self.lead_ns

    def _quantile(self, values: Sequence[int]) -> int:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))] if ordered else 0

    def on_instruction(self, position: int, t_ns: int) -> None:
        """The instruction at schedule `position` began at `t_ns` (the trainer's stamp).

        The time since the previous instruction began is remembered as that one's gap.
        """
        prev = self._prev
        if prev is not None and t_ns > prev[1] and 0 <= prev[0] < MAX_POSITIONS:
            gaps = self._gaps.get(prev[0])
            if gaps:  # This instruction had a forecast: how early did it come?
                self._early.append(max(0, prev[1] + min(gaps) - t_ns))
            if gaps is None:
                gaps = self._gaps[prev[0]] = deque(maxlen=GAPS_KEPT)
            gaps.append(t_ns - prev[1])
        self._prev = (position, t_ns)

    def forecast(self, position: int, t_ns: int) -> int | None:
        """When the instruction after the one at `position` (begun at `t_ns`) will begin."""
        gaps = self._gaps.get(position)
        return t_ns + min(gaps) if gaps else None

    def raise_at(self, position: int, t_ns: int) -> int | None:
        """When to issue the raise for the instruction after `position`; None: no forecast."""
        forecast = self.forecast(position, t_ns)
        return None if forecast is None else forecast - self.lead_ns
