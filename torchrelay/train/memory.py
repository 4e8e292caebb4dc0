"""Memory of training as figures: what each rank holds, estimated before training. Pure.

- ``MemoryFigures`` — bytes of parameters, gradients, optimizer state and activations on one
  rank; ``training_state`` is the first three (what sharding divides); ``as_metrics()`` gives
  the ``memory_*`` keys a strategy's ``metrics()`` reports.
- ``optimizer_state_factor(name, defaults)`` — bytes of optimizer state per byte of trainable
  parameters for torch's optimizers (Adam: 2, SGD with momentum: 1, …); an optimizer it does
  not know counts as 2 (Adam's), and the returned note says so.
- ``estimate_training_state(...)`` — one rank's figures under ``ddp`` (everything whole, plus
  DDP's gradient buckets, a second copy of the gradients) or under sharding over ``shards``
  ranks (1/shards of each, plus the largest unit gathered whole: "one unit in flight").
- ``check_fits(...)`` — raises ``InsufficientMemory`` with the figures when the estimate, plus what
  the process holds besides training, is above the worker's memory (``resources.memory``,
  reaching the worker as ``RELAY_MEMORY_PER_WORKER``; the agent enforces it with cgroups, which
  count the whole process), and names what would fit. Activations are not in the estimate (they depend on the batch);
  the runtime figures (``train.memory_meter``) report them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from torchrelay.errors import InsufficientMemory
from torchrelay.spec import format_memory

__all__ = ["MemoryFigures", "check_fits", "estimate_training_state", "optimizer_state_factor"]


@dataclass(kw_only=True, slots=True, frozen=True)
class MemoryFigures:
    """Bytes on one rank."""

    parameters: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    activations: int = 0

    @property
    def training_state(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def total(self) -> int:
        return self.training_state + self.activations

    def as_metrics(self) -> dict[str, float]:
        return {"memory_parameters": float(self.parameters), "memory_gradients": float(self.gradients),
                "memory_optimizer_state": float(self.optimizer_state), "memory_activations": float(self.activations),
                "memory_training_state": float(self.training_state)}

    def text(self) -> str:
        return (f"parameters {format_memory(self.parameters)}, gradients {format_memory(self.gradients)}, "
                f"optimizer state {format_memory(self.optimizer_state)}")


def optimizer_state_factor(name: str, defaults: Mapping[str, object]) -> tuple[float, str | None]:
    """(state bytes per trainable parameter byte, a note or None) for torch optimizer class ``name``."""
    if name in ("Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adadelta"):
        return (3.0 if defaults.get("amsgrad") else 2.0), None
    if name == "SGD":
        return (1.0 if defaults.get("momentum") else 0.0), None
    if name == "RMSprop":
        return 1.0 + bool(defaults.get("momentum")) + bool(defaults.get("centered")), None
    if name in ("Adagrad", "ASGD", "Rprop"):
        return (2.0 if name == "Rprop" else 1.0), None
    return 2.0, f"optimizer {name} is not one torchrelay knows: its state counted as Adam's (2 × parameters)"


def estimate_training_state(*, parameter_bytes: int, trainable_bytes: int, largest_unit_bytes: int = 0,
                            optimizer_factor: float, shards: int = 1, ddp_buckets: bool = False) -> MemoryFigures:
    """One rank's parameters, gradients and optimizer state (see the module docstring)."""
    if shards < 1:
        raise ValueError(f"shards={shards} must be >= 1")
    per_shard = -(-parameter_bytes // shards)
    trainable = -(-trainable_bytes // shards)
    in_flight = largest_unit_bytes if shards > 1 else 0
    return MemoryFigures(parameters=per_shard + in_flight,
                         gradients=trainable * (2 if ddp_buckets else 1) + (in_flight if shards > 1 else 0),
                         optimizer_state=int(trainable * optimizer_factor))


def check_fits(figures: MemoryFigures, limit: int, *, strategy: str, workers: int,
               sharded: MemoryFigures | None = None, baseline: int = 0) -> None:
    """Raise ``InsufficientMemory`` when ``baseline`` plus ``figures``' training state exceeds ``limit``
    bytes (0: no limit). ``baseline``: what the process holds besides training (the interpreter, torch,
    data), which a cgroup limit counts too. ``sharded``: the estimate under fsdp on the same workers,
    named in the message."""
    if not limit or baseline + figures.training_state <= limit:
        return
    hint = "give each worker more memory (resources.memory)"
    if sharded is not None and strategy != "fsdp":
        fits = "fits" if baseline + sharded.training_state <= limit else "still does not fit"
        hint = (f"strategy fsdp on the same {workers} workers needs {format_memory(sharded.training_state)} "
                f"per worker ({fits}); or {hint}")
    elif strategy == "fsdp":
        hint = f"use more workers (each adds a shard), {hint}"
    besides = f", besides {format_memory(baseline)} the process holds already" if baseline else ""
    raise InsufficientMemory(
        f"memory: the training state needs {format_memory(figures.training_state)} per worker under "
        f"{strategy} on {workers} workers ({figures.text()}{besides}), but each worker has "
        f"{format_memory(limit)} (resources.memory); {hint}")
