"""The balanced loader, the balancer's weights and state, and the step clock, in one process."""
from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import TensorDataset

from torchrelay.train import balance as B
from torchrelay.train import data


def balancer(rank=0, world=2, **kw):
    return B.Balancer(rank=rank, world=world, every=kw.pop("every", 10), threshold=kw.pop("threshold", 0.1), **kw)


def test_the_ranks_of_a_balanced_loader_cover_the_epoch_once_with_their_own_lengths():
    dataset = TensorDataset(torch.arange(103), torch.arange(103) * 2)
    seen, lengths = [], []
    for rank in (0, 1):
        b = balancer(rank)
        loader = B.BalancedLoader(dataset, batch_size=5, balancer=b, seed=1)
        b.shares = (7, 3)
        loader.set_epoch(2)
        batches = list(loader)
        assert len(batches) == len(loader) == 11  # 10 x 10, then the 3 left
        assert all(torch.equal(y, x * 2) for x, y in batches)  # rows stay together
        seen += [i for x, _ in batches for i in x.tolist()]
        lengths.append([len(x) for x, _ in batches])
    assert sorted(seen) == list(range(103))
    assert lengths == [[7] * 10 + [2], [3] * 10 + [1]]


def test_the_order_changes_with_the_epoch_and_follows_the_seed():
    loader = B.BalancedLoader(list(range(40)), batch_size=4, balancer=balancer(), seed=3)
    first = loader.order()
    loader.sampler.set_epoch(1)
    assert loader.order() != first and sorted(loader.order()) == list(range(40))
    loader.set_epoch(0)
    assert loader.order() == first
    unshuffled = B.BalancedLoader(list(range(40)), batch_size=4, balancer=balancer(), shuffle=False)
    assert unshuffled.order() == list(range(40))


def test_a_generic_dataset_goes_through_collate():
    loader = B.BalancedLoader([{"x": float(i)} for i in range(8)], batch_size=2, balancer=balancer(), shuffle=False)
    first = next(iter(loader))
    assert torch.equal(first["x"], torch.tensor([0.0, 1.0], dtype=torch.float64))


def test_weights_follow_the_batch_and_the_samples_since_the_last_sync():
    b = balancer(rank=1)
    b.set_global_batch(64)
    assert b.shares == (32, 32)
    b.on_batch(21, 64)
    assert b.gradient_weight() == 21 / 64
    b.on_batch(1, 5)
    assert b.gradient_weight() == 1 / 5 and b.parameter_weight() == 22 / 69
    b.parameters_synced()
    assert b.parameter_weight() == 0.5  # nothing trained since: an even average


@pytest.mark.parametrize("saved, global_batch, expected", [
    ({"shares": [43, 21], "resplits": 2}, 64, (43, 21)),
    ({"shares": [43, 21], "resplits": 2}, 32, (16, 16)),   # another global batch: re-measured
    ({"shares": [20, 20, 24], "resplits": 1}, 64, (32, 32)),  # another world: re-measured
])
def test_balancer_state_round_trip(saved, global_batch, expected):
    b = balancer()
    b.set_global_batch(global_batch)
    b.load_state_dict(saved)
    assert b.shares == expected and b.resplits == saved["resplits"]
    assert b.state_dict()["shares"] == list(expected)


def test_after_step_in_a_world_of_one_process_decides_without_collectives():
    b = balancer(rank=0, world=1, every=2, calibration_steps=1)
    b.set_global_batch(8)
    b.on_batch(8, 8)
    assert b.after_step(1, B.StepTimes(compute_s=0.5, idle_s=0.0, step_s=0.5)) is False and b.speeds == (16.0,)
    assert b.metrics() == {"share": 8.0, "resplits": 0.0, "measured_samples_per_s": 16.0}


