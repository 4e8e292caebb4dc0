"""Downsampling a metric series for a chart: LTTB that never hides a spike or the last point.

Contract (pure: no I/O, no clock):
- ``keep(xs, ys, max_points)`` returns the sorted indices of the points to draw. A series of
  at most ``max_points`` points is kept whole. Otherwise the first and the last point are
  kept, the points between are split into equal buckets, and each bucket keeps its first,
  its last, its minimum and its maximum point and the point Largest-Triangle-Three-Buckets
  picks (Steinarsson 2013), so a spike, a dip and the newest value are always drawn. The
  result has at most ``max_points`` indices (fewer when a bucket's picks coincide).
- ``window(xs, start, end)`` is the index range of the points with ``start <= x <= end``
  plus one neighbour on each side (so a zoomed chart's line reaches its edges); ``xs``
  sorted ascending.
- NaN values are never a bucket's minimum or maximum (a bucket of NaNs keeps its first and
  last); ``max_points`` below 7 raises ``ValueError`` naming it.

Why hand-written: the LTTB packages on PyPI (``lttb``, ``tsdownsample``) pick one point per
bucket; keeping the bucket's extremes and edges as well is what makes spikes survive
(W&B #5694, ClearML #997), and it is a few numpy lines.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

PICKS_PER_BUCKET = 5  # first, last, min, max, the LTTB point
MIN_POINTS = 2 + PICKS_PER_BUCKET


def keep(xs: Sequence[float] | np.ndarray, ys: Sequence[float] | np.ndarray, max_points: int) -> np.ndarray:
    """Indices (ascending, int64) of the points to draw; see the module docstring."""
    if max_points < MIN_POINTS:
        raise ValueError(f"max_points={max_points} is too few to downsample; use at least {MIN_POINTS}")
    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    if x.shape != y.shape:
        raise ValueError(f"xs has {x.size} points and ys {y.size}; they must be the same length")
    n = x.size
    if n <= max_points:
        return np.arange(n, dtype=np.int64)
    buckets = (max_points - 2) // PICKS_PER_BUCKET
    edges = np.linspace(1, n - 1, buckets + 1).astype(np.int64)
    picks = [np.array([0, n - 1], dtype=np.int64)]
    picks.append(edges[:-1])                       # each bucket's first
    picks.append(edges[1:] - 1)                    # each bucket's last
    picks.append(_extremes(y, edges))
    picks.append(_lttb(x, y, edges))
    return np.unique(np.concatenate(picks))


def window(xs: Sequence[float] | np.ndarray, start: float | None, end: float | None) -> tuple[int, int]:
    """``[lo, hi)`` covering ``start <= x <= end`` and one point beyond each side."""
    x = np.asarray(xs, dtype=np.float64)
    lo = 0 if start is None else max(0, int(np.searchsorted(x, start, side="left")) - 1)
    hi = x.size if end is None else min(x.size, int(np.searchsorted(x, end, side="right")) + 1)
    return lo, max(lo, hi)


def _extremes(y: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Each bucket's argmin and argmax, NaNs ignored (an all-NaN bucket adds nothing)."""
    out = []
    for a, b in zip(edges[:-1], edges[1:]):
        chunk = y[a:b]
        finite = ~np.isnan(chunk)
        if not finite.any():
            continue
        masked_low = np.where(finite, chunk, np.inf)
        masked_high = np.where(finite, chunk, -np.inf)
        out += [a + int(np.argmin(masked_low)), a + int(np.argmax(masked_high))]
    return np.asarray(out, dtype=np.int64)


def _lttb(x: np.ndarray, y: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """One point per bucket: the one making the largest triangle with the previous pick and
    the next bucket's mean (the last point for the last bucket)."""
    y0 = np.nan_to_num(y, nan=0.0, posinf=0.0, neginf=0.0)  # a NaN must not win every triangle
    out = np.empty(edges.size - 1, dtype=np.int64)
    prev = 0
    for i, (a, b) in enumerate(zip(edges[:-1], edges[1:])):
        if i + 2 < edges.size:
            nx, ny = x[b:edges[i + 2]].mean(), y0[b:edges[i + 2]].mean()
        else:
            nx, ny = x[-1], y0[-1]
        px, py = x[prev], y0[prev]
        area = np.abs((px - nx) * (y0[a:b] - py) - (px - x[a:b]) * (ny - py))
        prev = a + int(np.argmax(area))
        out[i] = prev
    return out
