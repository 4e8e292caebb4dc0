"""Datasets as shard files in any store: the format, the packer, and who reads which samples.

Rooms (each imports only those below it, plus ``torchrelay.storage`` and ``torchrelay.errors``):
- ``pack``: ``pack(samples, dest, shard_size=…)`` writes a dataset as shards and an index
  (``relay data pack`` calls it).
- ``format``: pure: the index (``index.json``), shard names, sizes like ``64MiB``, samples as
  columns of tensors.
- ``plan``: pure: which samples each rank reads in an epoch (exactly once across ranks), and
  the order a shuffle buffer gives them.

Reading them in training is ``torchrelay.train.stream`` (``rt.stream``). docs/datasets.md.
"""
from torchrelay.shards.format import ShardIndex, parse_size
from torchrelay.shards.pack import pack

__all__ = ["ShardIndex", "pack", "parse_size"]
