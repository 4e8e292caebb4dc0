"""The pipeline partitioner: tables of cases, exhaustive search as the reference, caps."""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from torchrelay.errors import InvalidSpec, Unschedulable
from torchrelay.train.pipeline.partition import (
    BlockCost, DeviceSpec, Link, PlanInfeasible, equal_split, exhaustive_plan, near_optimal_cuts,
    plan_from_boundaries, plan_stages,
)

pytestmark = pytest.mark.timeout(60)


def blocks_of(times, out=0, param=0, stash=0):
    return [BlockCost(time_s=t, out_bytes=out, param_bytes=param, stash_bytes=stash, name=f"b{i}")
            for i, t in enumerate(times)]


@pytest.mark.parametrize("times, stages, boundaries", [
    ([1, 1, 1, 1], 2, (0, 2)),
    ([1, 1, 1, 1, 1, 1], 3, (0, 2, 4)),
    ([4, 1, 1, 1, 1], 2, (0, 1)),            # a heavy first block sits alone
    ([1, 1, 1, 1, 4], 2, (0, 4)),
    ([3, 1, 1, 1, 3], 3, (0, 1, 4)),         # heavy embedding and head: not the equal split
    ([5], 1, (0,)),
    ([1, 2, 3], 3, (0, 1, 2)),
])
def test_plan_table(times, stages, boundaries):
    plan = plan_stages(blocks_of(times), [DeviceSpec(f"d{k}") for k in range(stages)])
    assert plan.boundaries == boundaries
    assert plan.stages[-1].stop == len(times)


def test_twice_as_fast_device_gets_more_blocks():
    blocks = blocks_of([1.0] * 12)
    same = plan_stages(blocks, [DeviceSpec("a"), DeviceSpec("b")])
    assert [len(s.blocks) for s in same.stages] == [6, 6]
    fast_second = plan_stages(blocks, [DeviceSpec("slow", 1.0), DeviceSpec("fast", 2.0)])
    assert [len(s.blocks) for s in fast_second.stages] == [4, 8]
    fast_first = plan_stages(blocks, [DeviceSpec("fast", 2.0), DeviceSpec("slow", 1.0)])
    assert [len(s.blocks) for s in fast_first.stages] == [8, 4]
    assert fast_second.bottleneck_s == pytest.approx(4.0)


def test_measured_per_device_times_override_speed():
    blocks = blocks_of([1.0] * 4)
    devices = [DeviceSpec("a", block_times_s=(1, 1, 1, 1)),
               DeviceSpec("b", block_times_s=(9, 9, 9, 0.5))]
    assert plan_stages(blocks, devices).boundaries == (0, 3)


def test_heavy_embedding_and_head_is_not_equal_split():
    # embedding and head cost as much as three transformer blocks each
    times = [3.0] + [1.0] * 8 + [3.0]
    plan = plan_stages(blocks_of(times), [DeviceSpec(f"d{k}") for k in range(4)])
    assert list(plan.boundaries) + [10] != equal_split(10, 4)
    assert plan.bottleneck_s < plan.equal_split_bottleneck_s
    assert plan.bottleneck_s == pytest.approx(4.0)


def test_comm_cost_moves_the_cut_to_a_small_activation():
    # equal compute, but cutting after block 1 moves 100x fewer bytes than after block 2
    blocks = [BlockCost(1.0, out_bytes=10**9), BlockCost(1.0, out_bytes=10**6),
              BlockCost(1.0, out_bytes=10**9), BlockCost(1.0, out_bytes=10**9)]
    link = Link(bandwidth_bytes_per_s=1e9)
    plan = plan_stages(blocks[:3] + blocks[3:], [DeviceSpec(), DeviceSpec()], link)
    assert plan.boundaries == (0, 2)
    assert plan.stages[0].comm_s == pytest.approx(2e-3)


