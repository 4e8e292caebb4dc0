"""Balanced data parallel's arithmetic: shares of a global batch, when to re-split, which sample
indices each rank takes. Pure: no torch.distributed, no clock, no I/O.

- ``proportional_shares(weights, total, minimum=1)``: integers in proportion to ``weights``
  that sum to ``total``, each at least ``minimum`` (largest remainders; ties to the lower rank).
- ``step_time(shares, speeds)``: the predicted time of a step, the slowest rank's
  ``share / speed``.
- ``decide_resplit(shares, speeds, threshold, pending, changed)``: the shares in proportion to
  ``speeds`` when they would make a step at least ``2 × threshold`` faster than the current
  ones predict (at once), or at least ``threshold`` faster twice in a row, the same way, or at
  least ``threshold`` faster when a rank's speed left its own band two windows in a row or leapt
  out of it in one (``changed``: speed_bands.py); else none. This is the hysteresis: speeds
  that wobble by less than the threshold never move the shares, a single noisy window cannot
  either (but for a leap), and after a
  re-split the same speeds predict no gain, so the shares cannot flip back and forth between
  two roundings. With ``refining`` (the first comparison after a move made from a window:
  calibration's, or one after a rank changed speed; its window is half as long, ``remeasure_due``)
  half the threshold moves the shares at once, and a quarter of it when the move carries the
  last one on (no rank goes back the way that one moved it), since a move undershoots.
  The window that moved them was measured at the old shares (calibration: a couple of steps at an
  even split), and a rank's samples/s grows with its share, since a step's fixed costs (forward
  and backward overheads, the optimizer's step) spread over more samples. So a move undershoots,
  and a split a few samples off would otherwise stay off for good whenever fixing it gains under
  the threshold (measured: 41 + 23 instead of 43 + 21 after calibration, the fast rank idle 15 %
  of every step; a lifted worker moved from 21 to 26 samples of 64, not about 32, for 80 steps).
  The balancer refines a move once: a refinement is not refined again, so this cannot chain.
- ``fine_resplit(shares, steady_speeds, threshold)``: the shares in proportion to speeds measured
  over several windows in a row (``SpeedBands.steady_speeds``) when they predict a step at least
  a quarter of ``threshold`` faster; else None. The balancer takes at most one such move, and
  only before any rank changed speed: so a split left a sample or two off by calibration
  (measured: 22 + 42 where the solo speeds asked for 21 + 43; the rounding cost 6 % of every
  step) is put right once the speeds have been steady for a while, the fine move can never flip
  back and forth, and settling after a change stays a move and its refinement.
- ``step_split(num_samples, global_batch, step, shares, drop_last)``: the global batch of
  ``step`` of an epoch is ``order[step*B : step*B + B]`` whatever the shares are; rank ``r``
  takes the ``shares[r]`` samples after the first ``sum(shares[:r])``. The last, short batch
  (``T < B`` samples) is split in proportion to the shares; one smaller than the world rides
  with the last full batch instead, so every rank has a sample at every step. So every index
  is seen exactly once per epoch, also when the shares change between two steps, and a
  resumed epoch only needs its step number.
- ``steps_per_epoch(num_samples, global_batch, world, drop_last)``; ``remeasure_due(step,
  every, calibration_steps, last, refining)``: after which optimizer steps the speeds are
  compared (every ``every`` steps; a refinement's window is half as long).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Resplit", "decide_resplit", "fine_resplit", "proportional_shares", "remeasure_due", "step_split",
           "step_time", "steps_per_epoch"]


def proportional_shares(weights: Sequence[float], total: int, minimum: int = 1) -> tuple[int, ...]:
    """Integer shares of ``total`` in proportion to ``weights`` (each >= ``minimum``). Raises
    ``ValueError`` naming the value when no such split exists."""
    count = len(weights)
    if count == 0:
        raise ValueError("weights is empty; give one weight per rank")
    if any(not math.isfinite(w) or w < 0 for w in weights):
        raise ValueError(f"weights {list(weights)} must be finite and >= 0")
    if total < minimum * count:
        raise ValueError(f"total {total} cannot give {count} ranks at least {minimum} each; "
                         f"a global batch of at least {minimum * count} is needed")
    weight_sum = sum(weights)
    ideal = [total * w / weight_sum if weight_sum > 0 else total / count for w in weights]
    shares = [max(minimum, math.floor(x)) for x in ideal]
    # hand out (or take back) one at a time by the largest remainder: Hamilton's method
    while sum(shares) < total:
        best = max(range(count), key=lambda i: (ideal[i] - shares[i], -i))
        shares[best] += 1
    while sum(shares) > total:
        best = max((i for i in range(count) if shares[i] > minimum), key=lambda i: (shares[i] - ideal[i], -i))
        shares[best] -= 1
    return tuple(shares)


def step_time(shares: Sequence[int], speeds: Sequence[float]) -> float:
    """Predicted seconds of a step: the slowest rank's ``share / speed`` (speeds in samples/s)."""
    return max((b / s if s > 0 else math.inf) if b else 0.0 for b, s in zip(shares, speeds))


