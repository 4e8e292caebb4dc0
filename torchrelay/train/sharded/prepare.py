"""``prepare`` under ``strategy: {kind: fsdp}``: the steps in torchtitan's order, then the library's hooks.

1. the mesh: ``dp × tp`` over the job's ranks (layout.py), built with ``init_device_mesh``;
2. rank 0's parameters and buffers broadcast (replicas start equal, as under DDP);
3. tensor parallel on the ``tp`` dimension (``apply_tensor_parallel``), when ``tensor_parallel > 1``;
4. FSDP on the ``dp`` dimension (``apply_fsdp``); on CPU workers glibc's mmap threshold, 1 MiB
   while the model is sharded, then the smallest unit shard of at least 1 MiB (allocator.py);
5. the optimizer pointed at the shards (optimizer.py), the memory meter attached, and what
   this rank holds gathered to rank 0, printed and saved as the artifact ``sharded-layout.json``
   (``relay status`` shows it).

Collective: every rank calls it with the same model structure. Returns ``(ShardedModule,
ShardedOptimizer)``. Raises ``InvalidSpec`` for a mesh the workers do not fill, a tensor-parallel
plan that cannot split the model, mixed precision the device lacks, a model on the meta device
(the pipeline with ``data_parallel: fsdp`` materialises meta blocks one at a time, stages.py;
here the script builds the model).
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torchrelay.errors import InvalidSpec
from torchrelay.train import allocator
from torchrelay.train.memory_meter import MemoryMeter, local_bytes
from torchrelay.train.sharded.config import configs_of
from torchrelay.train.sharded.fsdp import apply_fsdp, largest_unit_bytes, unit_shard_bytes
from torchrelay.train.sharded.layout import Holding, MeshShape, layout_dict, mesh_shape
from torchrelay.train.sharded.module import ShardedModule
from torchrelay.train.sharded.optimizer import ShardedOptimizer, parameter_names, rebuild_optimizer
from torchrelay.train.sharded.tensor_parallel import apply_tensor_parallel, tensor_parallel_plan

__all__ = ["LAYOUT_FILE", "build_mesh", "prepare", "publish_layout"]

LAYOUT_FILE = "sharded-layout.json"


def build_mesh(shape: MeshShape, device_type: str) -> Any:
    """The ``DeviceMesh`` of ``shape`` with its named dimensions, in ``MeshShape``'s rank order. Collective."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (shape.dp, shape.pp, shape.tp), mesh_dim_names=("dp", "pp", "tp"))


def prepare(model: nn.Module, optimizer: torch.optim.Optimizer, strategy: Any,
            ctx: Any) -> tuple[ShardedModule, ShardedOptimizer]:
    """Shard ``model`` and rebuild ``optimizer`` per ``strategy`` (see the module docstring). Collective."""
    fsdp_config, tp_config = configs_of(strategy)
    shape = mesh_shape(ctx.world_size, tensor_parallel=tp_config.degree)
    device = torch.device(ctx.device)
    names = parameter_names(model)
    if any(p.device.type == "meta" for p in model.parameters()):
        raise InvalidSpec("fsdp: the model is on the meta device; build it on the CPU before prepare(), or use "
                          "the pipeline with data_parallel: fsdp, which materialises meta blocks one at a time")
    if device.type == "cpu":  # freed buffers go back to the kernel (allocator.py: measured)
        allocator.return_large_allocations()
    model = model.to(device)
    if ctx.world_size > 1:
        # tensor by tensor, not flattened into one buffer as train.sync does: a flat copy of the whole
        # model would double the memory this very strategy exists to save, at its peak
        for tensor in (*model.parameters(), *model.buffers()):
            dist.broadcast(tensor.data, src=0)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    mesh = build_mesh(shape, device.type)
    tp_modules: list[str] = []
    if shape.tp > 1:
        tp_modules = apply_tensor_parallel(model, mesh["tp"], tensor_parallel_plan(model, shape.tp))
    units, notes = apply_fsdp(model, mesh["dp"], fsdp_config, device.type)
    if device.type == "cpu":  # buffers below the units' shards are reused, not faulted in (allocator.py)
        allocator.return_large_allocations(allocator.shard_threshold_bytes(unit_shard_bytes(model, units)))
    gathered = largest_unit_bytes(model, units) // max(1, shape.tp) if shape.dp > 1 else 0
    inner = rebuild_optimizer(optimizer, names, model)
    meter = MemoryMeter(model, inner, gathered_bytes=gathered)
    holding = Holding(rank=ctx.rank, coordinates=shape.coordinates(ctx.rank), units=tuple(units),
                      parameter_bytes=local_bytes(model.parameters()), full_parameter_bytes=full_bytes,
                      tensor_parallel_modules=tuple(tp_modules), notes=tuple(notes))
    publish_layout(shape, holding, ctx.rank)
    return ShardedModule(model), ShardedOptimizer(inner, model=model, meter=meter)


def publish_layout(shape: MeshShape, holding: Holding, rank: int, env: Any = os.environ) -> dict | None:
    """Gather every rank's ``Holding`` to rank 0, which prints the layout and saves it as the job's
    artifact ``sharded-layout.json`` (inside a torchrelay job). Collective; rank 0's dict, else None."""
    holdings: list[Any] = [holding]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        holdings = [None] * dist.get_world_size()
        dist.all_gather_object(holdings, holding)
    if rank != 0:
        return None
    body = layout_dict(shape, holdings)
    print(body["text"], flush=True)
    if env.get("RELAY_JOB_ID"):
        from torchrelay.train.artifacts import save_artifact

        save_artifact(LAYOUT_FILE, json.dumps(body, indent=2).encode())
    return body
