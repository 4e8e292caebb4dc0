"""torchrelay.agent.gpus: device indices per launch."""
from __future__ import annotations

import pytest

from torchrelay.agent.gpus import GpuShortage, GpuSlots, visible_devices


@pytest.mark.parametrize("total, takes, expected", [
    (4, [("a", 2), ("b", 1)], {"a": (0, 1), "b": (2,)}),
    (4, [("a", 0), ("b", 4)], {"a": (), "b": (0, 1, 2, 3)}),
    (2, [("a", 1), ("a", 1)], {"a": (0,)}),  # the same launch again: the same device
    (8, [("a", 3), ("b", 3)], {"a": (0, 1, 2), "b": (3, 4, 5)}),
])
def test_take_gives_the_lowest_free_indices(total, takes, expected):
    slots = GpuSlots(total)
    got = {launch: slots.take(launch, count) for launch, count in takes}
    assert got == expected


def test_released_devices_go_to_the_next_launch():
    slots = GpuSlots(3)
    slots.take("a", 2)
    slots.take("b", 1)
    slots.release("a")
    slots.release("a")  # idempotent
    assert slots.take("c", 2) == (0, 1)
    assert slots.held() == {"b": (2,), "c": (0, 1)}


def test_too_few_free_devices_name_the_holders():
    slots = GpuSlots(2)
    slots.take("job-1-a1-n0", 2)
    with pytest.raises(GpuShortage, match=r"job-2-a1-n0 needs 1 gpus but only 0 of this node's 2.*job-1-a1-n0: \[0, 1\]"):
        slots.take("job-2-a1-n0", 1)


@pytest.mark.parametrize("bad", [lambda: GpuSlots(-1), lambda: GpuSlots(1).take("a", -1)])
def test_negative_counts_are_refused(bad):
    with pytest.raises(ValueError, match="must be >= 0"):
        bad()


@pytest.mark.parametrize("indices, node_gpus, expected", [
    ((0, 1), 4, "0,1"),
    ((), 4, ""),  # a CPU-only launch on a GPU node sees no device
    ((), 0, None),  # a node without GPUs leaves the variable alone
])
def test_visible_devices(indices, node_gpus, expected):
    assert visible_devices(indices, node_gpus) == expected
