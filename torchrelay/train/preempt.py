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
default group, about every half second of calls (see ``_agree``): they are collective (call
them on every rank, the same number of times, as the loop above does) and every rank gets the
same answer at the same call. Once the answer is True it stays True without further collectives. Under ``parameter_server`` (server ranks never
join a collective) each rank answers for itself.
"""
from __future__ import annotations

import os
import signal
import threading

# Set by the SIGTERM handler. A plain flag, not a threading.Event: the platform's SIGTERM
# reaches a worker twice (from the agent and forwarded by torchrun), and a second handler
# run nested inside the first one's Event.set() waits forever on the Event's own lock (seen:
# a rank stuck there until SIGKILL, its checkpoint never committed).
_requested = False
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
    global _requested
    _requested = True  # async-signal-safe: no lock (see above)
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
    return _agree(_requested, from_checkpoint_due=False)


def stop_requested() -> bool:
    """What ``checkpoint_due`` asks: like ``should_stop`` but does not mark the caller as polling."""
    return _agree(_requested, from_checkpoint_due=True)


# Agreement state; every rank makes the same calls, so these evolve identically on every rank.
_calls = 0  # agreement calls so far
_next_reduce = 1  # the call that all-reduces next
_checkpoint_due_seen = False  # the loop asks checkpoint_due: agreement happens there
_last_call_at: float | None = None
_call_interval_s: float | None = None  # smoothed time between calls on this rank
REDUCE_EVERY_S = 0.5  # aim: one all-reduce per half second of training, whatever the step time


def _agree(local: bool, *, from_checkpoint_due: bool) -> bool:
    """``local`` OR-ed over the ranks of the default process group; sticky once True.

    A tiny all-reduce per step would cost a fast training step a few percent, so the ranks
    reduce only every N calls, where N (about half a second of calls, 1..100) is itself agreed
    in each reduction. When the loop calls ``checkpoint_due`` the reductions happen there, so
    the step where the ranks agree to stop is also the step whose checkpoint they commit;
    ``should_stop`` then just reads the agreed answer.
    """
    global _agreed_stop, _calls, _next_reduce, _checkpoint_due_seen, _last_call_at, _call_interval_s
    if _agreed_stop:
        return True
    if _agreeing_world_size() <= 1:
        return local
    if from_checkpoint_due:
        _checkpoint_due_seen = True
    elif _checkpoint_due_seen:
        return False  # the reduction is checkpoint_due's; nothing was agreed yet
    import time

    _calls += 1
    now = time.monotonic()
    if _last_call_at is not None:
        gap = now - _last_call_at
        _call_interval_s = gap if _call_interval_s is None else 0.8 * _call_interval_s + 0.2 * gap
    _last_call_at = now
    if _calls < _next_reduce:
        return False
    import torch
    import torch.distributed as dist

    from torchrelay.train.context import current_context

    wanted = 1 if not _call_interval_s else max(1, min(100, int(REDUCE_EVERY_S / _call_interval_s)))
    values = torch.tensor([1 if local else 0, wanted], dtype=torch.int64, device=current_context().device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    _agreed_stop = bool(values[0].item())
    _next_reduce = _calls + int(values[1].item())
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
    global _cooperative, _installed, _agreed_stop, _calls, _next_reduce, _checkpoint_due_seen
    global _last_call_at, _call_interval_s, _requested
    _calls, _next_reduce, _checkpoint_due_seen, _last_call_at, _call_interval_s = 0, 1, False, None, None
    _requested = False
    _cooperative = False
    _agreed_stop = False
    if _installed and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _installed = False