@dataclass(frozen=True, slots=True)
class Resplit:
    """A comparison's outcome: ``shares`` to use from the next step (None: keep them), and a
    smaller proposal ``pending`` confirmation by the next comparison (None: none)."""

    shares: tuple[int, ...] | None = None
    pending: tuple[int, ...] | None = None


def _same_direction(a: Sequence[int], b: Sequence[int], shares: Sequence[int]) -> bool:
    return all((x > s) == (y > s) and (x < s) == (y < s) for x, y, s in zip(a, b, shares))


def _proportional_proposal(shares: Sequence[int], speeds: Sequence[float]) -> tuple[tuple[int, ...], float] | None:
    """(the split in proportion to ``speeds``, its predicted gain in step time over ``shares``), or
    None when it is ``shares`` itself or a rank has no speed. Raises ``ValueError`` when the lengths differ."""
    if len(shares) != len(speeds):
        raise ValueError(f"{len(shares)} shares but {len(speeds)} speeds; give one speed per rank")
    if any(s <= 0 or not math.isfinite(s) for s in speeds):
        return None
    proposed = proportional_shares(speeds, sum(shares))
    if proposed == tuple(shares):
        return None
    return proposed, 1.0 - step_time(proposed, speeds) / step_time(shares, speeds)


def _continues(before: Sequence[int], shares: Sequence[int], proposed: Sequence[int]) -> bool:
    """Whether going from ``shares`` to ``proposed`` takes no rank back the way the move from
    ``before`` to ``shares`` took it."""
    return all((p - s) * (s - b) >= 0 for b, s, p in zip(before, shares, proposed))


def decide_resplit(shares: Sequence[int], speeds: Sequence[float], threshold: float,
                   pending: Sequence[int] | None = None, changed: bool = False,
                   refining: Sequence[int] | None = None) -> Resplit:
    """Compare the split with ``speeds`` (samples/s of each rank over the last window).

    The split in proportion to ``speeds`` is taken at once when it predicts a step at least
    ``2 × threshold`` faster (a worker really changed speed); one that predicts between
    ``threshold`` and that only when the previous comparison proposed a move the same way
    (``pending``: a drift that persists, not one window's noise) or when ``changed`` says a
    rank's speed left its own band (``SpeedBands.observe``); below ``threshold``, never.
    ``refining`` (the first comparison after a move made from a window: the shares before that
    move): at once at least half ``threshold`` faster, or a quarter when the split carries the
    move on (no rank goes back the way it moved), since a move undershoots. A rank without a
    measured speed (0) keeps the split as it is."""
    proposal = _proportional_proposal(shares, speeds)
    if proposal is None:
        return Resplit()
    proposed, gain = proposal
    if refining is not None and (gain >= threshold / 2 or (
            gain >= FINE_FRACTION * threshold and _continues(refining, shares, proposed))):
        return Resplit(shares=proposed)
    if gain < threshold:
        return Resplit()
    if gain >= 2 * threshold or changed or (pending is not None and _same_direction(pending, proposed, shares)):
        return Resplit(shares=proposed)
    return Resplit(pending=proposed)


