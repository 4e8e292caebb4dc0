"""A DataLoader worker's hand-off (``stream_data._pack``/``_unpack``): what a collated batch
is made of comes back the same, with its tensors as tensors, through pickle (the worker's pipe)."""
from __future__ import annotations

import pickle
from collections import Counter, OrderedDict, namedtuple

import pytest
import torch

from torchrelay.train.stream_data import _Array, _pack, _unpack

Pair = namedtuple("Pair", "x y")

CASES = [
    torch.arange(6, dtype=torch.float32).reshape(2, 3),
    (torch.ones(2, 2), torch.tensor([1, 2])),
    [torch.zeros(3), ["a", "b"]],
    {"x": torch.ones(2), "meta": {"ids": torch.tensor([7, 8]), "name": ["p", "q"]}},
    OrderedDict(x=torch.ones(1)),
    Counter(a=3),  # another dict type
    Pair(torch.ones(2), torch.tensor([3, 4])),
    torch.ones(2, dtype=torch.bfloat16),  # no numpy dtype: crosses as a tensor
    [(Pair(torch.ones(1), 5), {0: 12})],  # a chunk: (batch, consumed offsets) pairs
]


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("batch", CASES)
def test_a_batch_comes_back_the_same(batch):
    assert same(batch, _unpack(pickle.loads(pickle.dumps(_pack(batch)))))


def test_tensors_cross_as_arrays_not_shared_memory():
    packed = _pack((torch.ones(2), torch.ones(2, dtype=torch.bfloat16)))
    assert isinstance(packed[0], _Array) and isinstance(packed[1], torch.Tensor)
