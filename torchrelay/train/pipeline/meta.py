"""Model as a list of blocks, built on the meta device, materialised one stage at a time.

Contract:
- ``as_blocks(model)`` accepts an ``nn.Sequential``, a ``ModuleList`` or a list of modules
  and returns the list of blocks; ``transformer_blocks(embedding, blocks, head)`` turns a
  transformer's parts into that list (``head`` may be a tuple such as (final norm, linear)).
  Every block must map one tensor to one tensor.
- ``build_on_meta(factory)`` calls ``factory()`` with the meta device as default: no memory
  is spent on weights.
- ``materialize_module(module, device, seed)`` allocates a meta module's tensors on ``device``
  and initialises them with ``reset_parameters()`` of each submodule under
  ``torch.manual_seed(seed)``: the same ``seed`` gives the same weights whichever process
  does it, so stage ``k`` materialising block ``i`` with ``seed0 + i`` reproduces the
  unsplit model built the same way. Raises ``ValueError`` naming a submodule that owns
  parameters but has no ``reset_parameters``.
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
from torch import nn


def as_blocks(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    """The blocks of ``model`` in order. Raises ``TypeError`` for anything else."""
    if isinstance(model, (nn.Sequential, nn.ModuleList)):
        return list(model)
    if isinstance(model, (list, tuple)) and all(isinstance(m, nn.Module) for m in model):
        return list(model)
    raise TypeError(f"pipeline model must be an nn.Sequential, an nn.ModuleList or a list of "
                    f"modules, not {type(model).__name__}")


def transformer_blocks(embedding: nn.Module, blocks: Iterable[nn.Module],
                       head: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    """[embedding, *blocks, head] with a tuple head wrapped into one ``nn.Sequential``."""
    if not isinstance(head, nn.Module):
        head = nn.Sequential(*head)
    return [embedding, *list(blocks), head]


def build_on_meta(factory: Callable[[], object]):
    """``factory()`` with every new tensor on the meta device (no weight memory spent)."""
    with torch.device("meta"):
        return factory()


def is_on_meta(module: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in [*module.parameters(), *module.buffers()])


def materialize_module(module: nn.Module, device: torch.device | str, seed: int) -> nn.Module:
    """Allocate ``module`` (on meta) on ``device`` and initialise it reproducibly; returns it.

    Initialised on the CPU under ``seed`` and then moved, so a block's weights do not depend
    on the device it lands on (a GPU's random numbers differ from the CPU's for one seed):
    a stage on a GPU holds the same weights as the unsplit model built on the CPU. The cost:
    each block passes through host memory once, initialised by the CPU."""
    for sub in module.modules():
        owns = any(True for _ in sub.parameters(recurse=False))
        if owns and not hasattr(sub, "reset_parameters"):
            raise ValueError(f"cannot initialise {type(sub).__name__} after meta construction: "
                             f"it owns parameters but has no reset_parameters(); add one")
    module.to_empty(device="cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for sub in module.modules():
            if hasattr(sub, "reset_parameters") and any(True for _ in sub.parameters(recurse=False)):
                sub.reset_parameters()
    return module.to(device)
