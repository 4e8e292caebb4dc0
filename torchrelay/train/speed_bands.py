"""Whether a rank's speed really changed, judged against that rank's own window-to-window spread.
Pure: no torch.distributed, no clock, no I/O.

Balanced data parallel re-measures every rank's samples/s every K steps. On a shared machine
one rank's windows may wobble by ±3 % and another's by ±20 %: a fixed threshold on the predicted
gain cannot tell a real change of a steady rank from the noise of a jittery one. ``SpeedBands``
keeps, per rank, its windows since the shares last changed, and calls a window *out of band*
when it differs from their mean by more than ``sigmas`` × their standard deviation and by more
than ``floor`` of the mean (so a very steady rank's small moves do not count).

Contract:
- ``observe(speeds) -> bool``: record one window of every rank. True when some rank has now been
  out of its band two windows in a row, the same way (faster both times, or slower both times):
  a change that persists, not one window's noise; or one window out by more than ``jump`` (3)
  times the band's width: a leap, such as a worker whose CPU limit went from 0.5 to 1 cpu (its
  next window 60-90 % faster, measured, against a band of ±10 %), which neither noise nor a
  core's slow phase (about 1.4× slower, so a window up to 29 % slower: bench/core_phases.py)
  comes near. A rank's band restarts from two windows out of it in a row, the same way (its new
  level; a leap's window may hold the change only in part, so it alone does not). Windows in band
  join the rank's history (the last ``keep``); windows out of band do not. A rank needs
  ``min_windows`` in its history before it can be out of band.
- ``steady_speeds()``: every rank's mean speed over the windows in its band, or None while a
  rank has fewer than ``min_windows`` of them: a longer, steadier measurement than one window,
  for the balancer's fine adjustment (shares.fine_resplit).
- ``reset()``: forget all histories (call it when the shares change: a rank's samples/s depends
  on its batch size, so windows at other shares are not comparable; the balancer's fine move,
  a sample or two, is the exception).
- Deterministic: the same windows give the same answers. Not saved with a checkpoint: a resumed
  job may run on other nodes, whose speeds the old windows do not describe.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["SpeedBands"]


@dataclass(slots=True)
class SpeedBands:
    """Per-rank bands of measured speed (see the module docstring)."""

    floor: float
    sigmas: float = 4.0
    min_windows: int = 3
    keep: int = 8
    jump: float = 3.0
    _history: list[list[float]] = field(default_factory=list)
    _streak: list[list[float]] = field(default_factory=list)  # consecutive out-of-band windows, one direction

    def reset(self) -> None:
        """Forget every rank's windows. Idempotent."""
        self._history, self._streak = [], []

    def steady_speeds(self) -> tuple[float, ...] | None:
        """Each rank's mean over its in-band windows; None unless every rank has ``min_windows``."""
        if not self._history or any(len(h) < self.min_windows for h in self._history):
            return None
        return tuple(statistics.fmean(h) for h in self._history)

    def _offset(self, rank: int, speed: float) -> float:
        """How far ``speed`` is from the rank's band, in band widths: above 1 (or below -1) is out
        of it, faster (slower); 0 with too few windows to tell."""
        history = self._history[rank]
        if len(history) < self.min_windows:
            return 0.0
        mean = statistics.fmean(history)
        width = max(self.sigmas * statistics.stdev(history), self.floor * mean)
        return (speed - mean) / width

    def _side(self, rank: int, speed: float) -> int:
        """+1 above the rank's band, -1 below, 0 inside (or too few windows to tell)."""
        return _side_of(self._offset(rank, speed))

    def observe(self, speeds: Sequence[float]) -> bool:
        """Record one window (samples/s of every rank); True when a rank's speed changed for good.
        Raises ``ValueError`` when the number of ranks differs from the windows before."""
        if not self._history:
            self._history = [[] for _ in speeds]
            self._streak = [[] for _ in speeds]
        if len(speeds) != len(self._history):
            raise ValueError(f"{len(speeds)} speeds but {len(self._history)} ranks observed before; "
                             "give one speed per rank, or reset() when the world changes")
        changed = False
        for rank, speed in enumerate(speeds):
            if not math.isfinite(speed) or speed <= 0:  # no measurement this window: nothing to judge
                continue
            offset, streak = self._offset(rank, speed), self._streak[rank]
            side = _side_of(offset)
            if side == 0:
                streak.clear()
                self._history[rank] = [*self._history[rank], speed][-self.keep:]
                continue
            if streak and self._side(rank, streak[-1]) != side:
                streak.clear()
            streak.append(speed)
            # a leap counts at once; the band waits for a second window (a leap's window may hold
            # the change only in part: the new level is the next one's)
            changed = changed or abs(offset) > self.jump
            if len(streak) >= 2:
                changed = True
                self._history[rank] = list(streak)
                streak.clear()
        return changed


def _side_of(offset: float) -> int:
    """+1 for an offset (in band widths) above the band, -1 below, 0 inside."""
    return 0 if abs(offset) <= 1 else 1 if offset > 0 else -1
