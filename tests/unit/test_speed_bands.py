"""SpeedBands: a rank's speed changed for good only when it leaves its own band twice, the same way."""
from __future__ import annotations

import random

import pytest

from torchrelay.train.speed_bands import SpeedBands

STEADY = [(100.0, 50.0), (101.0, 49.0), (99.0, 51.0)]  # three windows: rank 0 ~100, rank 1 ~50


@pytest.mark.parametrize("windows, expected", [
    # the windows after STEADY, and what observe says of each (rank 1's band: 50 +- 5, its floor)
    ([(100.0, 50.5), (99.5, 49.5)], [False, False]),                      # inside both bands
    ([(100.0, 60.0), (100.0, 61.0)], [False, True]),                     # rank 1 faster twice: changed
    ([(100.0, 40.0), (100.0, 41.0)], [False, True]),                     # slower twice: changed
    ([(100.0, 60.0), (100.0, 50.0)], [False, False]),                    # one window out, then back
    ([(100.0, 60.0), (100.0, 40.0)], [False, False]),                    # out both ways: not one change
    ([(100.0, 60.0), (100.0, 40.0), (100.0, 41.0)], [False, False, True]),  # then slower twice
    ([(100.0, 53.0), (100.0, 53.5)], [False, False]),                    # 6 %: under the 10 % floor
    ([(115.0, 50.0), (116.0, 50.0)], [False, True]),                     # the other rank changed
    ([(100.0, 60.0), (100.0, 0.0), (100.0, 60.0)], [False, False, True]),  # no measurement: skipped
    # a leap, more than 3 band widths in one window: changed at once
    ([(100.0, 75.0)], [True]),                                           # +50 % (a CPU limit lifted)
    ([(100.0, 30.0)], [True]),                                           # -40 %
    ([(140.0, 50.0)], [True]),                                           # rank 0: +40 %, its band +- 10
    ([(100.0, 64.0), (100.0, 50.0)], [False, False]),                    # +28 %: out, not a leap
    ([(100.0, 36.0), (100.0, 51.0)], [False, False]),                    # -28 % (a core's slow phase)
])
def test_observe_table(windows, expected):
    bands = SpeedBands(floor=0.1)
    assert [bands.observe(w) for w in STEADY] == [False, False, False]
    assert [bands.observe(w) for w in windows] == expected


def test_too_few_windows_cannot_be_out_of_band():
    bands = SpeedBands(floor=0.1)
    assert [bands.observe(w) for w in [(100.0, 50.0), (100.0, 50.0), (100.0, 90.0), (100.0, 90.0)]] == [False] * 4


def test_after_a_change_the_band_restarts_at_the_new_level():
    bands = SpeedBands(floor=0.1, min_windows=2)
    for w in [(100.0, 50.0), (100.0, 50.0), (100.0, 58.0)]:
        bands.observe(w)
    assert bands.observe((100.0, 59.0)) is True
    # the new level is ~58.5: staying there is in band, and going back to 50 is a change again
    assert [bands.observe(w) for w in [(100.0, 58.5), (100.0, 58.0)]] == [False, False]
    assert [bands.observe(w) for w in [(100.0, 50.0), (100.0, 50.0)]] == [False, True]


def test_a_leap_counts_at_once_and_the_band_restarts_from_the_next_window_out_of_it():
    bands = SpeedBands(floor=0.1, min_windows=2)
    for w in [(100.0, 50.0), (100.0, 50.0)]:
        bands.observe(w)
    # measured: the window a CPU limit was lifted in holds the change in part (999 against a band
    # of ~770), the next one whole (1397). The first is a leap; the second, still out of the old
    # band, says the change is for good, and the band restarts from the two
    assert bands.observe((100.0, 66.0)) is True
    assert bands.observe((100.0, 90.0)) is True
    # the band is now those two windows (78 +- 68): the new level is in it
    assert [bands.observe(w) for w in [(100.0, 80.0), (100.0, 85.0)]] == [False, False]
    assert bands.steady_speeds() == (100.0, pytest.approx(80.25))


def test_a_leap_and_back_leaves_the_band_as_it_was():
    bands = SpeedBands(floor=0.1)
    for w in STEADY:
        bands.observe(w)
    assert [bands.observe(w) for w in [(100.0, 80.0), (100.0, 50.0), (100.0, 60.0), (100.0, 61.0)]] == [
        True, False, False, True]  # the band still ~50: two windows out of it later are a change


def test_a_jittery_rank_needs_a_larger_move_than_a_steady_one():
    jittery = [(100.0, 40.0), (100.0, 60.0), (100.0, 45.0), (100.0, 55.0)]  # rank 1: 50 +- 20 %
    bands = SpeedBands(floor=0.1)
    for w in jittery:
        bands.observe(w)
    assert [bands.observe(w) for w in [(100.0, 65.0), (100.0, 65.0)]] == [False, False]  # +30 %: its noise
    steady = SpeedBands(floor=0.1)
    for w in STEADY:
        steady.observe(w)
    assert [steady.observe(w) for w in [(100.0, 65.0), (100.0, 65.0)]] == [False, True]


def test_steady_speeds_are_each_ranks_mean_in_band_once_every_rank_has_three_windows():
    bands = SpeedBands(floor=0.1)
    bands.observe([100.0, 50.0])
    bands.observe([102.0, 51.0])
    assert bands.steady_speeds() is None
    bands.observe([104.0, 52.0])
    assert bands.steady_speeds() == (102.0, 51.0)
    bands.observe([103.0, 58.0])  # out of rank 1's band: not part of its steady speed
    assert bands.steady_speeds() == (102.25, 51.0)
    bands.reset()
    assert bands.steady_speeds() is None


def test_reset_forgets_every_rank():
    bands = SpeedBands(floor=0.1)
    for w in [*STEADY, (100.0, 75.0)]:
        bands.observe(w)
    bands.reset()
    assert bands.observe((100.0, 75.0)) is False  # no band yet, so no second window out of it
    bands.reset()
    assert bands.observe((100.0, 50.0, 20.0)) is False  # and a reset may change the world


@pytest.mark.parametrize("seed", range(5))
def test_noise_alone_never_reads_as_a_change(seed):
    rng = random.Random(seed)
    bands = SpeedBands(floor=0.1)
    noisy = [(100.0 * rng.gauss(1, 0.03), 50.0 * rng.gauss(1, 0.03)) for _ in range(2000)]
    assert not any(bands.observe(w) for w in noisy)


def test_a_different_number_of_ranks_is_refused():
    bands = SpeedBands(floor=0.1)
    bands.observe((100.0, 50.0))
    with pytest.raises(ValueError, match="3 speeds but 2 ranks"):
        bands.observe((100.0, 50.0, 20.0))
