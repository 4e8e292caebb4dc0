"""Metrics from a worker to the server: one JSON line per ``report()`` in a per-rank file.

Contract:
- ``report(step, **metrics)`` appends ``{"step": int, "time": unix_s, "values": {name: float}}``
  to ``$RELAY_METRICS_DIR/rank-$RANK.jsonl``. The agent tails that file and ships new whole
  lines to the server in batches; the line number is the record's sequence number.
- Lines are buffered in memory and written (whole lines, one ``write``) at the latest
  ``FLUSH_INTERVAL_S`` after they were reported, when the buffer holds ``MAX_BUFFERED``
  lines, on ``flush()``, on ``torchrelay.train.shutdown()`` and at interpreter exit.
  ``report`` itself never blocks on the file.
- Values must be real numbers (int, float, bool, numpy scalars, one-element tensors);
  anything else raises ``TypeError`` naming the key and value. NaN and infinities are kept
  (written as JSON ``NaN``/``Infinity``, which Python's json reads back).
- The prepared optimizer's ``metrics()`` (``train.prepared``) are merged in; the caller's own
  keys win.
- Without ``RELAY_METRICS_DIR`` (plain ``python`` / ``torchrun``) metrics are validated and dropped.

Conventional keys read by the CLI's progress bar: ``loss``, ``samples_per_s``, ``total_steps``,
``epoch``, ``accuracy``.

The writer is the session's (``train.session``); the line format and the writer are
``train.metrics_file``'s.
"""
from __future__ import annotations

import atexit
import os
from typing import Any

from torchrelay.train.metrics_file import (FLUSH_INTERVAL_S, MAX_BUFFERED, MetricsWriter, format_record,
                                           metric_value, metrics_path)
from torchrelay.train.session import current_session

__all__ = ["FLUSH_INTERVAL_S", "MAX_BUFFERED", "MetricsWriter", "close_writer", "flush", "format_record",
           "install_writer", "metric_value", "metrics_path", "report"]


def install_writer(rank: int) -> MetricsWriter:
    """The process's writer for ``rank`` (made on first call; idempotent for the same rank)."""
    session = current_session()
    with session.writer_lock:
        path = metrics_path(os.environ, rank)
        if session.writer is not None and session.writer.path == path:
            return session.writer
        if session.writer is not None:
            session.writer.close()
        session.writer = MetricsWriter(path)
        return session.writer


def close_writer() -> None:
    """Flush and close the process's writer (idempotent)."""
    session = current_session()
    with session.writer_lock:
        writer, session.writer = session.writer, None
    if writer is not None:
        writer.close()


def flush() -> None:
    """Write every buffered metric line now."""
    writer = current_session().writer
    if writer is not None:
        writer.flush()


atexit.register(close_writer)


def report(step: int, **metrics: Any) -> None:
    """Record ``metrics`` at ``step`` for this rank. Does not block. Raises ``TypeError`` on a bad value."""
    session = current_session()
    values: dict[str, float] = {}
    for key, value in session.hooks.metrics().items():
        values[str(key)] = metric_value(str(key), value)
    for key, value in metrics.items():
        values[key] = metric_value(key, value)
    writer = session.writer if session.writer is not None else install_writer(session.known_context().rank)
    writer.write(step, values)
