"""Each rank's share of a dataset.

Contract:
- ``shard(dataset, batch_size=…)`` is a ``DataLoader`` over torch's ``DistributedSampler`` for
  this rank (world and rank from ``init()``'s context, or the environment before it; under the
  parameter-server strategy the workers' world, without the server ranks). Call
  ``loader.sampler.set_epoch(epoch)`` at the start of every epoch, or every epoch sees the same
  order. With ``drop_last=False`` the sampler pads every rank to the same number of samples by
  repeating a few (torch's behaviour), so every rank runs the same number of steps; with
  ``drop_last=True`` the tail is dropped instead, both as samples and as a short last batch.
  ``batch_size`` is per rank: the global batch is ``batch_size × world_size``.
- Under ``balance: throughput`` (ddp, local_sgd, diloco) ``shard`` returns a
  ``train.balance.BalancedLoader`` instead: the global batch stays ``batch_size × world_size``,
  each rank's batch follows its measured speed, every sample is seen exactly once per epoch (no
  padding), and ``len(loader)`` is the same on every rank. It is index-level and in-memory:
  ``collate_fn`` is the one ``DataLoader`` keyword it takes.
- ``shard_indices(n, …)`` is the same split as plain indices (pure, no torch.distributed), and
  with ``pad=False`` an exact partition: every index on exactly one rank (use it for evaluation).
- ``data_share()`` is ``(this rank's share, shares)`` as ``shard`` splits: the rank and world
  size, except under the parameter server (workers only) and under ``fsdp`` with
  ``tensor_parallel: t``, where the ``t`` ranks of a tensor-parallel group read the same share.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from torchrelay.train.balance import BalancedLoader, balancer_for
from torchrelay.train.roles import Roles
from torchrelay.train.session import current_session


def data_rank_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world size) among the ranks that read data: the given ones, else the context's
    (under the parameter server, the workers'). Raises ``ValueError`` for a rank outside the world."""
    return _resolve(rank, world_size)


def _resolve(rank: int | None, world_size: int | None) -> tuple[int, int]:
    ctx = current_session().known_context()
    data_rank, data_world = ctx.rank, ctx.world_size
    if rank is None or world_size is None:
        # under the parameter server the data is split over the workers only (train.roles)
        data_rank, data_world = Roles.of(ctx.rank, ctx.world_size, ctx.strategy).data_world()
    rank = data_rank if rank is None else rank
    world_size = data_world if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    return rank, world_size


def data_share() -> tuple[int, int]:
    """``(share, shares)``: which share of the data this rank reads, of how many (see the module docstring)."""
    return _resolve(None, None)


def shard(dataset: Dataset, *, batch_size: int, shuffle: bool = True, seed: int = 0,
          drop_last: bool = False, rank: int | None = None, world_size: int | None = None,
          **loader_kw: Any) -> DataLoader:
    """A ``DataLoader`` over this rank's share of ``dataset`` (see the module docstring).

    ``loader_kw`` goes to ``DataLoader`` (``num_workers``, ``collate_fn``, ``pin_memory`` …);
    ``sampler`` and ``shuffle`` there are refused because the sampler is the point.
    Raises ``ValueError`` for a bad batch size, rank or keyword.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be an int >= 1 (samples per rank per step)")
    for refused in ("sampler", "batch_sampler"):
        if refused in loader_kw:
            raise ValueError(f"shard() makes the sampler itself; drop {refused}={loader_kw[refused]!r}")
    rank, world_size = _resolve(rank, world_size)
    balancer = balancer_for(current_session().known_context().strategy, rank, world_size)
    if balancer is not None:
        refused = sorted(set(loader_kw) - {"collate_fn"})
        if refused:
            raise ValueError(f"balanced shards (strategy balance: throughput) take only collate_fn; drop {refused}")
        return BalancedLoader(dataset, batch_size=batch_size, balancer=balancer, shuffle=shuffle, seed=seed,
                              drop_last=drop_last, **loader_kw)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle,
                                 seed=seed, drop_last=drop_last)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **loader_kw)


def shard_indices(num_samples: int, *, rank: int | None = None, world_size: int | None = None,
                  shuffle: bool = False, seed: int = 0, epoch: int = 0, pad: bool = True) -> list[int]:
    """Indices of ``range(num_samples)`` for ``rank``: ``DistributedSampler``'s split when ``pad``.

    ``pad=True`` repeats leading indices so every rank gets ``ceil(n / world)``;
    ``pad=False`` gives each index to exactly one rank (sizes differ by at most one).
    Pure apart from reading the context for defaults. Raises ``ValueError`` for bad arguments.
    """
    if num_samples < 0:
        raise ValueError(f"num_samples={num_samples} must be >= 0")
    rank, world_size = _resolve(rank, world_size)
    if shuffle:
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)  # the same seed rule as DistributedSampler
        order = torch.randperm(num_samples, generator=generator).tolist()
    else:
        order = list(range(num_samples))
    if pad and num_samples:
        total = math.ceil(num_samples / world_size) * world_size
        repeats = math.ceil((total - num_samples) / num_samples) if total > num_samples else 0
        order = (order + order * repeats)[:total]
    return order[rank::world_size]
