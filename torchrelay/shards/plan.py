"""Who reads which samples of a sharded dataset in an epoch, and in what order. Pure.

- ``shard_order(num_shards, seed, epoch, shuffle)``: the epoch's order of shards (one
  permutation per (seed, epoch), the same on every rank).
- ``rank_bounds(total, world_size, shares=None, even=False)``: the samples of the epoch's
  sequence (the shards in that order, end to end) as one contiguous range per rank. Every
  sample lies in exactly one range (``shares``: weights per rank, default equal; a rank's
  range is its share of the total, rounded so the ranges tile it). ``even=True`` gives every
  rank ``total // world_size`` samples and leaves the last ``total % world_size`` out (equal
  shares only): the same number of steps on every rank, as DDP needs.
- ``rank_spans(sizes, order, bounds)``: a range as ``Span``s of shards (shard, start, stop).
- ``buffered_order(count, buffer_size, seed)``: the order in which a shuffle buffer of
  ``buffer_size`` lets a stream of ``count`` samples (positions 0..count-1) out: a sample
  leaves at most ``buffer_size`` places before it came in, so only a window of shards is needed.
- ``read_ahead_for(shard_bytes, budget, low, high)``: how many shards to fetch ahead when the
  caller does not say: about ``budget`` bytes' worth, between ``low`` and ``high``.

Every function depends only on its arguments (no clock, no I/O, Python's own ``random`` seeded
from the arguments), so a resumed process, or another rank, computes the same plan.
``rank_bounds`` is the one place ranks get their share: a heterogeneous job passes ``shares``.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Sequence


@dataclasses.dataclass(frozen=True, slots=True)
class Span:
    shard: int
    start: int
    stop: int


def shard_order(num_shards: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    order = list(range(num_shards))
    if shuffle:
        random.Random(f"shards:{seed}:{epoch}").shuffle(order)
    return order


def rank_bounds(total: int, world_size: int, shares: Sequence[float] | None = None,
                even: bool = False) -> list[tuple[int, int]]:
    """``[(start, stop)]`` per rank (see the module docstring). Raises ``ValueError``."""
    if world_size < 1 or total < 0:
        raise ValueError(f"world_size={world_size} must be >= 1 and total={total} >= 0")
    if shares is not None:
        if len(shares) != world_size or any(s < 0 for s in shares) or sum(shares) <= 0:
            raise ValueError(f"shares={list(shares)!r} must be {world_size} weights >= 0, not all 0")
        if even:
            raise ValueError("even=True gives every rank the same count; it does not take shares")
    if even:
        per = total // world_size
        return [(r * per, (r + 1) * per) for r in range(world_size)]
    weights = [float(s) for s in shares] if shares is not None else [1.0] * world_size
    whole = sum(weights)
    cuts, running = [0], 0.0
    for weight in weights:
        running += weight
        cuts.append(round(total * running / whole))
    cuts[-1] = total
    return [(cuts[r], cuts[r + 1]) for r in range(world_size)]


def rank_spans(sizes: Sequence[int], order: Sequence[int], bounds: tuple[int, int]) -> list[Span]:
    """The shards (in ``order``) that the sample range ``bounds`` covers, cut to it."""
    low, high = bounds
    spans, offset = [], 0
    for shard in order:
        size = sizes[shard]
        start, stop = max(low, offset), min(high, offset + size)
        if start < stop:
            spans.append(Span(shard, start - offset, stop - offset))
        offset += size
        if offset >= high:
            break
    return spans


def buffered_order(count: int, buffer_size: int, seed: str | int) -> list[int]:
    """Positions ``0..count-1`` in the order a shuffle buffer of ``buffer_size`` lets them out.

    Each sample waits a random number of places, uniform in ``[0, buffer_size)``, and they leave
    in the order of position plus wait: what a buffer that holds ``buffer_size`` samples and lets
    a random one out does, computed without stepping through it (a sort of ``count`` keys rather
    than ``count`` random draws from a list in Python). A sample leaves at most ``buffer_size``
    places before it came in, so only a window of shards is needed at a time.
    """
    if buffer_size <= 1:
        return list(range(count))
    rng = random.Random(f"buffer:{seed}")
    keys = [position + rng.random() * buffer_size for position in range(count)]
    return sorted(range(count), key=keys.__getitem__)


def read_ahead_for(shard_bytes: Sequence[int], budget: int = 64 << 20, low: int = 2, high: int = 8) -> int:
    """Shards to fetch ahead: enough that about ``budget`` bytes are in flight (by the mean shard
    size), at least ``low``, at most ``high``. Small shards are many requests, each with its
    latency: more of them at once keep the store busy; large ones need few, and each is memory."""
    if not 1 <= low <= high or budget < 1:
        raise ValueError(f"low={low!r}, high={high!r}, budget={budget!r}: need 1 <= low <= high and budget >= 1")
    if not shard_bytes:
        return low
    mean = max(1, sum(shard_bytes) // len(shard_bytes))
    return max(low, min(high, -(-budget // mean)))
