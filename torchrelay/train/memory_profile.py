"""The profile run behind ``relay submit --dry-run --profile``: one process, a few steps, the figures.

Contract:
- The client runs the job's entrypoint as one process with ``RELAY_PROFILE_OUT`` (a file path),
  ``RELAY_PROFILE_WORKERS`` (the job's workers) and ``RELAY_STRATEGY`` set. ``prepare`` then
  returns the model unchanged (a ``LocalModule``) and a ``ProfileOptimizer``; no process group.
- ``ProfileOptimizer.step()`` steps the user's optimizer; after ``RELAY_PROFILE_STEPS`` steps
  (default 2) it writes the profile JSON and ends the process with exit status 0
  (``SystemExit``): ``estimate`` (one worker's parameters, gradients and optimizer state under
  the job's strategy on its workers, ``train.memory_check``), ``activations`` (measured in this
  run, ``train.memory_meter``: a worker's batch is the script's, whatever the world size),
  ``measured`` (this process's whole training state), ``peak_rss`` (this process's peak
  resident memory) and ``overhead`` (peak_rss less what training held: the interpreter, torch,
  the data), from which the client recommends ``resources.memory``.
"""
from __future__ import annotations

import json
import os
import resource
import sys
from typing import Any, Callable, Mapping

import torch
from torch import nn

from torchrelay.errors import InvalidSpec
from torchrelay.train.memory_check import estimate
from torchrelay.train.memory_meter import MemoryMeter
from torchrelay.train.prepared import StrategyOptimizer

__all__ = ["PROFILE_VAR", "ProfileOptimizer", "profiling"]

PROFILE_VAR = "RELAY_PROFILE_OUT"


def profiling(env: Mapping[str, str]) -> bool:
    return bool(env.get(PROFILE_VAR))


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    try:
        value = int(env.get(name) or default)
    except ValueError:
        raise InvalidSpec(f"environment variable {name}={env.get(name)!r} is not an integer") from None
    if value < 1:
        raise InvalidSpec(f"environment variable {name}={value} must be >= 1")
    return value


class ProfileOptimizer(torch.optim.Optimizer, StrategyOptimizer):
    """The user's optimizer, stopping the process with the profile after a few steps."""

    def __init__(self, inner: torch.optim.Optimizer, model: nn.Module, strategy: Any, env: Mapping[str, str]) -> None:
        self.inner = inner
        self.param_groups = inner.param_groups
        self.defaults = inner.defaults
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}
        self.path = env[PROFILE_VAR]
        self.steps_left = _int(env, "RELAY_PROFILE_STEPS", 2)
        workers = _int(env, "RELAY_PROFILE_WORKERS", 1)
        self.estimate = estimate(model, inner, strategy, workers)
        self.strategy, self.workers = getattr(strategy, "kind", "ddp"), workers
        self.meter = MemoryMeter(model, inner, measure_forwards=self.steps_left)

    @property
    def state(self):  # type: ignore[override]
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], float] | None = None):  # type: ignore[override]
        loss = self.inner.step(closure) if closure is not None else self.inner.step()
        self.steps_left -= 1
        if self.steps_left <= 0:
            self._write()
            sys.stdout.flush()
            raise SystemExit(0)
        return loss

    def metrics(self) -> dict[str, float]:
        return self.meter.metrics()

    def _write(self) -> None:
        measured = self.meter.figures()
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        body = {"strategy": self.strategy, "workers": self.workers,
                "estimate": self.estimate.as_metrics(), "activations": measured.activations,
                "measured": measured.as_metrics(), "peak_rss": peak_rss,
                "overhead": max(0, peak_rss - measured.total)}
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(body, f)
        os.replace(tmp, self.path)
