"""TensorBoard event files of every job, written by the server among the job's artifacts.

Why the server and not the workers: every reported metric already reaches the server (all
ranks, every launcher, scripts that never import a TensorBoard writer), the files then exist
for any job, also for torchrun scripts that only call ``report``, and workers need no extra
dependency or store access. The cost is one pass over the job's metric rows when it ends.

Contract:
- ``event_files(points)`` (pure) maps each run to the bytes of one event file: run
  ``rank-<lowest rank>`` always, and ``rank-R`` for every other rank whose values differ
  from the lowest rank's (same steps, same values: not repeated). Each point becomes one
  ``Event`` with one ``simple_value`` per metric key, at its step and wall time.
- ``Exporter(svc).export(job_id)`` writes them as the artifacts
  ``tensorboard/<run>/events.out.tfevents.0.torchrelay`` (replacing earlier ones; idempotent)
  and returns their paths. Blocks (SQL, store). Raises NotFound.
- ``Exporter.start()`` runs a daemon thread that exports each job once it has finished
  (watching the event rows, every ``poll_s``); ``stop()`` ends it. Without the ``tensorboard``
  package (the ``[tensorboard]`` extra) nothing is written and ``export`` raises
  ``InvalidSpec`` saying what to install.
"""
from __future__ import annotations

import io
import logging
import threading
from typing import Any, Iterable

from fastapi import APIRouter

from torchrelay.errors import InvalidSpec
from torchrelay.server import telemetry
from torchrelay.server.service import ClusterService
from torchrelay.spec import JobState
from torchrelay.wire import API_PREFIX

FILE_NAME = "events.out.tfevents.0.torchrelay"
FOLDER = "tensorboard"
_log = logging.getLogger("torchrelay.server")

Point = tuple[int, int, float, dict[str, Any]]  # (rank, step, wall time, values)


def available() -> bool:
    try:
        import tensorboard.compat.proto.event_pb2  # noqa: F401
    except ImportError:
        return False
    return True


def event_files(points: Iterable[Point]) -> dict[str, bytes]:
    """{run name: event file bytes}; see the module docstring."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.record_writer import RecordWriter

    by_rank: dict[int, list[Point]] = {}
    for point in points:
        by_rank.setdefault(point[0], []).append(point)
    if not by_rank:
        return {}
    lowest = min(by_rank)
    base = [(p[1], p[3]) for p in by_rank[lowest]]
    out = {}
    for rank, pts in sorted(by_rank.items()):
        if rank != lowest and [(p[1], p[3]) for p in pts] == base:
            continue
        buf = io.BytesIO()
        writer = RecordWriter(buf)
        writer.write(Event(wall_time=pts[0][2] if pts else 0.0, file_version="brain.Event:2").SerializeToString())
        for _, step, wall, values in pts:
            summary = Summary(value=[Summary.Value(tag=k, simple_value=float(v)) for k, v in sorted(values.items())
                                     if isinstance(v, (int, float))])
            writer.write(Event(wall_time=wall, step=step, summary=summary).SerializeToString())
        out[f"rank-{rank}"] = buf.getvalue()
    return out


class Exporter:
    def __init__(self, svc: ClusterService, poll_s: float = 1.0):
        self.svc, self.poll_s = svc, poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def export(self, job_id: str) -> list[str]:
        if not available():
            raise InvalidSpec("TensorBoard files need the `tensorboard` package on the server: "
                              "pip install 'torchrelay[tensorboard]'")
        points: list[Point] = []
        with self.svc.db.read() as rows:
            row = rows.job(job_id)
            job_id, after = row.id, 0
            while True:
                chunk = telemetry.metric_columns(rows.s, row, after, 50_000)
                points += [(rank, step, wall, values) for _, rank, step, wall, values in chunk]
                if len(chunk) < 50_000:
                    break
                after = chunk[-1][0]
        written = []
        for run, data in event_files(points).items():
            path = f"{FOLDER}/{run}/{FILE_NAME}"
            self.svc.put_artifact(job_id, path, data)
            written.append(path)
        return written

    def start(self) -> None:
        """Export every job that finishes from now on (and those that finished since the newest
        event seen at start). Idempotent; a daemon thread."""
        if self._thread is None and available():
            self._thread = threading.Thread(target=self._run, name="relay-tensorboard", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _run(self) -> None:
        after = self.svc.last_event_id()
        while not self._stop.wait(self.poll_s):
            try:
                events, _ = self.svc.events(after, None, 1000)
                for ev in events:
                    if ev.state in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED):
                        self.export(ev.job_id)
                    after = ev.id
            except Exception:  # the thread must outlive one bad job; the error is logged
                _log.exception("writing TensorBoard files failed")


def tensorboard_routes(exporter: Exporter) -> APIRouter:
    api = APIRouter(prefix=API_PREFIX)

    @api.post("/jobs/{job_id}/tensorboard", response_model=list[str])
    def write_tensorboard(job_id: str) -> list[str]:
        """Write (again) the job's TensorBoard event files from its metrics so far; returns the
        artifact paths. Finished jobs have them already; `relay tensorboard` calls this first."""
        return exporter.export(job_id)

    return api
