"""Graceful stop on SIGTERM: checkpoint, then exit, within the job's grace period.

When the platform stops a job's workers (preemption, `relay cancel`, a node drain) it sends
SIGTERM and, ``stop_grace_s`` later, SIGKILL. ``install()`` (called by ``torchrelay.train.init``)
replaces SIGTERM's default with a handler that only records the request, so a training loop
that asks can finish its step, commit a checkpoint and return:

    for step in ...:
        ...
        if rt.checkpoint_due(step):      # also True once a stop was requested
            rt.save_checkpoint(state, step)
        if rt.should_stop():
            break

A script that never asks (it never called ``should_stop`` or ``checkpoint_due``) keeps the
default behaviour: SIGTERM ends it at once, as it would without torchrelay.

The ranks agree. SIGTERM reaches each rank at a slightly different moment, so one rank could
see it before its step's check and another after, and they would then disagree on whether
to save (a collective) and stop. When a process group of more than one rank is up,
``should_stop()`` and ``stop_requested()`` therefore all-reduce (MAX) the request over the
default group: they are collective (call them on every rank, the same number of times, as
the loop above does) and every rank gets the same answer at the same call. Once the answer is
True it stays True without further collectives. Under ``parameter_server`` (server ranks never
join a collective) each rank answers for itself.
"""
from __future__ import annotations

import os
import signal
import threading

_requested = threading.Event()
_cooperative = False
_installed = False
_agreed_stop = False  # every rank has agreed that a stop was requested


def install() -> None:
    """Install the SIGTERM handler (main thread only; elsewhere a no-op). Idempotent."""
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, _on_sigterm)
    _installed = True


def _on_sigterm(signum: int, _frame: object) -> None:
    _requested.set()
    if not _cooperative:
        # nobody will look at the flag: behave like the default disposition
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def mark_cooperative() -> None:
    """Record that the training loop polls for stop requests (called by the polling functions)."""
    global _cooperative
    _cooperative = True


def should_stop() -> bool:
    """True once the platform asked this job's workers to stop (SIGTERM to any rank).
    Collective when distributed (see the module docstring); otherwise does not block."""
    mark_cooperative()
    return _agree(_requested.is_set())


def stop_requested() -> bool:
    """Like ``should_stop`` but does not mark the caller as polling (for library internals)."""
    return _agree(_requested.is_set())


def _agree(local: bool) -> bool:
    """``local`` OR-ed over the ranks of the default process group; sticky once True."""
    global _agreed_stop
    if _agreed_stop:
        return True
    group_size = _agreeing_world_size()
    if group_size <= 1:
        return local
    import torch
    import torch.distributed as dist

    from torchrelay.train.context import current_context

    flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=current_context().device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    _agreed_stop = bool(flag.item())
    return _agreed_stop


def _agreeing_world_size() -> int:
    """Ranks that take part in the agreement: the default group's, or 1 (no group, PS strategy)."""
    import sys

    dist = sys.modules.get("torch.distributed")  # never import torch just to find it unused
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    from torchrelay.train.context import current_context

    if current_context().strategy.kind == "parameter_server":
        return 1
    return dist.get_world_size()


def _reset_for_tests() -> None:
    global _cooperative, _installed, _agreed_stop
    _requested.clear()
    _cooperative = False
    _agreed_stop = False
    if _installed and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _installed = False
