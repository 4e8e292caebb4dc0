"""The pre-flight memory check of ``prepare``: refuse, with the figures, a model whose training state
cannot fit the memory each worker was given.

Contract:
- ``memory_limit(env)``: bytes per worker from ``RELAY_MEMORY_PER_WORKER`` (the server sets it
  from the job's ``resources.memory``); 0 when unset (no check). Raises ``InvalidSpec`` for a
  value that is not a size.
- ``estimate(model, optimizer, strategy, world_size)``: one rank's ``MemoryFigures`` (parameters,
  gradients, optimizer state; ``train.memory``) under ``strategy`` — whole under ddp, local SGD
  and the like (ddp adds its gradient buckets), sharded under fsdp — from the model's parameter
  sizes and the optimizer's class. Reads sizes only; works on meta-device models.
- ``preflight(model, optimizer, strategy, world_size, env)``: ``check_fits`` of that estimate plus
  what the process holds besides training (its resident memory now, less the model's tensors
  already on the CPU: the interpreter, torch, data; a cgroup limit counts them too) against
  ``memory_limit``; raises ``InsufficientMemory`` naming the figures, the limit, and what fsdp
  would need on the same workers. Does not communicate (ranks may differ by their baselines).
"""
from __future__ import annotations

import os
from typing import Any, Mapping

from torch import nn

from torchrelay.errors import InvalidSpec
from torchrelay.spec import parse_memory
from torchrelay.train.memory import MemoryFigures, check_fits, estimate_training_state, optimizer_state_factor
from torchrelay.train.sharded.fsdp import largest_unit_bytes
from torchrelay.train.sharded.units import find_units

__all__ = ["MEMORY_VAR", "estimate", "memory_limit", "preflight", "process_baseline", "resident_bytes"]

MEMORY_VAR = "RELAY_MEMORY_PER_WORKER"


def memory_limit(env: Mapping[str, str]) -> int:
    raw = env.get(MEMORY_VAR)
    if not raw:
        return 0
    try:
        return parse_memory(raw)
    except InvalidSpec:
        raise InvalidSpec(f"environment variable {MEMORY_VAR}={raw!r} is not a size (bytes, or e.g. '2GiB')") from None


def estimate(model: nn.Module, optimizer: Any, strategy: Any, world_size: int) -> MemoryFigures:
    params = list(model.parameters())
    parameter_bytes = sum(p.numel() * p.element_size() for p in params)
    trainable_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    factor, _note = optimizer_state_factor(type(optimizer).__name__, getattr(optimizer, "defaults", {}))
    kind = getattr(strategy, "kind", "ddp")
    if kind != "fsdp" or world_size == 1:
        return estimate_training_state(parameter_bytes=parameter_bytes, trainable_bytes=trainable_bytes,
                                       optimizer_factor=factor, ddp_buckets=kind == "ddp" and world_size > 1)
    wrap = strategy.wrap if strategy.wrap == "auto" else tuple(strategy.wrap)
    units, _notes = find_units(model, wrap)
    return estimate_training_state(parameter_bytes=parameter_bytes, trainable_bytes=trainable_bytes,
                                   largest_unit_bytes=largest_unit_bytes(model, units),
                                   optimizer_factor=factor, shards=world_size)


def resident_bytes() -> int:
    """This process's resident memory now (Linux ``/proc/self/statm``); 0 where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def process_baseline(model: nn.Module) -> int:
    """What the process holds besides training: resident memory less the model's tensors on the CPU."""
    held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())
               if t.device.type == "cpu")
    return max(0, resident_bytes() - held)


def preflight(model: nn.Module, optimizer: Any, strategy: Any, world_size: int,
              env: Mapping[str, str], baseline: int | None = None) -> MemoryFigures | None:
    """The estimate when a limit is set (None otherwise); raises ``InsufficientMemory`` when it, plus
    ``baseline`` (default: ``process_baseline(model)``, measured), is over."""
    limit = memory_limit(env)
    if not limit:
        return None
    figures = estimate(model, optimizer, strategy, world_size)
    kind = getattr(strategy, "kind", "ddp")
    sharded = None
    if kind != "fsdp" and world_size > 1:
        from torchrelay.spec import FSDPStrategy

        sharded = estimate(model, optimizer, FSDPStrategy(kind="fsdp"), world_size)
    check_fits(figures, limit, strategy=kind, workers=world_size, sharded=sharded,
               baseline=process_baseline(model) if baseline is None else baseline)
    return figures