def test_a_rank_s_speed_is_its_samples_over_its_busy_time():
    """Busy time: the step less its wait (compute and optimizer step), not the compute alone."""
    b = balancer(rank=0, world=1, every=2, calibration_steps=2)
    b.set_global_batch(8)
    b.on_batch(8, 8)
    assert b.after_step(1, None) is False and b.speeds is None  # the first step has no times
    # 0.3 s computing, 0.5 s waiting in the all-reduce, 0.2 s in the optimizer's step: 0.5 s busy
    b.after_step(2, B.StepTimes(compute_s=0.3, idle_s=0.5, step_s=1.0))
    assert b.speeds == pytest.approx((16.0,))


def test_a_resumed_balancer_compares_on_the_grid_again():
    """After ``load_state_dict`` (a resumed job) the comparisons fall on calibration + n x K, not
    K after the last one before the checkpoint: every rank resumes on the same schedule."""
    b = balancer(rank=0, world=1, every=4, calibration_steps=1)
    b.set_global_batch(8)
    b.on_batch(8, 8)
    b.after_step(1, B.StepTimes(compute_s=0.5, idle_s=0.0, step_s=0.5))
    assert b.speeds == (16.0,)
    b.load_state_dict({"shares": [8], "resplits": 0})  # resumed at step 7
    seen = []
    for step in (7, 8, 9):
        b.after_step(step, B.StepTimes(compute_s=0.25, idle_s=0.0, step_s=0.25))
        seen.append(b.speeds)
    assert seen == [(16.0,), (16.0,), (32.0,)]  # at 9 = 1 + 2 x 4 (K after step 1 would be 7 at once)


class FakeTime:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.mark.parametrize("overlapped, marks, expected, busy", [
    # DDP: gradients ready at 0.3 of a 1.0 s step, step() called at 0.9: 0.6 s waiting; busy: the
    # compute and the optimizer's 0.1 s
    (True, {"ready": 0.3, "called": 0.9, "end": 1.0}, B.StepTimes(compute_s=0.3, idle_s=0.6, step_s=1.0), 0.4),
    # blocking collectives (local SGD): 0.25 s inside one, counted as idle
    (False, {"collective": 0.25, "called": 0.5, "end": 1.0}, B.StepTimes(compute_s=0.5, idle_s=0.25, step_s=1.0),
     0.75),
])
def test_step_clock(overlapped, marks, expected, busy):
    fake = FakeTime()
    clock = B.StepClock(overlapped=overlapped, now=fake)
    assert clock.step_ended() is None  # the first step has no start
    fake.now = marks.get("ready", 0.0)
    if "ready" in marks:
        clock.gradients_ready()
    if "collective" in marks:
        with clock.in_collective():
            fake.now += marks["collective"]
    fake.now = marks["called"]
    clock.step_called()
    fake.now = marks["end"]
    got = clock.step_ended()
    assert (got.compute_s, got.idle_s, got.step_s) == pytest.approx((expected.compute_s, expected.idle_s,
                                                                     expected.step_s))
    assert got.idle_fraction == pytest.approx(expected.idle_fraction)
    assert got.busy_s == pytest.approx(busy)
    assert expected.idle_fraction == pytest.approx(expected.idle_s / expected.step_s)


def test_shard_gives_a_balanced_loader_under_balance_throughput(monkeypatch):
    monkeypatch.setenv("RELAY_STRATEGY", json.dumps({"kind": "ddp", "balance": "throughput"}))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    from torchrelay.train.session import current_session

    monkeypatch.setattr(current_session(), "balancer", None)
    loader = data.shard(TensorDataset(torch.arange(10)), batch_size=2)
    assert isinstance(loader, B.BalancedLoader) and loader.global_batch == 4 and loader.balancer.rank == 1
    with pytest.raises(ValueError, match=r"take only collate_fn; drop \['num_workers'\]"):
        data.shard(TensorDataset(torch.arange(10)), batch_size=2, num_workers=2)
    monkeypatch.setenv("RELAY_STRATEGY", json.dumps({"kind": "ddp"}))
    assert not isinstance(data.shard(TensorDataset(torch.arange(10)), batch_size=2), B.BalancedLoader)
