"""``apply_fsdp``: shard a model's parameters over a 1-D mesh with FSDP2 (``fully_shard``), unit by unit.

Contract:
- Each unit of ``find_units`` (units.py) gets its own ``fully_shard``, then the root, which holds
  what no unit took (and makes the model callable as one FSDP module). In place; returns the
  unit names and the notes of ``find_units``.
- ``reshard_after_forward`` as configured, except for the last unit: backward starts with it at
  once, so freeing it after forward would only gather it again (torchtitan does the same).
- Mixed precision (``config.mixed_precision_dtypes``): parameters in bf16/fp16 for compute,
  gradients reduced in float32, the sharded parameters and the optimizer stay float32.
- CPU workers (gloo): the units' all-gathers and reduce-scatters are pairwise exchanges
  (pairwise.py: gloo's own take 1.5–2 times as long) when every rank is on CPU, unless
  ``RELAY_PAIRWISE=0``.
- ``offload``: FSDP2's ``CPUOffloadPolicy`` (sharded parameters, gradients and the optimizer
  step in CPU memory; gathered to the device per unit). On CPU workers it changes nothing and
  is not applied.
- ``largest_unit_bytes(model, units)``: the most bytes any one unit (or the root's own
  parameters) gathers at once, for the memory figures.
- ``unit_shard_bytes(model, units)``: the bytes of each unit's shard on this rank (the root's
  own parameters last), after ``apply_fsdp``; ``prepare`` derives glibc's mmap threshold from them.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchrelay.train.memory_meter import local_bytes
from torchrelay.train.sharded.config import FSDPConfig, mixed_precision_dtypes
from torchrelay.train.sharded.pairwise import use_pairwise
from torchrelay.train.sharded.units import find_units

__all__ = ["apply_fsdp", "largest_unit_bytes", "unit_shard_bytes"]


def _bytes(params: Any) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _root_own_parameters(model: nn.Module, units: list[str]) -> list[nn.Parameter]:
    """The parameters no unit holds: what the root's own ``fully_shard`` gathers."""
    in_units = {id(p) for u in units for p in model.get_submodule(u).parameters()}
    return [p for p in model.parameters() if id(p) not in in_units]


def largest_unit_bytes(model: nn.Module, units: list[str]) -> int:
    """Bytes of the largest gathered unit (full sizes: a DTensor counts its global shape)."""
    root = _bytes(_root_own_parameters(model, units))
    return max([root, *(_bytes(model.get_submodule(u).parameters()) for u in units)])


def unit_shard_bytes(model: nn.Module, units: list[str]) -> list[int]:
    """Bytes of each unit's parameters on this rank (DTensors count their local shard), then the root's own."""
    return [*(local_bytes(model.get_submodule(u).parameters()) for u in units),
            local_bytes(_root_own_parameters(model, units))]


def apply_fsdp(model: nn.Module, mesh: Any, config: FSDPConfig, device_type: str) -> tuple[list[str], list[str]]:
    """Shard ``model`` over ``mesh`` in place (see the module docstring); (unit names, notes)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    units, notes = find_units(model, config.wrap)
    kwargs: dict[str, Any] = {"mesh": mesh}
    dtypes = mixed_precision_dtypes(config.mixed_precision, device_type)
    if dtypes is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtypes[0], reduce_dtype=dtypes[1])
    if config.offload and device_type != "cpu":
        kwargs["offload_policy"] = CPUOffloadPolicy()
    elif config.offload:
        notes.append("offload_optimizer: the workers run on CPU, where the state already lies")
    for i, name in enumerate(units):
        last = i == len(units) - 1
        fully_shard(model.get_submodule(name), reshard_after_forward=config.reshard_after_forward and not last,
                    **kwargs)
    fully_shard(model, reshard_after_forward=config.reshard_after_forward, **kwargs)
    use_pairwise(model, mesh.get_group(), on_cpu=device_type == "cpu")
    return units, notes


