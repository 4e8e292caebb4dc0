"""Where each rank loads a ``TrainState`` checkpoint's tensors under sharding: its own shards only.

``shard_target(model, optimizer)`` is the ``target`` of a sharded load (checkpoint_dcp's
``SafeLoadPlanner``) for the state ``TrainState`` saves, or None when the model holds no
DTensors (ddp and the other replicated strategies load whole tensors, as before).

Contract: for a saved tensor at path

- ``("model", key)`` where ``model.state_dict()[key]`` is a DTensor (an fsdp or tensor-parallel
  parameter, ``module.``-prefixed as ``ShardedModule`` names them), or
- ``("optimizer", "inner", "state", name, kind)`` where ``name`` is a DTensor parameter of the
  unwrapped model (``model.module``; ``get_optimizer_state_dict`` keys its state by those
  names) and the state tensor has the parameter's shape (Adam's moments, SGD's momentum),

with the same global shape as saved, the target is a fresh empty DTensor like that parameter
(same mesh and placements, the saved dtype): DCP plans reads of this rank's slices only and
reshards from whatever world size saved it. Anything else (buffers, Adam's step counts, a ddp
checkpoint's optimizer state keyed by index, a shape that differs) is None: read whole, as
``load_state_dict`` then expects. Fresh tensors, never the live parameters, so a checkpoint
that turns out damaged halfway leaves the model as it was. Pure apart from allocating.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchrelay.train.checkpoint_dcp import LoadTarget

__all__ = ["shard_target"]

OPTIMIZER_STATE = ("optimizer", "inner", "state")


def _dtensors(items: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {name: t for name, t in items if isinstance(t, DTensor)}


def shard_target(model: nn.Module, optimizer: Any = None) -> LoadTarget | None:
    """The load target for ``TrainState(model, optimizer)``'s checkpoints, or None (see the module docstring)."""
    model_tensors = _dtensors(model.state_dict().items())
    if not model_tensors:
        return None
    inner = getattr(model, "module", model)
    parameters = _dtensors(inner.named_parameters()) if optimizer is not None else {}

    def target(path: tuple, stored: Any) -> torch.Tensor | None:
        like = None
        if len(path) == 2 and path[0] == "model":
            like = model_tensors.get(path[1])
        elif len(path) == 5 and tuple(path[:3]) == OPTIMIZER_STATE:
            like = parameters.get(path[3])
        if like is None or tuple(like.shape) != tuple(stored.size):
            return None
        return torch.empty_like(like, dtype=stored.properties.dtype, requires_grad=False)

    return target
