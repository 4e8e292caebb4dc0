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
- If the optimizer ``prepare()`` returned has ``metrics() -> dict[str, float]``, its values are
  merged in; the caller's own keys win.
- Without ``RELAY_METRICS_DIR`` (plain ``python`` / ``torchrun``) metrics are validated and dropped.

Conventional keys read by the CLI's progress bar: ``loss``, ``samples_per_s``, ``total_steps``,
``epoch``, ``accuracy``.
"""
from __future__ import annotations

import atexit
import json
import numbers
import os
import threading
import time
from typing import Any, Callable

FLUSH_INTERVAL_S = 0.5
MAX_BUFFERED = 1000


def metric_value(key: str, value: Any) -> float:
    """``value`` as a float. Raises ``TypeError`` naming ``key`` for anything not a real number."""
    if hasattr(value, "item") and callable(value.item) and not isinstance(value, numbers.Number):
        numel = getattr(value, "numel", None)
        size = numel() if callable(numel) else getattr(value, "size", 1)
        if size != 1:
            raise TypeError(f"metric {key!r}: a tensor/array of {size} elements is not one number; "
                            "report a scalar, e.g. loss.item()")
        value = value.item()
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"metric {key!r}={value!r:.80} is a {type(value).__name__}, not a number")


def format_record(step: int, time_s: float, values: dict[str, float]) -> str:
    """One metrics line (with its newline). Raises ``TypeError``/``ValueError`` for a bad step."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step={step!r} must be an int")
    if step < 0:
        raise ValueError(f"step={step} must be >= 0")
    return json.dumps({"step": int(step), "time": time_s, "values": values},
                      separators=(",", ":")) + "\n"


class MetricsWriter:
    """Buffers metric lines for one file and appends them from a background thread.

    ``path`` None means drop everything. Thread-safe. ``close()`` flushes and is idempotent;
    writes after ``close()`` go straight to the file.
    """

    def __init__(self, path: str | None, flush_interval_s: float = FLUSH_INTERVAL_S,
                 clock: Callable[[], float] = time.time):
        self.path = path
        self.flush_interval_s = flush_interval_s
        self.clock = clock
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._file_lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._thread: threading.Thread | None = None
        if path is not None:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)

    def write(self, step: int, values: dict[str, float]) -> None:
        line = format_record(step, self.clock(), values)
        if self.path is None:
            return
        with self._lock:
            self._lines.append(line)
            if self._closed or len(self._lines) >= MAX_BUFFERED:
                flush_now = True
            else:
                flush_now = False
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="relay-metrics", daemon=True)
                    self._thread.start()
                self._wake.notify()
        if flush_now:
            self.flush()

    def flush(self) -> None:
        """Append every buffered line to the file now, in one unbuffered write.

        Blocks on the file only. Raises ``OSError`` (full disk …) keeping what did not reach the
        file, so a later flush completes it.
        """
        with self._file_lock:
            with self._lock:
                lines, self._lines = self._lines, []
            if not lines or self.path is None:
                return
            data = "".join(lines).encode("ascii")  # json.dumps escapes everything else
            written = 0
            try:
                with open(self.path, "ab", buffering=0) as fh:
                    while written < len(data):
                        written += fh.write(memoryview(data)[written:])
            except OSError:
                with self._lock:
                    self._lines.insert(0, data[written:].decode("ascii"))
                raise

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        self.flush()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._lines and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
            # give later reports of this burst a chance to share the write
            with self._lock:
                self._wake.wait_for(lambda: self._closed, timeout=self.flush_interval_s)
            try:
                self.flush()
            except OSError:
                pass  # a full disk must not kill training; close() retries and raises


# ---------------------------------------------------------------- process-wide writer

_writer: MetricsWriter | None = None
_writer_lock = threading.Lock()


def metrics_path(env: dict[str, str] | os._Environ, rank: int) -> str | None:
    """Where rank ``rank`` writes its metrics, or None when ``RELAY_METRICS_DIR`` is unset."""
    directory = env.get("RELAY_METRICS_DIR")
    return os.path.join(directory, f"rank-{rank}.jsonl") if directory else None


def install_writer(rank: int) -> MetricsWriter:
    """The process's writer for ``rank`` (made on first call; idempotent for the same rank)."""
    global _writer
    with _writer_lock:
        path = metrics_path(os.environ, rank)
        if _writer is not None and _writer.path == path:
            return _writer
        if _writer is not None:
            _writer.close()
        _writer = MetricsWriter(path)
        return _writer


def close_writer() -> None:
    """Flush and close the process's writer (idempotent)."""
    global _writer
    with _writer_lock:
        writer, _writer = _writer, None
    if writer is not None:
        writer.close()


def flush() -> None:
    """Write every buffered metric line now."""
    if _writer is not None:
        _writer.flush()


atexit.register(close_writer)


def report(step: int, **metrics: Any) -> None:
    """Record ``metrics`` at ``step`` for this rank. Does not block. Raises ``TypeError`` on a bad value."""
    from torchrelay.train.context import current_context, current_optimizer

    values: dict[str, float] = {}
    optimizer = current_optimizer()
    extra = getattr(optimizer, "metrics", None)
    if callable(extra):
        for key, value in (extra() or {}).items():
            values[str(key)] = metric_value(str(key), value)
    for key, value in metrics.items():
        values[key] = metric_value(key, value)
    writer = _writer if _writer is not None else install_writer(current_context().rank)
    writer.write(step, values)