FINE_FRACTION = 0.25  # of the threshold: the least gain a fine move needs (see the module docstring)


def fine_resplit(shares: Sequence[int], steady_speeds: Sequence[float], threshold: float) -> tuple[int, ...] | None:
    """The shares in proportion to ``steady_speeds`` when they predict a step at least
    ``FINE_FRACTION × threshold`` faster than ``shares``; else None (also for a rank without a
    speed). Raises ``ValueError`` when the lengths differ."""
    proposal = _proportional_proposal(shares, steady_speeds)
    return proposal[0] if proposal is not None and proposal[1] >= FINE_FRACTION * threshold else None


def remeasure_due(step: int, every: int, calibration_steps: int, last: int | None = None,
                  refining: bool = False) -> bool:
    """Whether speeds are compared after optimizer step ``step`` (1-based): first after the
    ``calibration_steps``; then ``every`` steps after the last comparison (``last``), or half as
    many (at least one) when that comparison moved the shares from a window (``refining``: the
    refinement only has to see the new shares, and settling after a change then ends within about
    a window and a half of the move). Without a last comparison before ``step`` (none yet, or a
    resumed job, whose speed windows are not saved): on the grid ``calibration_steps + n × every``."""
    if last is None or step <= last:
        return step == calibration_steps or (step > calibration_steps and (step - calibration_steps) % every == 0)
    return step - last >= (max(1, every // 2) if refining else every)


def _epoch_shape(num_samples: int, global_batch: int, world: int, drop_last: bool) -> tuple[int, int]:
    """``(steps, size of the last step)``. A remainder smaller than the world joins the last full
    batch (so that every rank gets a sample of every step and no sample is left out)."""
    if global_batch < world:
        raise ValueError(f"global batch {global_batch} is smaller than the world {world}; "
                         "every rank needs at least one sample per step")
    if num_samples < world:
        raise ValueError(f"{num_samples} samples cannot be split over {world} ranks")
    full, rest = divmod(num_samples, global_batch)
    if drop_last:
        if full == 0:
            raise ValueError(f"{num_samples} samples hold no whole global batch of {global_batch} (drop_last)")
        return full, global_batch
    if rest == 0:
        return full, global_batch
    if rest >= world or full == 0:
        return full + 1, rest
    return full, global_batch + rest


def steps_per_epoch(num_samples: int, global_batch: int, world: int, drop_last: bool = False) -> int:
    """Steps of an epoch (see ``step_split``). Raises ``ValueError`` naming impossible sizes."""
    return _epoch_shape(num_samples, global_batch, world, drop_last)[0]


def step_split(num_samples: int, global_batch: int, step: int, shares: Sequence[int],
               drop_last: bool = False) -> tuple[tuple[int, int], ...]:
    """Each rank's ``(start, stop)`` into the epoch's order for ``step`` (0-based in the epoch).

    Step ``s`` covers ``order[s*B : s*B + size]``; ``size`` is ``B`` except at the last step: the
    remainder (``T`` samples), or ``B + T`` when ``T`` is smaller than the world (then it rides
    with the last full batch), or nothing left over with ``drop_last``. A step of another size
    than ``B`` is split in proportion to ``shares``. Raises ``ValueError`` for a step past the
    epoch or shares that do not sum to the batch."""
    if sum(shares) != global_batch:
        raise ValueError(f"shares {list(shares)} sum to {sum(shares)}, not the global batch {global_batch}")
    steps, last_size = _epoch_shape(num_samples, global_batch, len(shares), drop_last)
    if not 0 <= step < steps:
        raise ValueError(f"step {step} is outside the epoch's {steps} steps ({num_samples} samples, "
                         f"global batch {global_batch})")
    size = last_size if step == steps - 1 else global_batch
    if size != global_batch:
        shares = proportional_shares(shares, size)
    out, offset = [], step * global_batch
    for share in shares:
        out.append((offset, offset + share))
        offset += share
    return tuple(out)
