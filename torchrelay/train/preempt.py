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
"""
from __future__ import annotations

import os
import signal
import threading

_requested = threading.Event()
_cooperative = False
_installed = False


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
    """True once the platform asked this worker to stop (SIGTERM). Does not block."""
    mark_cooperative()
    return _requested.is_set()


def stop_requested() -> bool:
    """Like ``should_stop`` but does not mark the caller as polling (for library internals)."""
    return _requested.is_set()


def _reset_for_tests() -> None:
    global _cooperative, _installed
    _requested.clear()
    _cooperative = False
    if _installed and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _installed = False
