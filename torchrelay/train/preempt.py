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
``should_stop()`` and ``poll_stop_for_checkpoint()`` therefore all-reduce (MAX) the request over
the default group, about every half second of calls (``train.stop_agreement`` decides when):
they are collective (call them on every rank, the same number of times, as the loop above does)
and every rank gets the same answer at the same call. Once the answer is True it stays True
without further collectives. Where the library's collectives do not span the default group
(``train.roles``: the parameter server, whose server ranks never join one) each rank answers
for itself.

The request and the agreement are the session's ``stop`` (``train.session``).
"""
from __future__ import annotations

import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from torchrelay.train.roles import Roles
from torchrelay.train.session import current_session

__all__ = ["install", "mark_cooperative", "poll_stop_for_checkpoint", "should_stop"]


def install() -> None:
    """Install the SIGTERM handler (main thread only; elsewhere a no-op). Idempotent."""
    stop = current_session().stop
    if stop.installed or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, _on_sigterm)
    stop.installed = True


def _on_sigterm(signum: int, _frame: object) -> None:
    stop = current_session().stop
    stop.requested = True  # async-signal-safe: no lock (see StopRequest)
    if not stop.cooperative:
        # nobody will look at the flag: behave like the default disposition
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def mark_cooperative() -> None:
    """Record that the training loop polls for stop requests (from now on SIGTERM only sets the flag)."""
    current_session().stop.cooperative = True


def should_stop() -> bool:
    """True once the platform asked this job's workers to stop (SIGTERM to any rank).

    Marks the loop as polling. Collective when distributed (see the module docstring); otherwise
    does not block."""
    mark_cooperative()
    return _agree(from_checkpoint_due=False)


def poll_stop_for_checkpoint() -> bool:
    """What ``checkpoint_due`` asks: the agreed stop request, reduced here rather than in
    ``should_stop``. Collective when distributed; does not mark the loop as polling."""
    return _agree(from_checkpoint_due=True)


def _agree(*, from_checkpoint_due: bool) -> bool:
    """This rank's request OR-ed over the ranks that agree; sticky once True."""
    session = current_session()
    stop = session.stop
    agreement = stop.agreement
    if agreement.agreed:
        return True
    if not _agreeing_over_the_default_group():
        return stop.requested
    if not agreement.record_call(from_checkpoint_due=from_checkpoint_due, now=time.monotonic()):
        return False
    values = torch.tensor([1 if stop.requested else 0, agreement.proposed_period()], dtype=torch.int64,
                          device=session.known_context().device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return agreement.apply(any_rank_stops=bool(values[0].item()), agreed_period=int(values[1].item()))


def _agreeing_over_the_default_group() -> bool:
    """Whether the ranks agree over the default group: one of more than one rank is up and every
    rank of it joins the library's collectives (``train.roles``)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return False
    ctx = current_session().known_context()
    return Roles.of(ctx.rank, ctx.world_size, ctx.strategy).collectives_on_default_group
