"""One rank's metrics file: records checked, formatted and appended in whole lines.

Contract:
- ``metric_value(key, value)`` is a real number as a float (int, float, bool, numpy scalars,
  one-element tensors); anything else raises ``TypeError`` naming the key and value. NaN and
  infinities are kept (written as JSON ``NaN``/``Infinity``, which Python's json reads back).
- ``format_record(step, time_s, values)`` is one line ``{"step", "time", "values"}``. Pure.
- ``metrics_path(env, rank)`` is ``$RELAY_METRICS_DIR/rank-$RANK.jsonl``, or None without the variable.
- ``MetricsWriter`` buffers lines and appends them (whole lines, one ``write``) from a background
  thread at the latest ``FLUSH_INTERVAL_S`` after they were written, when it holds
  ``MAX_BUFFERED`` lines, on ``flush()`` and on ``close()``.

Imports no other module of ``torchrelay.train`` (``train.report`` owns the process's writer).
"""
from __future__ import annotations

import json
import numbers
import os
import threading
import time
from typing import Any, Callable, Mapping

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


def metrics_path(env: Mapping[str, str], rank: int) -> str | None:
    """Where rank ``rank`` writes its metrics, or None when ``RELAY_METRICS_DIR`` is unset."""
    directory = env.get("RELAY_METRICS_DIR")
    return os.path.join(directory, f"rank-{rank}.jsonl") if directory else None
