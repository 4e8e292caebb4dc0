"""``ShardedOptimizer``: the user's optimizer, pointed at the sharded parameters.

Contract:
- ``rebuild_optimizer(optimizer, names, model)``: FSDP2 and tensor parallel replace a module's
  parameters by new DTensor ones, so the optimizer the user built before ``prepare`` holds
  parameters the model no longer uses. Its parameter groups are pointed at the model's new
  parameters, by name (``names`` maps the old parameters to their dotted names), in place: the
  same optimizer object, every group's settings kept, so an LR scheduler made before ``prepare``
  still drives it (Hugging Face Accelerate does the same for FSDP2; building a new optimizer of
  the same class from ``defaults`` fails for classes whose ``defaults`` hold keys their
  constructor does not take, e.g. AdamW's ``decoupled_weight_decay``). Raises ``InvalidSpec``,
  changing nothing, when the optimizer already has state (load it after ``prepare``) or holds a
  parameter the model does not.
- ``ShardedOptimizer`` is a ``train.prepared.StrategyOptimizer`` over that optimizer: ``step`` and
  ``zero_grad`` are the inner one's (the step updates each rank's shards only); ``metrics()``
  are the memory meter's ``memory_*`` figures; ``state_dict()`` is keyed by parameter name with
  DTensor shards (``get_optimizer_state_dict``), so a checkpoint reshards on load;
  ``load_state_dict`` takes that, whole tensors (a loaded checkpoint) or a plain optimizer's or
  a ddp job's state (by index, in the order of the optimizer's parameters). Collective.
- ``per_replica_tensors()`` is empty: each shard lives on one rank and DCP writes it once.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from torchrelay.errors import InvalidSpec
from torchrelay.train.memory_meter import MemoryMeter
from torchrelay.train.prepared import StrategyOptimizer
from torchrelay.train.sharded.module import has_dtensors

__all__ = ["ShardedOptimizer", "parameter_names", "rebuild_optimizer"]


def parameter_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> dotted name`` (a shared parameter under its first name)."""
    return {id(p): name for name, p in model.named_parameters()}


def rebuild_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str],
                      model: nn.Module) -> torch.optim.Optimizer:
    """``optimizer`` with its groups pointing at ``model``'s current parameters (see the module docstring)."""
    if any(optimizer.state.values()):
        raise InvalidSpec("the optimizer passed to prepare() already has state; under fsdp its parameters are "
                          "replaced by shards: load optimizer state after prepare (TrainState.restore does)")
    current = dict(model.named_parameters())
    swapped = []
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            name = names.get(id(p))
            if name is None or name not in current:
                raise InvalidSpec(f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not in the "
                                  "model passed to prepare(); build the optimizer over model.parameters()")
            params.append(current[name])
        swapped.append(params)
    for group, params in zip(optimizer.param_groups, swapped):  # all checked first: nothing half-changed
        group["params"] = params
    return optimizer


def _by_name(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A plain optimizer state dict (parameters by index) keyed by parameter name instead."""
    inner = state.get("state", {})
    if inner and not all(isinstance(k, int) for k in inner):
        return state
    groups = [{**g, "params": [names[i] if isinstance(i, int) else i for i in g["params"]]}
              for g in state.get("param_groups", [])]
    return {"state": {names[i]: s for i, s in inner.items()}, "param_groups": groups}


class ShardedOptimizer(torch.optim.Optimizer, StrategyOptimizer):
    """The user's optimizer with the library's hooks (see the module docstring)."""

    def __init__(self, inner: torch.optim.Optimizer, *, model: nn.Module, meter: MemoryMeter) -> None:
        # Not calling Optimizer.__init__: the inner optimizer owns param_groups and state (as SyncOptimizer)
        self.inner = inner
        self.model = model
        self.meter = meter
        self.param_groups = inner.param_groups
        self.defaults = inner.defaults
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}
        names = parameter_names(model)
        self._names = [names[id(p)] for g in inner.param_groups for p in g["params"]]

    @property
    def state(self):  # type: ignore[override]
        return self.inner.state

    def __repr__(self) -> str:
        return f"ShardedOptimizer(inner={self.inner!r})"

    def step(self, closure: Callable[[], float] | None = None):  # type: ignore[override]
        return self.inner.step(closure) if closure is not None else self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError("add parameter groups before torchrelay's prepare(); under fsdp the optimizer "
                                  "is pointed at the shards there")

    def metrics(self) -> dict[str, float]:
        return self.meter.metrics()

    def close(self) -> None:
        self.meter.close()

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return {"inner": get_optimizer_state_dict(self.model, self.inner)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        inner = _by_name(state_dict.get("inner", state_dict), self._names)
        values = [v for s in inner.get("state", {}).values() for v in s.values()]
        options = StateDictOptions(full_state_dict=not has_dtensors(values))
        set_optimizer_state_dict(self.model, self.inner, inner, options=options)
