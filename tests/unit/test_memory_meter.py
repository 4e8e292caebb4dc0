"""``local_bytes`` and ``MemoryMeter`` on real tensors and modules (no processes), and the parameter server's
shard figures (``ps.server.shard_memory``), pure, from plans."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from torchrelay.train.memory import MemoryFigures
from torchrelay.train.memory_meter import MemoryMeter, local_bytes
from torchrelay.train.ps.plan import ParamSpec, make_plan
from torchrelay.train.ps.server import shard_memory

FLAT = torch.zeros(64)


@pytest.mark.parametrize("tensors, expected", [
    ([torch.zeros(4), torch.zeros(6)], 40),
    ([FLAT[:16], FLAT[16:48], FLAT[48:]], 256),          # views of one flat buffer: each counts
    ([FLAT[:16], FLAT[:16]], 64),                        # the same tensor twice (a shared weight): once
    ([torch.zeros(3, dtype=torch.float64), "not a tensor"], 24),
    ([torch.empty(8, device="meta")], 0),                # nothing allocated
    ([], 0),
])
def test_local_bytes(tensors, expected) -> None:
    assert local_bytes(tensors) == expected


def test_meter_without_optimizer_state_and_with_staging() -> None:
    """A parameter-server worker: no optimizer state here, its parameters are views of one buffer."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    flat = torch.zeros(sum(p.numel() for p in model.parameters()))
    offset = 0
    for p in model.parameters():
        p.data = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    meter = MemoryMeter(model, None, staging=MemoryFigures(parameters=100, gradients=10))
    model(torch.randn(5, 4)).sum().backward()
    figures = meter.figures()
    assert figures.parameters == flat.numel() * 4 + 100
    assert figures.gradients == flat.numel() * 4 + 10
    assert figures.optimizer_state == 0 and figures.activations > 0
    meter.close()


@pytest.mark.parametrize("servers, optimizer_buffers", [(1, 2), (2, 2), (3, 1), (2, 0)])
def test_shard_memory_is_the_shards_parameters_and_optimizer_buffers(servers, optimizer_buffers) -> None:
    plan = make_plan([ParamSpec("w", "float32", (100, 10)), ParamSpec("b", "float32", (10,))], servers)
    names = ("exp_avg", "exp_avg_sq")[:optimizer_buffers] if optimizer_buffers != 1 else ("momentum_buffer",)
    shards = [plan.shard(i) for i in range(servers)]
    figures = [shard_memory(s, names) for s in shards]
    assert sum(f.parameters for f in figures) == plan.total_nbytes  # the shards hold the model between them
    for shard, f in zip(shards, figures):
        assert f.optimizer_state == shard.nbytes * optimizer_buffers + 4 * len(shard.segments)
        assert f.gradients == 0 and f.activations == 0
