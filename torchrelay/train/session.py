"""What one worker process knows: the state behind ``torchrelay.train``'s functions.

One ``Session`` per process (``current_session()``) holds:

- ``context`` — the ``Context`` of ``init()``; None before it and after ``shutdown()``
  (``known_context()`` then reads one from the environment);
- ``optimizer`` — what ``prepare()`` returned last, and ``hooks``, its ``StrategyOptimizer``
  protocol (``train.prepared``): what ``report``, checkpoints, ``finish`` and ``shutdown`` call;
- ``writer`` — the metric writer of ``report()`` (``train.report`` makes and closes it);
- ``stop`` — the SIGTERM stop request and the ranks' agreement on it (``train.preempt``);
- ``checkpoint`` — the job's checkpoint machinery (``train.checkpoint``): its process group, the
  async save in flight, the staging and upload threads;
- ``worker_group`` — a parameter-server job's workers-only process group (``train.ps``);
- ``balancer`` — balanced data parallel's shares of the global batch (``train.balance``).

Each part is changed by the module named beside it; the others only read it. ``shutdown()``
drops what ``init`` and ``prepare`` made (context, optimizer, writer); the stop request, the
checkpoint threads and the SIGTERM handler outlive it (a process makes them once). Thread-safety: ``writer`` is
swapped under ``writer_lock``, ``checkpoint`` under ``checkpoint.lock``; the rest is changed from
the training loop's thread.

A leaf of the library: imports only its pure leaves (environment, prepared, metrics_file,
stop_agreement), so every other module can import it without a cycle.
"""
from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any

from torchrelay.train.environment import Context, context_from_env
from torchrelay.train.metrics_file import MetricsWriter
from torchrelay.train.prepared import StrategyOptimizer, strategy_optimizer
from torchrelay.train.stop_agreement import StopAgreement

__all__ = ["CheckpointState", "Session", "StopRequest", "current_session"]


@dataclasses.dataclass(kw_only=True, slots=True)
class StopRequest:
    """The platform's request to stop (SIGTERM) and whether the training loop polls for it."""

    # Set by the SIGTERM handler. A plain flag, not a threading.Event: the platform's SIGTERM
    # reaches a worker twice (from the agent and forwarded by torchrun), and a second handler run
    # nested inside the first one's Event.set() waits forever on the Event's own lock (seen: a
    # rank stuck there until SIGKILL, its checkpoint never committed).
    requested: bool = False
    cooperative: bool = False  # the loop called should_stop or checkpoint_due
    installed: bool = False  # the SIGTERM handler is in place
    agreement: StopAgreement = dataclasses.field(default_factory=StopAgreement)


@dataclasses.dataclass(kw_only=True, slots=True)
class CheckpointState:
    """The job's checkpoint machinery in this process (owned by ``train.checkpoint``)."""

    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    group: tuple[Any, Any] | None = None  # (the default group it was made for, its own gloo group)
    in_flight: Any = None  # train.checkpoint.PendingSave: the async save not yet waited for
    workers: tuple[Any, Any] | None = None  # (DefaultStager, upload ThreadPoolExecutor), made once


@dataclasses.dataclass(kw_only=True, slots=True)
class Session:
    """What this worker process knows (see the module docstring)."""

    context: Context | None = None
    optimizer: Any = None
    hooks: StrategyOptimizer = dataclasses.field(default_factory=lambda: strategy_optimizer(None))
    writer: MetricsWriter | None = None
    writer_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    stop: StopRequest = dataclasses.field(default_factory=StopRequest)
    checkpoint: CheckpointState = dataclasses.field(default_factory=CheckpointState)
    worker_group: Any = None
    balancer: Any = None

    def known_context(self) -> Context:
        """The context of ``init()`` if it ran, else one read from the environment (no process group).

        Raises ``InvalidSpec`` for a malformed environment."""
        return self.context if self.context is not None else context_from_env(os.environ)

    def adopt_optimizer(self, optimizer: Any) -> None:
        """Remember what ``prepare`` returned, and its protocol."""
        self.optimizer, self.hooks = optimizer, strategy_optimizer(optimizer)

    def forget_prepared(self) -> tuple[Any, StrategyOptimizer]:
        """Drop the prepared optimizer; returns what was held, for a last ``close()``."""
        held = (self.optimizer, self.hooks)
        self.adopt_optimizer(None)
        return held


_SESSION = Session()


def current_session() -> Session:
    """This process's session (one per process, made at import)."""
    return _SESSION
