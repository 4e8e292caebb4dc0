"""What a strategy's ``prepare`` hands back: the optimizer protocol the library calls.

``torchrelay.train.prepare`` returns ``(model, optimizer)``. The optimizer is the user's own
(ddp in a world of 1) or a strategy's wrapper (``train.sync.SyncOptimizer``,
``train.ps.PSOptimizer``). The library calls it through ``StrategyOptimizer``:

- ``metrics()`` — figures of the last step, merged into every ``report()``; does not communicate.
- ``per_replica_tensors()`` — the live tensors whose values differ between ranks now (a
  checkpoint keeps one copy per rank of them); does not communicate.
- ``before_checkpoint()`` — runs before a checkpoint's state is taken (final averaging: a collective).
- ``finish()`` — end of training: make replicas agree (collective; idempotent).
- ``close()`` — last: release connections (parameter server: tell the shards this worker is done).
- ``inner`` — the optimizer this one wraps, whose ``step()`` changes the parameters (an async
  checkpoint's guard hooks it), or None.

A strategy's optimizer subclasses ``StrategyOptimizer`` and overrides what it needs: the defaults
do nothing. ``strategy_optimizer(optimizer)`` gives the protocol for whatever ``prepare`` returned;
for the user's own optimizer it is ``UserOptimizer``, which runs the same-named methods that
optimizer defines itself (so one written for torchrelay reports its metrics in a world of 1 too).
Imports no other module of ``torchrelay.train``.
"""
from __future__ import annotations

import abc
from typing import Any, Callable, Mapping

__all__ = ["StrategyOptimizer", "UserOptimizer", "strategy_optimizer"]


class StrategyOptimizer(abc.ABC):  # noqa: B024 - every hook has a default; subclasses pick theirs
    """The hooks the library calls on a prepared optimizer (see the module docstring)."""

    inner: Any = None

    def metrics(self) -> Mapping[str, float]:
        return {}

    def per_replica_tensors(self) -> list[Any]:
        return []

    def before_checkpoint(self) -> None:
        return None

    def finish(self) -> None:
        return None

    def close(self) -> None:
        return None


class UserOptimizer(StrategyOptimizer):
    """The protocol for an optimizer that is not a ``StrategyOptimizer`` (None: no optimizer yet).

    Each hook runs the optimizer's own method of that name when it has one, else does nothing."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.inner = getattr(optimizer, "inner", None)

    def _own(self, name: str) -> Callable[[], Any] | None:
        method = getattr(self.optimizer, name, None)
        return method if callable(method) else None

    def metrics(self) -> Mapping[str, float]:
        own = self._own("metrics")
        return (own() or {}) if own else {}

    def per_replica_tensors(self) -> list[Any]:
        own = self._own("per_replica_tensors")
        return list(own() or []) if own else []

    def before_checkpoint(self) -> None:
        own = self._own("before_checkpoint")
        if own:
            own()

    def finish(self) -> None:
        own = self._own("finish")
        if own:
            own()

    def close(self) -> None:
        own = self._own("close")
        if own:
            own()


def strategy_optimizer(optimizer: Any) -> StrategyOptimizer:
    """``optimizer`` itself when it is a ``StrategyOptimizer``, else a ``UserOptimizer`` over it."""
    return optimizer if isinstance(optimizer, StrategyOptimizer) else UserOptimizer(optimizer)
