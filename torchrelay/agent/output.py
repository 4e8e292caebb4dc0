"""A launch's output as records: the lines of its rank logs and the points of its metric files.

Contract:
- ``LineTailer(path).read(final)``: the complete lines appended since the last read (the file
  may not exist yet; never raises on I/O); with ``final`` also the unterminated rest. A "line"
  longer than ``MAX_LINE_BYTES`` is cut into pieces.
- ``split_tagged_line`` and ``parse_metric_line`` are pure: one line of a rank log
  (``o ``/``e `` prefix, see ``torchrelay.agent.worker``) or of a metrics file
  (``{"step", "time", "values"}``) in, a stream and text or a ``wire.MetricRecord`` out.
- ``LaunchOutput(run_dir, ranks, attempt)`` tails ``logs/rank-R.log`` and
  ``metrics/rank-R.jsonl`` of each rank: ``read(final)`` returns the new ``wire.LogRecord``s and
  ``wire.MetricRecord``s, numbered per (rank, stream) and per rank from 0 (the numbers the server
  dedups resends by); ``last_lines[rank]`` keeps each rank's last ``LAST_LINES`` lines that are
  not blank (they are a failure's evidence; the log keeps every line). Not thread-safe: its
  launch serialises the reads.
"""
from __future__ import annotations

import collections
import json
import logging
from collections.abc import Sequence
from pathlib import Path

from torchrelay import wire
from torchrelay.agent import worker
from torchrelay.agent.exits import LAST_LINES

log = logging.getLogger(__name__)

MAX_LINE_BYTES = worker.MAX_LINE_BYTES  # as the worker cuts them


class LineTailer:
    """Complete lines appended to a file since the last read (the file may not exist yet)."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0
        self._partial = b""

    def read(self, final: bool = False) -> list[str]:
        """New complete lines; with ``final`` also the unterminated rest. Never raises on I/O."""
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except OSError:
            data = b""
        self._offset += len(data)
        data = self._partial + data
        pieces = data.split(b"\n")
        self._partial = pieces.pop()
        while len(self._partial) > MAX_LINE_BYTES:
            pieces.append(self._partial[:MAX_LINE_BYTES])
            self._partial = self._partial[MAX_LINE_BYTES:]
        if final and self._partial:
            pieces.append(self._partial)
            self._partial = b""
        return [p.rstrip(b"\r").decode("utf-8", errors="replace") for p in pieces]


def split_tagged_line(line: str) -> tuple[str, str]:
    """``("stdout" | "stderr", text)`` of one line of a rank's log (``o ``/``e `` prefix)."""
    if line.startswith("e "):
        return "stderr", line[2:]
    if line.startswith("o "):
        return "stdout", line[2:]
    return "stdout", line


def parse_metric_line(line: str, *, rank: int, seq: int) -> wire.MetricRecord | None:
    """A ``MetricRecord`` from one JSON line ``{"step", "time", "values"}``; None if malformed."""
    try:
        data = json.loads(line)
        return wire.MetricRecord(rank=rank, seq=seq, step=int(data["step"]),
                                 time=float(data["time"]),
                                 values={str(k): float(v) for k, v in data["values"].items()})
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


class LaunchOutput:
    """The rank logs and metric files of one launch, read as records."""

    def __init__(self, run_dir: Path, ranks: Sequence[int], *, attempt: int, launch_id: str = ""):
        self.attempt = attempt
        self.launch_id = launch_id
        self._logs = {rank: LineTailer(run_dir / "logs" / f"rank-{rank}.log") for rank in ranks}
        self._metrics = {rank: LineTailer(run_dir / "metrics" / f"rank-{rank}.jsonl") for rank in ranks}
        self._log_seq = {(rank, stream): 0 for rank in ranks for stream in ("stdout", "stderr")}
        self._metric_seq = {rank: 0 for rank in ranks}
        self.last_lines = {rank: collections.deque(maxlen=LAST_LINES) for rank in ranks}

    def read(self, final: bool) -> tuple[list[wire.LogRecord], list[wire.MetricRecord]]:
        """The records written since the last read (see the module docstring)."""
        logs = []
        for rank, tailer in self._logs.items():
            for line in tailer.read(final=final):
                stream, text = split_tagged_line(line)
                logs.append(wire.LogRecord(rank=rank, attempt=self.attempt, stream=stream,
                                           seq=self._log_seq[(rank, stream)], text=text))
                self._log_seq[(rank, stream)] += 1
                if text.strip():  # a blank line at exit (seen from a rank's runtime) would push out the cause
                    self.last_lines[rank].append(text)
        metrics = []
        for rank, tailer in self._metrics.items():
            for line in tailer.read(final=final):
                seq = self._metric_seq[rank]
                self._metric_seq[rank] += 1
                record = parse_metric_line(line, rank=rank, seq=seq)
                if record is None:
                    log.warning("launch %s rank %d: metrics line %d is not "
                                '{"step": int, "time": float, "values": {...}}: %.200s',
                                self.launch_id, rank, seq, line)
                else:
                    metrics.append(record)
        return logs, metrics
