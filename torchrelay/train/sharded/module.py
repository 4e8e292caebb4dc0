"""``ShardedModule``: what ``prepare`` returns under fsdp, and ``full_state_dict`` for the whole model.

Contract:
- ``ShardedModule(root)`` holds the FSDP root as ``.module`` (DDP's surface: ``rt.unwrap``
  finds the user's model there, and ``state_dict()`` keys carry the same ``module.`` prefix as
  DDP's, so checkpoints move between ddp and fsdp jobs). ``state_dict()`` gives each rank's
  shards as DTensors (a checkpoint writes each shard once, from its rank).
- ``load_state_dict(state)`` takes either such shards (any world size's: DCP reshards on load)
  or whole tensors (a loaded checkpoint, a ddp job's, ``full_state_dict``'s); each rank keeps
  its own slices (``torch.distributed.checkpoint.state_dict.set_model_state_dict``). Collective.
- ``no_sync()`` skips the gradient reduce-scatter inside it (gradient accumulation), as DDP's.
- ``full_state_dict(inner)`` (``rt.full_state_dict(model)`` unwraps first): the whole model
  gathered to rank 0 only, on CPU, keys of the user's model (no prefix); ``{}`` on the other ranks. Collective; call it only when the full
  model is wanted (an artifact), since rank 0 then holds all of it. Works for any prepared
  model (a ddp one's is its own state dict).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from torchrelay.train.wrapped import WrappedModule

__all__ = ["ShardedModule", "full_state_dict", "has_dtensors"]

PREFIX = "module."


def has_dtensors(values: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(v, DTensor) for v in values)


class ShardedModule(WrappedModule):
    """The FSDP root with DDP's surface (see the module docstring)."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):  # type: ignore[override]
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        inner = {k.removeprefix(PREFIX): v for k, v in state_dict.items()}
        options = StateDictOptions(full_state_dict=not has_dtensors(inner.values()), strict=strict)
        return set_model_state_dict(self.module, inner, options=options)


def full_state_dict(inner: nn.Module) -> dict[str, torch.Tensor]:
    """The whole state dict of ``inner`` (the user's model, unwrapped: ``rt.full_state_dict`` unwraps)
    on rank 0 (CPU), ``{}`` elsewhere. Collective for a sharded model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if not has_dtensors(inner.parameters()):
        return {k: v.detach().cpu() for k, v in inner.state_dict().items()} if rank == 0 else {}
    return get_model_state_dict(inner, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
