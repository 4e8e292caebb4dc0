"""A job's metric series for charts: columnar, cached in memory, served downsampled.

Contract:
- ``SeriesCache(db).page(job_id, keys=None, rank=None, points=1000, start=None, end=None)``
  returns a ``SeriesPage``: for each metric key (all when ``keys`` is None) and rank, the
  points with ``start <= step <= end`` (one more on each side), downsampled to at most
  ``points`` by ``downsample.keep`` (a zoomed range that holds fewer points is full
  resolution). With ``rank`` None, rank R's series of a key is included only where it
  differs from the lowest rank's (ranks of a data-parallel job usually agree).
  ``page.after`` is the last metric row included: a metrics stream from there continues it.
- A request for a few ``keys`` (at most ``_FEW_KEYS``) of a job the cache does not hold yet is
  answered from just those keys, extracted by the database, without filling the cache: a big
  job's first chart comes before the whole history is decoded (the dashboard asks for its
  first chart's key first, then for all).
- The cache reads only the rows added since its last read (by row id); it blocks (SQL) and is
  thread-safe (one lock). Jobs are evicted, least recently read first, past ``max_points``.
- A step at or below a series' last step (an attempt resumed from an earlier checkpoint)
  replaces that series' tail from the step on: the chart shows the history the newest
  attempt continues, as TensorBoard does with ``purge_step``.
- Raises NotFound (job), InvalidSpec (``points`` out of range, naming it).
"""
from __future__ import annotations

import operator
import threading
from array import array
from bisect import bisect_left
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
from sqlalchemy.exc import DBAPIError

from torchrelay.errors import InvalidSpec
from torchrelay.server import telemetry
from torchrelay.server.downsample import MIN_POINTS, keep, window
from torchrelay.server.rows import Database
from torchrelay.spec import JobState
from torchrelay.wire import Series, SeriesPage

MAX_POINTS_PER_SERIES = 100_000
_READ_ROWS = 50_000
_FEW_KEYS = 4  # a request for at most this many keys of a job not yet cached reads only them
_SUMMARY_KEYS = ("step", "time", "ranks")  # what the job's last_metrics holds besides reported keys


class _Line:
    """One rank's values of one key, in step order."""

    __slots__ = ("steps", "values")

    def __init__(self) -> None:
        self.steps = array("q")
        self.values = array("d")

    def add(self, step: int, value: float) -> int:
        """Append; returns the change in the number of points (negative when a tail was cut)."""
        removed = 0
        if self.steps and step <= self.steps[-1]:
            cut = bisect_left(self.steps, step)
            removed = len(self.steps) - cut
            del self.steps[cut:]
            del self.values[cut:]
        self.steps.append(step)
        self.values.append(value)
        return 1 - removed

    def extend(self, steps: list[int], values: np.ndarray) -> int:
        """``add`` for many points (``values`` float64, NaN for missing): one bulk copy when they
        continue the line in step order."""
        s = np.asarray(steps, dtype=np.int64)
        if (not self.steps or s[0] > self.steps[-1]) and bool(np.all(s[1:] > s[:-1])):
            self.steps.frombytes(s.tobytes())
            self.values.frombytes(np.ascontiguousarray(values, dtype=np.float64).tobytes())
            return len(steps)
        return sum(self.add(int(step), float(v)) for step, v in zip(steps, values))

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        # copies: a numpy view would pin the array's buffer and forbid the next append
        return np.array(self.steps, dtype=np.int64), np.array(self.values, dtype=np.float64)


@dataclass
class _Job:
    upto: int = 0
    points: int = 0
    lines: dict[tuple[str, int], _Line] = field(default_factory=dict)
    # pages built since the last new row, by request (a finished job's page is built once)
    pages: dict[tuple, SeriesPage] = field(default_factory=dict)

    def add_rows(self, rows: list[tuple[int, int, int, float, dict]]) -> None:
        # Rows of one rank that report the same keys (the usual case) become one matrix, read by
        # C-level itemgetters and copied into each line in bulk: a big job's first read is
        # millions of values, and a Python loop per value would cost seconds.
        groups: dict[tuple[int, tuple[str, ...]], tuple[list[int], list[dict]]] = {}
        for _row_id, rank, step, _time, values in rows:
            group = groups.get((rank, tuple(values)))
            if group is None:
                group = groups[(rank, tuple(values))] = ([], [])
            group[0].append(step)
            group[1].append(values)
        for (rank, keys), (steps, dicts) in groups.items():
            if not keys:
                continue
            get = operator.itemgetter(*keys)
            matrix = np.array([get(v) for v in dicts], dtype=np.float64).reshape(len(dicts), len(keys))
            for j, key in enumerate(keys):
                line = self.lines.get((key, rank))
                if line is None:
                    line = self.lines[(key, rank)] = _Line()
                self.points += line.extend(steps, matrix[:, j])
        if rows:
            self.upto = rows[-1][0]
            self.pages.clear()


