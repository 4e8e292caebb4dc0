"""SyncOptimizer.per_replica_tensors: what a checkpoint must keep once per rank, per strategy and step.

No process group is needed: the steps used here (before the first sync point) do not
communicate, and ``per_replica_tensors`` never does.
"""
from __future__ import annotations

import pytest
import torch

from torchrelay.spec import DDPStrategy, DiLoCoStrategy, FinalAverageStrategy, LocalSGDStrategy
from torchrelay.train.sync import Collective, SyncOptimizer, build_rules

pytestmark = pytest.mark.timeout(60)

STRATEGIES = {
    "ddp": DDPStrategy(),
    "local_sgd": LocalSGDStrategy(kind="local_sgd", every=4),
    "diloco": DiLoCoStrategy(kind="diloco", every=4),
    "final_average": FinalAverageStrategy(kind="final_average"),
}


def _prepared(kind: str, world_size: int, steps: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    inner = torch.optim.Adam(model.parameters(), lr=0.01)
    comm = Collective(world_size)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = SyncOptimizer(inner, kind=kind, rules=build_rules(STRATEGIES[kind], params, comm), comm=comm,
                              model=model)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(8, 3)).pow(2).mean().backward()
        optimizer.step()
    return model, inner, optimizer


def _ids(tensors) -> set[int]:
    return {id(t) for t in tensors}


@pytest.mark.parametrize("kind, world_size, steps, params, state, buffers", [
    # ddp: replicas equal after every step; a world of 1 has nothing to keep apart
    ("ddp", 2, 2, False, False, False),
    ("local_sgd", 1, 2, False, False, False),
    # between sync points: everything that trains locally
    ("local_sgd", 2, 2, True, True, True),
    ("diloco", 2, 3, True, True, True),
    ("final_average", 2, 2, True, True, True),
    # before the first step: no optimizer state yet
    ("local_sgd", 2, 0, False, False, True),
])
def test_per_replica_tensors(kind, world_size, steps, params, state, buffers):
    model, inner, optimizer = _prepared(kind, world_size, steps)
    got = _ids(optimizer.per_replica_tensors())
    want = set()
    if params:
        want |= _ids(model.parameters())
    if state:
        want |= _ids(t for s in inner.state.values() for t in s.values())
    if buffers:
        want |= _ids(model.buffers())
    assert got == want


def test_parameters_are_shared_right_after_a_sync_and_the_rest_stays_per_rank():
    model, inner, optimizer = _prepared("local_sgd", 2, 2)
    for rule in optimizer.rules:
        rule.synced_at = optimizer.steps_done  # as a sync point (or final_average's checkpoint average) leaves it
    got = _ids(optimizer.per_replica_tensors())
    assert not got & _ids(model.parameters())
    assert got == _ids(t for s in inner.state.values() for t in s.values()) | _ids(model.buffers())


def test_diloco_global_parameters_and_outer_momentum_are_not_per_rank():
    _, _, optimizer = _prepared("diloco", 2, 3)
    rule = optimizer.rules[0]
    got = _ids(optimizer.per_replica_tensors())
    assert not got & _ids(rule.global_params)
    assert not got & _ids(t for s in rule.outer_optimizer.state.values() for t in s.values())
