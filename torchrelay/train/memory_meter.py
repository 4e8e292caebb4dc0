"""One rank's memory for training, measured: the ``memory_*`` metrics every data-parallel strategy reports.

``MemoryMeter(model, optimizer)`` reads, whenever ``figures()`` is called (a strategy's
``metrics()``, so at each ``report()``), the bytes this rank holds now and keeps the peak of each:

- parameters: the rank's own tensors (a sharded parameter's local shard), plus
  ``gathered_bytes`` — the largest FSDP unit gathered whole during its forward and backward;
- gradients: the same for ``.grad`` (plus the gathered unit's gradient before it is reduced);
- optimizer state: every tensor in the optimizer's ``state`` (local shards; ``optimizer`` may be
  None: a parameter-server worker holds none, its servers do);
- ``staging``: bytes held besides the model's own tensors, added to each kind (a GPU
  parameter-server worker's CPU copies of its parameters and gradients);
- activations: bytes of the tensors autograd saved for backward during one forward of
  ``model`` (storages counted once; parameters and views of them left out), measured with
  ``torch.autograd.graph.saved_tensors_hooks`` over the first ``measure_forwards`` forwards in
  grad mode, after which the hooks are removed (the step runs as without the meter).

Why measured this way: on CPU torch keeps no allocator statistics, and on a GPU
``max_memory_allocated`` mixes the four; on a GPU the meter adds ``memory_peak_allocated``.
Does not communicate; ``close()`` removes the hooks (idempotent).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from torchrelay.train.memory import MemoryFigures

__all__ = ["MemoryMeter", "local_bytes"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)  # a DTensor's shard on this rank


def local_bytes(tensors: Any) -> int:
    """Bytes of this rank's part of ``tensors``; a tensor met twice (a shared weight) counts once.

    Tensors are told apart by where their data starts and how many bytes they span, not by
    storage: the parameter server's parameters (and sync's gradients) are views of one flat
    buffer each, and every view counts."""
    seen: set[tuple[int, int, int]] = set()
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = _local(t)
            if local.device.type == "meta":
                continue
            nbytes = local.numel() * local.element_size()
            key = (local.data_ptr() or id(local), nbytes, local.device.index or 0)
            if key not in seen:
                seen.add(key)
                total += nbytes
    return total


def _parameter_like(t: torch.Tensor) -> bool:
    base = t._base if t._is_view() else t
    return base.requires_grad and base.grad_fn is None


class MemoryMeter:
    """Peak memory of one rank, by kind (see the module docstring)."""

    def __init__(self, model: nn.Module, optimizer: Any, *, gathered_bytes: int = 0,
                 staging: MemoryFigures | None = None, measure_forwards: int = 3) -> None:
        self.model = model
        self.optimizer = optimizer
        self.gathered_bytes = gathered_bytes
        self.staging = staging or MemoryFigures()
        self.peak = MemoryFigures()
        self._left = measure_forwards
        self._saved: dict[int, int] = {}
        self._context: Any = None
        self._handles = [model.register_forward_pre_hook(self._start),
                         model.register_forward_hook(self._stop, always_call=True)]

    # ------------------------------------------------------------ activations

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        local = _local(t)
        if not _parameter_like(t) and local.device.type != "meta":
            storage = local.untyped_storage()
            self._saved.setdefault(storage.data_ptr() or id(local), storage.nbytes())
        return t

    def _start(self, *_args: Any) -> None:
        if self._left <= 0 or not torch.is_grad_enabled() or self._context is not None:
            return
        self._saved = {}
        self._context = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._context.__enter__()

    def _stop(self, *_args: Any) -> None:
        if self._context is None:
            return
        context, self._context = self._context, None
        context.__exit__(None, None, None)
        self._left -= 1
        self._raise(activations=sum(self._saved.values()))
        self._saved = {}
        if self._left <= 0:
            self._remove_hooks()

    def _remove_hooks(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    # ------------------------------------------------------------ figures

    def _raise(self, **values: int) -> None:
        current = {k: getattr(self.peak, k) for k in ("parameters", "gradients", "optimizer_state", "activations")}
        current.update({k: max(current[k], v) for k, v in values.items()})
        self.peak = MemoryFigures(**current)

    def figures(self) -> MemoryFigures:
        """The peaks so far, after reading what the rank holds now. Does not communicate."""
        params = list(self.model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        state = [v for per_param in getattr(self.optimizer, "state", {}).values() for v in per_param.values()]
        self._raise(parameters=local_bytes(params) + self.gathered_bytes + self.staging.parameters,
                    gradients=local_bytes(grads) + (self.gathered_bytes if grads else 0) + self.staging.gradients,
                    optimizer_state=local_bytes(state) + self.staging.optimizer_state)
        return self.peak

    def metrics(self) -> dict[str, float]:
        out = self.figures().as_metrics()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["memory_peak_allocated"] = float(torch.cuda.max_memory_allocated())
        return out

    def close(self) -> None:
        if self._context is not None:
            self._stop()
        self._remove_hooks()


