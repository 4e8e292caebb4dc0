"""torchrelay.train.data: the split equals DistributedSampler's; exact partitions for evaluation."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

import torchrelay.train as rt

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("num_samples, world_size, shuffle, seed, epoch", [
    (10, 2, False, 0, 0), (10, 3, False, 0, 0), (11, 4, True, 0, 0), (11, 4, True, 7, 3),
    (2, 5, True, 1, 0),   # fewer samples than ranks: padding repeats them more than once
    (1797, 2, True, 0, 5), (0, 2, False, 0, 0),
])
def test_shard_indices_equals_distributed_sampler(num_samples, world_size, shuffle, seed, epoch):
    dataset = list(range(num_samples))
    for rank in range(world_size):
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed)
        sampler.set_epoch(epoch)
        assert rt.shard_indices(num_samples, rank=rank, world_size=world_size, shuffle=shuffle, seed=seed,
                                epoch=epoch) == list(sampler)


@pytest.mark.parametrize("num_samples, world_size", [(10, 3), (7, 7), (3, 5), (360, 2), (0, 2)])
def test_shard_indices_without_padding_is_an_exact_partition(num_samples, world_size):
    shares = [rt.shard_indices(num_samples, rank=r, world_size=world_size, pad=False, shuffle=True)
              for r in range(world_size)]
    assert sorted(i for share in shares for i in share) == list(range(num_samples))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


@pytest.mark.parametrize("kwargs, error", [
    (dict(rank=2, world_size=2), "rank=2 must be in"),
    (dict(rank=0, world_size=0), "world_size=0"),
])
def test_shard_indices_refuses_bad_ranks(kwargs, error):
    with pytest.raises(ValueError, match=error):
        rt.shard_indices(10, **kwargs)


def _dataset(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.arange(n))


def test_shard_reads_rank_and_world_from_the_environment(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    loader = rt.shard(_dataset(10), batch_size=2, shuffle=False)
    assert isinstance(loader.sampler, DistributedSampler)
    assert [batch[1].tolist() for batch in loader] == [[1, 3], [5, 7], [9]]


def test_shard_set_epoch_changes_the_order_and_drop_last_drops_the_tail():
    loader = rt.shard(_dataset(10), batch_size=4, seed=3, drop_last=True, rank=0, world_size=2)
    first = [batch[1].tolist() for batch in loader]
    assert first == [[batch[1].tolist() for batch in loader]][0]  # same epoch: same order
    loader.sampler.set_epoch(1)
    second = [batch[1].tolist() for batch in loader]
    assert len(first) == len(second) == 1 and first != second


@pytest.mark.parametrize("kwargs, error", [
    (dict(batch_size=0), "batch_size=0 must be an int >= 1"),
    (dict(batch_size=2.0), "batch_size=2.0"),
    (dict(batch_size=2, sampler=[0]), "drop sampler="),
])
def test_shard_refuses_bad_arguments(kwargs, error):
    with pytest.raises(ValueError, match=error):
        rt.shard(_dataset(4), **kwargs)
