"""torchrelay.shards.plan and .format: pure, by tables."""
from collections import Counter

import pytest

from torchrelay.errors import InvalidSpec
from torchrelay.shards.format import ShardEntry, ShardIndex, parse_size
from torchrelay.shards.plan import Span, buffered_order, rank_bounds, rank_spans, shard_order, read_ahead_for


@pytest.mark.parametrize("total, world, shares, even, expected", [
    (10, 1, None, False, [(0, 10)]),
    (10, 3, None, False, [(0, 3), (3, 7), (7, 10)]),
    (10, 3, None, True, [(0, 3), (3, 6), (6, 9)]),
    (2, 3, None, False, [(0, 1), (1, 1), (1, 2)]),
    (12, 2, [1, 2], False, [(0, 4), (4, 12)]),
    (12, 3, [1, 0, 1], False, [(0, 6), (6, 6), (6, 12)]),
    (0, 2, None, False, [(0, 0), (0, 0)]),
])
def test_rank_bounds_tile_the_epoch(total, world, shares, even, expected):
    assert rank_bounds(total, world, shares, even) == expected


@pytest.mark.parametrize("args, message", [
    ((10, 0), "world_size=0"),
    ((10, 2, [1]), "2 weights"),
    ((10, 2, [0, 0]), "not all 0"),
    ((10, 2, [1, -1]), "weights >= 0"),
    ((10, 2, [1, 1], True), "does not take shares"),
])
def test_rank_bounds_refuses(args, message):
    with pytest.raises(ValueError, match=message):
        rank_bounds(*args)


@pytest.mark.parametrize("total, world", [(1, 1), (7, 3), (100, 7), (5, 8), (1000, 4)])
def test_every_sample_on_exactly_one_rank(total, world):
    counts = Counter(p for low, high in rank_bounds(total, world) for p in range(low, high))
    assert sorted(counts) == list(range(total)) and set(counts.values()) <= {1}


@pytest.mark.parametrize("sizes, order, bounds, expected", [
    ([5, 5, 5], [0, 1, 2], (0, 15), [Span(0, 0, 5), Span(1, 0, 5), Span(2, 0, 5)]),
    ([5, 5, 5], [2, 0, 1], (3, 12), [Span(2, 3, 5), Span(0, 0, 5), Span(1, 0, 2)]),
    ([5, 5, 5], [0, 1, 2], (5, 10), [Span(1, 0, 5)]),
    ([5, 5, 5], [0, 1, 2], (4, 4), []),
    ([3, 1, 4], [1, 2, 0], (1, 2), [Span(2, 0, 1)]),
])
def test_rank_spans(sizes, order, bounds, expected):
    assert rank_spans(sizes, order, bounds) == expected


def test_shard_order_is_a_permutation_fixed_by_seed_and_epoch():
    assert shard_order(5, 0, 0, shuffle=False) == [0, 1, 2, 3, 4]
    a, b = shard_order(50, 1, 0), shard_order(50, 1, 1)
    assert sorted(a) == list(range(50)) and a == shard_order(50, 1, 0) and a != b


@pytest.mark.parametrize("count, buffer", [(0, 8), (1, 8), (10, 1), (10, 100), (500, 16)])
def test_buffered_order_is_a_permutation_within_the_buffer_window(count, buffer):
    order = buffered_order(count, buffer, "s")
    assert sorted(order) == list(range(count)) and order == buffered_order(count, buffer, "s")
    # only what has entered the buffer can leave it: the i-th out came in at most `buffer` places later
    assert all(position <= index + buffer for index, position in enumerate(order))
    if buffer > 1 and count > 2 * buffer:
        assert order != list(range(count))


@pytest.mark.parametrize("text, expected", [
    ("64MiB", 64 << 20), ("500MB", 500_000_000), ("1GiB", 1 << 30), ("4096", 4096), (" 1.5 KiB", 1536), (7, 7),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "12XB", "-1", "MiB", "0"])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_index_round_trip_and_refusals():
    index = ShardIndex(kind="dict", fields={"x": {"dtype": "float32", "shape": [8]}},
                       shards=(ShardEntry("shard-000000.pt", 3, 100, "a" * 64), ShardEntry("shard-000001.pt", 2, 90, "b" * 64)))
    back = ShardIndex.parse(index.to_json(), "idx")
    assert back == index and back.samples == 5 and back.sizes() == [3, 2]
    for bad in (b"{", b'{"format": "other"}', index.to_json().replace(b'"dict"', b'"list"'),
                index.to_json().replace(b"shard-000001.pt", b"../escape")):
        with pytest.raises(InvalidSpec, match="idx"):
            ShardIndex.parse(bad, "idx")


@pytest.mark.parametrize("shard_bytes, expected", [
    ([8 << 20] * 9, 8),              # 8 MiB shards: 64 MiB is 8 of them
    ([64 << 20] * 3, 2),             # large shards: the floor
    ([1 << 30], 2),
    ([16 << 20, 48 << 20], 2),       # the mean, 32 MiB: 2
    ([4 << 20] * 5, 8),              # tiny shards: the ceiling
    ([20 << 20] * 4, 4),             # 64 / 20, rounded up
    ([], 2),
])
def test_read_ahead_for_keeps_about_64_mib_in_flight(shard_bytes, expected):
    assert read_ahead_for(shard_bytes) == expected


def test_read_ahead_for_refuses_an_empty_range():
    with pytest.raises(ValueError, match="need 1 <= low <= high"):
        read_ahead_for([1], low=3, high=2)
