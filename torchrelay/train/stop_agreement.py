"""When the ranks all-reduce a stop request, and what they agreed. Pure: time is an argument.

SIGTERM reaches each rank at a slightly different moment, so the ranks agree before acting on it
(``train.preempt``). A tiny all-reduce per step would cost a fast training step a few percent, so
they reduce only every N calls, where N (about ``REDUCE_EVERY_S`` of calls, 1..``MAX_PERIOD``) is
itself agreed in each reduction. When the loop calls ``checkpoint_due`` the reductions happen
there, so the step where the ranks agree to stop is also the step whose checkpoint they commit;
``should_stop`` then just reads the agreed answer.

Every rank makes the same calls and applies the same agreed numbers, so a ``StopAgreement``
evolves identically on every rank. Imports nothing from ``torchrelay``.
"""
from __future__ import annotations

from dataclasses import dataclass

REDUCE_EVERY_S = 0.5  # aim: one all-reduce per half second of training, whatever the step time
MAX_PERIOD = 100  # calls between two reductions at most


@dataclass(kw_only=True, slots=True)
class StopAgreement:
    """The agreement's state on one rank; ``agreed`` is sticky once True."""

    agreed: bool = False  # every rank has agreed that a stop was requested
    calls: int = 0  # counted calls so far
    next_reduce: int = 1  # the call that all-reduces next
    checkpoint_due_seen: bool = False  # the loop asks checkpoint_due: the reductions happen there
    last_call_at: float | None = None
    call_interval_s: float | None = None  # smoothed time between calls on this rank

    def record_call(self, *, from_checkpoint_due: bool, now: float) -> bool:
        """Count one call made at ``now`` (monotonic seconds); returns whether it must all-reduce.

        A ``should_stop`` call is not counted once the loop is seen to call ``checkpoint_due``."""
        if from_checkpoint_due:
            self.checkpoint_due_seen = True
        elif self.checkpoint_due_seen:
            return False
        self.calls += 1
        if self.last_call_at is not None:
            gap = now - self.last_call_at
            self.call_interval_s = gap if self.call_interval_s is None else 0.8 * self.call_interval_s + 0.2 * gap
        self.last_call_at = now
        return self.calls >= self.next_reduce

    def proposed_period(self) -> int:
        """The calls until the next reduction that this rank proposes (the ranks take the largest)."""
        if not self.call_interval_s:
            return 1
        return max(1, min(MAX_PERIOD, int(REDUCE_EVERY_S / self.call_interval_s)))

    def apply(self, *, any_rank_stops: bool, agreed_period: int) -> bool:
        """Take the reduction's result; returns the agreed answer."""
        self.agreed = any_rank_stops
        self.next_reduce = self.calls + agreed_period
        return self.agreed
