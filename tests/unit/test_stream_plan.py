"""Stream datasets' pure parts: partitions to ranks and DataLoader workers, and the position (tables)."""
from __future__ import annotations

import pytest

from torchrelay.errors import StreamError
from torchrelay.train.stream_plan import Position, assign


@pytest.mark.parametrize("partitions, world, rank, workers, worker, expect", [
    (4, 2, 0, 1, 0, [0, 2]), (4, 2, 1, 1, 0, [1, 3]), (4, 2, 1, 2, 1, [3]), (4, 1, 0, 2, 0, [0, 2]),
    (6, 3, 2, 1, 0, [2, 5]), (8, 2, 0, 3, 2, [4]), (8, 2, 0, 3, 0, [0, 6]), (1, 1, 0, 1, 0, [0]),
])
def test_each_partition_has_exactly_one_reader(partitions, world, rank, workers, worker, expect):
    assert assign(partitions, world=world, rank=rank, workers=workers, worker=worker) == expect
    readers = [p for r in range(world) for w in range(workers)
               for p in assign(partitions, world=world, rank=r, workers=workers, worker=w)]
    assert sorted(readers) == list(range(partitions))  # every partition, once


@pytest.mark.parametrize("partitions, world, workers, says", [
    (4, 3, 1, "4 partition(s), which cannot be split evenly over the job's 3 rank"),
    (2, 4, 1, "2 partition(s), which cannot be split evenly over the job's 4 rank"),
    (4, 2, 3, "reads 2 partition(s), fewer than its 3 DataLoader workers"),
])
def test_a_partition_count_that_cannot_be_split_names_the_stream_and_counts(partitions, world, workers, says):
    with pytest.raises(StreamError) as err:
        assign(partitions, world=world, rank=0, workers=workers, stream="Kafka topic 'clicks'")
    assert "Kafka topic 'clicks'" in str(err.value) and says in str(err.value)


def test_position_moves_forward_only_and_round_trips():
    pos = Position()
    pos.advance({0: 9, 2: 4})
    pos.advance({0: 3})  # an older batch of partition 0 never moves it back
    assert pos.to_state() == {"0": 10, "2": 5}
    back = Position.from_state(pos.to_state())
    assert back.offsets == {0: 10, 2: 5} and back.start(1, 0) == 0 and back.only([2]).offsets == {2: 5}
