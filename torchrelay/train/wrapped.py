"""``WrappedModule``: the surface every model ``prepare`` returns shares with DDP's.

``.module`` is the user's model, ``forward`` calls it, and ``state_dict()`` keys carry the
``module.`` prefix DDP's do, so a checkpoint moves between strategies and world sizes. The
strategies' wrappers subclass it (``context.LocalModule``: ddp in a world of 1;
``sharded.module.ShardedModule``: fsdp) and add ``no_sync()``. Imports no other module of
``torchrelay.train``.
"""
from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["WrappedModule"]


class WrappedModule(nn.Module):
    """The user's model as ``.module`` (see the module docstring)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)