def test_memory_caps_are_respected():
    blocks = blocks_of([1.0] * 6, param=100)
    # unconstrained the split is 3/3, but the first device holds only 200 bytes
    plan = plan_stages(blocks, [DeviceSpec("small", mem_cap_bytes=200), DeviceSpec("big")])
    assert plan.boundaries == (0, 2)
    assert all(s.mem_cap_bytes is None or s.mem_bytes <= s.mem_cap_bytes for s in plan.stages)


def test_stashed_activations_count_per_microbatch_in_flight():
    blocks = blocks_of([1.0] * 4, param=10, stash=10)
    devices = [DeviceSpec("a", mem_cap_bytes=60), DeviceSpec("b", mem_cap_bytes=10**6)]
    # 1F1B: stage 0 has 2 micro-batches in flight -> 2 blocks cost 20 + 2*20 = 60
    assert plan_stages(blocks, devices, microbatches=8, schedule="1f1b").boundaries == (0, 2)
    # GPipe keeps all 8 in flight: one block costs 10 + 8*10 = 90 > 60
    with pytest.raises(PlanInfeasible):
        plan_stages(blocks, devices, microbatches=8, schedule="gpipe")


def test_infeasible_plan_names_the_numbers():
    blocks = blocks_of([1.0] * 4, param=2**20)
    with pytest.raises(PlanInfeasible) as info:
        plan_stages(blocks, [DeviceSpec("a", mem_cap_bytes=2**20)] * 2)
    message = str(info.value)
    assert "4.0MiB" in message and "1.0MiB" in message and "2 stages" in message
    assert isinstance(info.value, Unschedulable)


@pytest.mark.parametrize("blocks, devices, kwargs, fragment", [
    ([], [DeviceSpec()], {}, "no blocks"),
    (blocks_of([1]), [], {}, "no devices"),
    (blocks_of([1]), [DeviceSpec(), DeviceSpec()], {}, "2 stages for 1 blocks"),
    (blocks_of([1]), [DeviceSpec()], {"schedule": "zigzag"}, "'zigzag'"),
    (blocks_of([1]), [DeviceSpec()], {"microbatches": 0}, "microbatches=0"),
    (blocks_of([-1]), [DeviceSpec()], {}, "block 0"),
    (blocks_of([1]), [DeviceSpec("x", speed=0)], {}, "speed 0"),
    (blocks_of([1]), [DeviceSpec("x", block_times_s=(1, 2))], {}, "2 block times for 1"),
])
def test_bad_input_is_named(blocks, devices, kwargs, fragment):
    with pytest.raises(InvalidSpec, match=fragment.replace("(", r"\(")):
        plan_stages(blocks, devices, **kwargs)


def test_plan_explains_itself():
    plan = plan_stages(blocks_of([3, 1, 1, 3], out=1000, param=2**20), [DeviceSpec("cpu:0"),
                       DeviceSpec("cpu:1")], Link(1e6), microbatches=4)
    text = plan.describe()
    assert "stage 0 on cpu:0: blocks 0-1" in text and "slowest" in text
    data = plan.to_dict()
    assert [s["blocks"] for s in data["stages"]] == [[0, 2], [2, 4]]
    assert data["stages"][0]["comm_s"] == pytest.approx(2e-3)
    assert data["predicted_step_s"] == pytest.approx(3 * plan.bottleneck_s + sum(
        s.time_s for s in plan.stages))


def test_plan_from_boundaries_rejects_bad_cuts():
    with pytest.raises(InvalidSpec, match=r"\[0, 2, 2, 4\]"):
        plan_from_boundaries(blocks_of([1] * 4), [DeviceSpec()] * 3, [0, 2, 2, 4])