class SeriesCache:
    def __init__(self, db: Database, max_points: int = 16_000_000):
        self.db = db
        self.max_points = max_points
        self._lock = threading.Lock()
        self._jobs: OrderedDict[int, _Job] = OrderedDict()

    def page(self, job_id: str, keys: list[str] | None = None, rank: int | None = None, points: int = 1000,
             start: float | None = None, end: float | None = None) -> SeriesPage:
        if not MIN_POINTS <= points <= MAX_POINTS_PER_SERIES:
            raise InvalidSpec(f"points={points} is out of range; use {MIN_POINTS}..{MAX_POINTS_PER_SERIES}")
        with self.db.read() as rows:
            row = rows.job(job_id)
            state = JobState(row.state)
            if keys and len(keys) <= _FEW_KEYS and not self._cached(row.seq):
                first = _few_keys_page(rows.s, row, state, keys, rank, points, start, end)
                if first is not None:
                    return first
            with self._lock:
                job = self._refreshed(rows.s, row)
                request = (tuple(keys) if keys is not None else None, rank, points, start, end, state)
                page = job.pages.get(request)
                if page is None:
                    if len(job.pages) >= 16:
                        job.pages.clear()
                    page = job.pages[request] = _build(job, state, keys, rank, points, start, end)
                return page

    def _cached(self, seq: int) -> bool:
        with self._lock:
            return seq in self._jobs

    def _refreshed(self, s, row) -> _Job:  # noqa: ANN001
        job = self._jobs.pop(row.seq, None) or _Job()
        self._jobs[row.seq] = job  # most recently read last
        while True:
            fresh = telemetry.metric_columns(s, row, job.upto, _READ_ROWS)
            job.add_rows(fresh)
            if len(fresh) < _READ_ROWS:
                break
        while sum(j.points for j in self._jobs.values()) > self.max_points and len(self._jobs) > 1:
            self._jobs.popitem(last=False)
        return job


def _few_keys_page(s, row, state: JobState, keys: list[str], rank: int | None, points: int,  # noqa: ANN001
                   start: float | None, end: float | None) -> SeriesPage | None:
    """A page of a few keys of a job the cache does not hold yet, read without filling the cache:
    the database extracts just those keys (``telemetry.metric_key_columns``), so a big job's
    first chart does not wait for every key's history to be decoded. None when the database
    cannot extract them (a row whose JSON it does not read, e.g. a NaN written by an old
    version): the caller reads everything instead."""
    try:
        fresh = telemetry.metric_key_columns(s, row, list(keys))
        ranks = telemetry.metric_ranks(s, row)
    except DBAPIError:
        s.rollback()
        return None
    job = _Job()
    job.add_rows(fresh)
    page = _build(job, state, keys, rank, points, start, end)
    reported = sorted(k for k in (row.last_metrics or {}) if k not in _SUMMARY_KEYS)
    return page.model_copy(update={"keys": sorted(set(reported) | set(page.keys)), "ranks": ranks})


def _build(job: _Job, state: JobState, keys: list[str] | None, rank: int | None, points: int,
           start: float | None, end: float | None) -> SeriesPage:
    all_keys = sorted({k for k, _ in job.lines})
    all_ranks = sorted({r for _, r in job.lines})
    out = []
    for key in (all_keys if keys is None else [k for k in keys if k in all_keys]):
        ranks = sorted(r for k, r in job.lines if k == key)
        base = job.lines[(key, ranks[0])].arrays()
        for r in ranks:
            x, y = base if r == ranks[0] else job.lines[(key, r)].arrays()
            if rank is not None and r != rank:
                continue
            if rank is None and r != ranks[0] and _same(base, (x, y)):
                continue
            lo, hi = window(x, start, end)
            idx = lo + keep(x[lo:hi], y[lo:hi], points)
            ys = y[idx]
            out.append(Series(key=key, rank=r, total=int(x.size), x=x[idx].tolist(),
                              y=np.where(np.isfinite(ys), ys, None).tolist()))
    return SeriesPage(after=job.upto, job_state=state, keys=all_keys, ranks=all_ranks, series=out)


def _same(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> bool:
    return a[0].size == b[0].size and bool(np.array_equal(a[0], b[0])) and bool(
        np.array_equal(a[1], b[1], equal_nan=True))
