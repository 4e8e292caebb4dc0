"""``server.downsample``: LTTB that keeps each bucket's min, max, first and last; zoom windows."""
import math

import numpy as np
import pytest

from torchrelay.server.downsample import MIN_POINTS, keep, window


def _series(n, spikes=(), nan=()):
    x = np.arange(n, dtype=float)
    y = np.sin(x / 50.0)
    for i, v in spikes:
        y[i] = v
    for i in nan:
        y[i] = math.nan
    return x, y


@pytest.mark.parametrize("n, max_points, expect_all", [
    (0, 100, True), (1, 100, True), (100, 100, True), (101, 100, False), (10_000, 100, False),
    (10_000, 10_000, True), (8, 7, False),
])
def test_short_series_are_kept_whole_and_long_ones_fit(n, max_points, expect_all):
    x, y = _series(n)
    idx = keep(x, y, max_points)
    assert (idx.size == n) == expect_all
    assert idx.size <= max(n, 0) and (expect_all or idx.size <= max_points)
    assert list(idx) == sorted(set(idx.tolist()))  # ascending, no repeats
    if n:
        assert idx[0] == 0 and idx[-1] == n - 1  # first and newest point always drawn


@pytest.mark.parametrize("n, max_points, spikes", [
    (100_000, 500, [(12_345, 50.0)]),                      # one spike
    (100_000, 500, [(777, -80.0)]),                        # one dip
    (100_000, 500, [(50_000, 9.0), (50_001, -9.0)]),       # a spike and a dip side by side
    (100_000, 502, [(i, 5.0) for i in range(1000, 100_000, 9_973)]),  # many
    (1_000, 12, [(500, 1e9)]),                             # the smallest budget
])
def test_no_spike_or_dip_is_hidden(n, max_points, spikes):
    x, y = _series(n, spikes)
    idx = set(keep(x, y, max_points).tolist())
    for i, _ in spikes:
        assert i in idx, f"spike at {i} dropped"


@pytest.mark.parametrize("n, max_points", [(10_000, 100), (10_000, 1000), (1234, 57)])
def test_every_bucket_keeps_its_extremes_and_edges(n, max_points):
    x, y = _series(n)
    y = y + np.random.default_rng(0).normal(0, 0.3, n)
    idx = set(keep(x, y, max_points).tolist())
    buckets = (max_points - 2) // 5
    edges = np.linspace(1, n - 1, buckets + 1).astype(int)
    for a, b in zip(edges[:-1], edges[1:]):
        assert {a, b - 1, a + int(np.argmin(y[a:b])), a + int(np.argmax(y[a:b]))} <= idx


def test_a_line_keeps_its_shape():
    x = np.arange(10_000, dtype=float)
    y = np.where(x < 5000, x, 10_000 - x)  # a peak in the middle
    idx = keep(x, y, 100)
    assert 5000 in idx.tolist()
    assert np.interp(x, x[idx], y[idx]) == pytest.approx(y, abs=1e-9)  # piecewise linear: exact


@pytest.mark.parametrize("nan", [[3], list(range(100, 400)), list(range(0, 9_999))])
def test_nan_is_never_an_extreme_and_does_not_break_lttb(nan):
    x, y = _series(10_000, spikes=[(9_999, 7.0)], nan=nan)
    idx = keep(x, y, 200)
    assert idx[-1] == 9_999 and idx.size <= 200


@pytest.mark.parametrize("max_points", [0, 1, MIN_POINTS - 1])
def test_too_few_points_is_a_clear_error(max_points):
    with pytest.raises(ValueError, match=f"max_points={max_points}"):
        keep([1, 2, 3], [1, 2, 3], max_points)


def test_mismatched_lengths_name_both():
    with pytest.raises(ValueError, match="xs has 3 points and ys 2"):
        keep([1, 2, 3], [1, 2], 10)


@pytest.mark.parametrize("start, end, expect", [
    (None, None, (0, 10)),
    (3, 5, (2, 7)),        # 3, 4, 5 and one neighbour each side
    (0, 9, (0, 10)),
    (-5, 100, (0, 10)),
    (3.5, 3.7, (3, 5)),    # nothing inside: the two neighbours
    (20, 30, (9, 10)),     # after the end: the last point
    (5, None, (4, 10)),
])
def test_window(start, end, expect):
    assert window(np.arange(10), start, end) == expect