costs = st.builds(
    BlockCost,
    time_s=st.floats(0.0, 10.0, allow_nan=False),
    out_bytes=st.integers(0, 5000),
    param_bytes=st.integers(0, 100),
    stash_bytes=st.integers(0, 20),
)
devices_st = st.builds(
    DeviceSpec,
    name=st.just("d"),
    speed=st.sampled_from([0.5, 1.0, 2.0, 3.0]),
    mem_cap_bytes=st.one_of(st.none(), st.integers(50, 600)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blocks=st.lists(costs, min_size=1, max_size=8), devices=st.lists(devices_st, min_size=1,
       max_size=4), bandwidth=st.sampled_from([math.inf, 1e3, 1e5]),
       schedule=st.sampled_from(["gpipe", "1f1b"]), microbatches=st.integers(1, 8))
def test_dp_equals_exhaustive_search(blocks, devices, bandwidth, schedule, microbatches):
    if len(devices) > len(blocks):
        devices = devices[:len(blocks)]
    link = Link(bandwidth)
    reference = exhaustive_plan(blocks, devices, link, microbatches, schedule)
    if reference is None:
        with pytest.raises(PlanInfeasible):
            plan_stages(blocks, devices, link, microbatches, schedule)
        return
    plan = plan_stages(blocks, devices, link, microbatches, schedule)
    assert plan.bottleneck_s == pytest.approx(reference.bottleneck_s, rel=1e-9, abs=1e-12)
    # among (near-)optimal cuts the DP takes the least summed time: never more than the reference
    assert sum(s.time_s for s in plan.stages) <= sum(
        s.time_s for s in reference.stages) * (1 + 1e-9) + 1e-12
    assert all(s.mem_cap_bytes is None or s.mem_bytes <= s.mem_cap_bytes for s in plan.stages)
    assert [len(s.blocks) for s in plan.stages] and all(len(s.blocks) >= 1 for s in plan.stages)


def test_plans_100_blocks_into_8_stages():
    blocks = [BlockCost(time_s=1.0 + (i % 7) * 0.3, out_bytes=1000 * (i % 3), param_bytes=10**6)
              for i in range(100)]
    devices = [DeviceSpec(f"d{k}", speed=1.0 + k % 2, mem_cap_bytes=40 * 10**6) for k in range(8)]
    plan = plan_stages(blocks, devices, Link(1e9))  # its time is measured by bench/pipeline.py
    assert len(plan.stages) == 8 and plan.stages[-1].stop == 100
    assert all(s.mem_bytes <= s.mem_cap_bytes for s in plan.stages)



# near_optimal_cuts: the plan's own cut first, then neighbours within the tolerance
@pytest.mark.parametrize("times, stages, tolerance, expected", [
    ([1, 1, 1, 1, 1, 1], 2, 0.06, [[0, 3, 6]]),  # both neighbours are 4/3 slower
    ([1, 1, 1, 1, 1, 1], 2, 0.4, [[0, 3, 6], [0, 2, 6], [0, 4, 6]]),
    ([2, 1, 1, 2], 2, 0.6, [[0, 2, 4], [0, 1, 4], [0, 3, 4]]),
    ([2, 1, 1, 2], 2, 0.0, [[0, 2, 4]]),
    ([1, 1, 1], 3, 0.5, [[0, 1, 2, 3]]),  # no boundary can move
    ([3, 1, 1, 1, 3], 3, 0.5, [[0, 1, 4, 5], [0, 2, 4, 5], [0, 1, 3, 5]]),
])
def test_near_optimal_cuts_table(times, stages, tolerance, expected):
    blocks = [BlockCost(time_s=t) for t in times]
    devices = [DeviceSpec(f"d{k}") for k in range(stages)]
    plan = plan_stages(blocks, devices, microbatches=4)
    assert near_optimal_cuts(blocks, devices, plan, microbatches=4,
                             tolerance=tolerance) == expected


def test_near_optimal_cuts_skip_cuts_over_a_memory_cap():
    blocks = [BlockCost(time_s=1.0, param_bytes=100), BlockCost(time_s=1.0, param_bytes=100),
              BlockCost(time_s=1.0, param_bytes=100)]
    devices = [DeviceSpec("a", mem_cap_bytes=150), DeviceSpec("b", mem_cap_bytes=250)]
    plan = plan_stages(blocks, devices)
    assert [*plan.boundaries, 3] == [0, 1, 3]
    # moving the cut to [0, 2, 3] ties on time but puts 200 bytes on the 150-byte device
    assert near_optimal_cuts(blocks, devices, plan, tolerance=1.0) == [[0, 1, 3]]
