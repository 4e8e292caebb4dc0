"""Downsampling a metric series for a chart: LTTB that never hides a spike or the last point.

Contract (pure: no I/O, no clock):
- ``keep(xs, ys, max_points)`` returns the sorted indices of the points to draw. A series of
  at most ``max_points`` points is kept whole. Otherwise the first and the last point are
  kept, the points between are split into equal buckets, and each bucket keeps its first,
  its last, its minimum and its maximum point and the point of the largest triangle with its
  neighbouring buckets (Largest-Triangle-Three-Buckets, Steinarsson 2013, with the previous
  bucket's mean as a corner so that all buckets are computed at once: see ``_lttb``), so a
  spike, a dip and the newest value are always drawn. The
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


def _buckets(edges: np.ndarray) -> np.ndarray:
    """A (buckets, widest) matrix of point indices, each row one bucket, short rows padded with
    their bucket's last index (harmless for min, max and triangle areas)."""
    starts, stops = edges[:-1], edges[1:]
    width = int((stops - starts).max())
    idx = starts[:, None] + np.arange(width)[None, :]
    return np.minimum(idx, (stops - 1)[:, None])


def _extremes(y: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Each bucket's argmin and argmax, NaNs ignored (an all-NaN bucket adds nothing)."""
    idx = _buckets(edges)
    chunk = y[idx]
    finite = ~np.isnan(chunk)
    rows = np.arange(idx.shape[0])
    low = idx[rows, np.argmin(np.where(finite, chunk, np.inf), axis=1)]
    high = idx[rows, np.argmax(np.where(finite, chunk, -np.inf), axis=1)]
    keep = finite.any(axis=1)
    return np.concatenate([low[keep], high[keep]])


def _lttb(x: np.ndarray, y: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """One point per bucket: the one making the largest triangle with its neighbours. LTTB takes
    the previous bucket's pick as the first corner, which makes buckets depend on each other;
    here it is the previous bucket's mean (the first point for the first bucket), as the next
    bucket's mean is the third corner (the last point for the last), so that every bucket is
    computed at once. The bucket's extremes are kept besides, so no spike depends on this pick."""
    y0 = np.nan_to_num(y, nan=0.0, posinf=0.0, neginf=0.0)  # a NaN must not win every triangle
    idx = _buckets(edges)
    counts = (edges[1:] - edges[:-1]).astype(np.float64)
    mean_x = np.add.reduceat(x[: edges[-1]], edges[:-1]) / counts
    mean_y = np.add.reduceat(y0[: edges[-1]], edges[:-1]) / counts
    px = np.concatenate([[x[0]], mean_x[:-1]])[:, None]
    py = np.concatenate([[y0[0]], mean_y[:-1]])[:, None]
    nx = np.concatenate([mean_x[1:], [x[-1]]])[:, None]
    ny = np.concatenate([mean_y[1:], [y0[-1]]])[:, None]
    area = np.abs((px - nx) * (y0[idx] - py) - (px - x[idx]) * (ny - py))
    return idx[np.arange(idx.shape[0]), np.argmax(area, axis=1)]
