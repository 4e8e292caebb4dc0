"""Pipeline stages sharded over their replicas: ``data_parallel: fsdp`` in torchtitan's order.

``shard_stage_blocks(blocks, own, dp_group, device, seed, materialize)`` takes this rank's
blocks of a plan (``own``: block index -> module, on the meta device or not) and, block by
block: a meta block is copied (the copy costs nothing), ``fully_shard`` over the stage's
replicas (a 1-D mesh made from ``dp_group``), allocated shard-sized (``to_empty``), and filled
from the copy materialised whole on the CPU (``materialize(copy, seed + i)``, the pipeline's
own rule), each rank keeping its slices (``fill_from_full``): so at most one block is whole in
memory at a time, and the weights equal the unsplit model's. A block already on a device is
moved there and sharded as it is. Collective over ``dp_group``.

Each sharded block is its own FSDP root: the pipeline runtime runs blocks one after another
per micro-batch, and each block reduce-scatters its gradients in backward, averaged over the
replicas (so the runtime must not average them again: ``prepare`` passes it no ``dp_group``);
on CPU workers with pairwise exchanges, as ``apply_fsdp`` does (pairwise.py).
``stage_holding`` is what this rank holds, for the layout ``relay status`` shows.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn

from torchrelay.train.memory_meter import local_bytes
from torchrelay.train.sharded.layout import Holding, MeshShape

__all__ = ["fill_from_full", "shard_stage_blocks", "stage_holding"]


def fill_from_full(sharded: nn.Module, full: nn.Module) -> None:
    """Each rank keeps its slices of ``full``'s parameters and buffers in ``sharded``. Collective over its mesh."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(sharded, full.state_dict(), options=StateDictOptions(full_state_dict=True))
    with torch.no_grad():
        for name, buffer in full.named_buffers():  # non-persistent ones are not in the state dict
            sharded.get_buffer(name).copy_(buffer)


def shard_stage_blocks(own: dict[int, nn.Module], dp_group: Any, device: torch.device, seed: int,
                       materialize: Callable[[nn.Module, int], nn.Module],
                       mesh: Any = None) -> tuple[dict[int, nn.Module], list[str]]:
    """``own`` with every block sharded over ``dp_group`` (see the module docstring), and the linears split
    by tensor parallel (``"<block>.<name>"``). With ``mesh`` (the pipeline's (dp, pp, tp) mesh, tensor
    parallel) each block's attention and MLP linears are first split over ``mesh["tp"]``, then the block is
    sharded over ``mesh["dp"]``: a meta block is split and sharded on meta and only then materialised."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from torchrelay.train.exchange import agreed
    from torchrelay.train.sharded import pairwise
    from torchrelay.train.sharded.tensor_parallel import apply_tensor_parallel, tensor_parallel_plan

    tp = mesh["tp"].size() if mesh is not None else 1
    dp_mesh = mesh["dp"] if mesh is not None else DeviceMesh.from_group(dp_group, device.type,
                                                                         mesh_dim_names=("dp",))
    split: list[str] = []
    exchanges = agreed(on_cpu=device.type == "cpu", group=dp_mesh.get_group())  # once for all blocks
    for i, block in own.items():
        on_meta = any(p.device.type == "meta" for p in block.parameters())
        template = copy.deepcopy(block) if on_meta else None
        if not on_meta:
            block.to(device)
        plan = tensor_parallel_plan(block, tp, allow_empty=True) if tp > 1 else {}
        if plan:
            split += [f"{i}.{name}" for name in apply_tensor_parallel(block, mesh["tp"], plan)]
        fully_shard(block, mesh=dp_mesh)
        if exchanges:
            pairwise.install(block)
        if template is not None:
            block.to_empty(device=device)
            fill_from_full(block, materialize(template, seed + i))
    return own, split


def stage_holding(rank: int, shape: MeshShape, own: dict[int, nn.Module], full_bytes: int,
                  split: list[str] = ()) -> Holding:
    return Holding(rank=rank, coordinates=shape.coordinates(rank),
                   blocks=tuple(f"{i}:{type(b).__name__}" for i, b in sorted(own.items())),
                   units=tuple(str(i) for i in sorted(own)),
                   parameter_bytes=local_bytes(p for b in own.values() for p in b.parameters()),
                   full_parameter_bytes=full_bytes, tensor_parallel_modules=tuple(split))
