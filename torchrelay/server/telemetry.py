"""A job's log lines and metric points: storing what agents ship, and the pages clients read.

The rows of ``logs``, ``metrics`` and ``ingest_cursors`` are read and written here only (the
job, launch and node rows in ``rows.py``). Agents may resend a batch (a lost reply): each
record carries the agent's sequence number per (launch, rank, stream) and a cursor per key
keeps the highest stored, so a resend adds nothing. Every function runs inside the caller's
unit of work (``rows.Database``) and changes nothing outside it.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Iterable

from sqlalchemy import Text, insert, select, type_coerce
from sqlalchemy.orm import Session

from torchrelay.server.store import CursorRow, JobRow, LogRow, MetricRow
from torchrelay.spec import JobState
from torchrelay.wire import LogBatch, LogLine, LogPage, MetricBatch, MetricPage, MetricPoint, MetricRecord


def add_logs(s: Session, job: JobRow, batch: LogBatch) -> int:
    """Store the batch's new records (one bulk INSERT: ingest runs on the workers' cores). Returns rows added."""
    fresh = _unseen(s, batch.records, lambda r: f"{batch.launch_id}/{r.rank}/{r.stream}")
    if fresh:
        s.execute(insert(LogRow), [
            {"job_seq": job.seq, "launch_id": batch.launch_id, "attempt": r.attempt, "rank": r.rank,
             "stream": r.stream, "agent_seq": r.seq, "text": r.text} for r in fresh])
    return len(fresh)


def add_metrics(s: Session, job: JobRow, batch: MetricBatch) -> list[MetricRecord]:
    """Store the batch's new points; returns them (``last_metrics`` makes the job's summary)."""
    fresh = _unseen(s, batch.records, lambda r: f"{batch.launch_id}/{r.rank}/metrics")
    if fresh:
        s.execute(insert(MetricRow), [
            {"job_seq": job.seq, "launch_id": batch.launch_id, "rank": r.rank, "agent_seq": r.seq,
             "step": r.step, "time": r.time, "values": r.values} for r in fresh])
    return fresh


PER_RANK_KEYS = ("share", "measured_samples_per_s", "idle_fraction")  # what `relay status` shows per rank


def last_metrics(previous: dict[str, Any] | None, fresh: list[MetricRecord]) -> dict[str, Any]:
    """The job's last metrics after ``fresh`` points (not empty): the lowest rank's newest step;
    under ``ranks``, each rank's newest ``PER_RANK_KEYS`` (a balanced job's shares and speeds, any
    data-parallel job's idle fraction)."""
    latest = min(fresh, key=lambda r: (r.rank, -r.step))
    ranks = dict((previous or {}).get("ranks") or {})
    for record in sorted(fresh, key=lambda r: (r.rank, r.step)):
        picked = {k: record.values[k] for k in PER_RANK_KEYS if k in record.values}
        if picked:
            ranks[str(record.rank)] = {**ranks.get(str(record.rank), {}), **picked}
    out = {**(previous or {}), **latest.values, "step": latest.step, "time": latest.time}
    if ranks:
        out["ranks"] = ranks
    return out


def log_page(s: Session, job: JobRow, after: int, rank: int | None, limit: int) -> LogPage:
    q = select(LogRow).where(LogRow.job_seq == job.seq, LogRow.id > after)
    if rank is not None:
        q = q.where(LogRow.rank == rank)
    lines = list(s.scalars(q.order_by(LogRow.id).limit(limit)))
    out = [LogLine(seq=x.id, rank=x.rank, attempt=x.attempt, stream=x.stream, text=x.text) for x in lines]
    return LogPage(lines=out, next_after=lines[-1].id if lines else after, job_state=JobState(job.state))


def metric_page(s: Session, job: JobRow, after: int, limit: int) -> MetricPage:
    q = select(MetricRow).where(MetricRow.job_seq == job.seq, MetricRow.id > after).order_by(MetricRow.id).limit(limit)
    pts = list(s.scalars(q))
    out = [MetricPoint(seq=p.id, rank=p.rank, step=p.step, time=p.time, values=p.values) for p in pts]
    return MetricPage(points=out, next_after=pts[-1].id if pts else after, job_state=JobState(job.state))


def metric_columns(s: Session, job: JobRow, after: int, limit: int) -> list[tuple[int, int, int, float, dict[str, Any]]]:
    """(id, rank, step, time, values) of the job's metric rows after ``after``, in id order.

    No ORM objects, and the values' JSON texts are parsed in one ``json.loads`` of them all: a
    series cache reads millions of values, and a decode per row costs several times more."""
    q = (select(MetricRow.id, MetricRow.rank, MetricRow.step, MetricRow.time, type_coerce(MetricRow.values, Text))
         .where(MetricRow.job_seq == job.seq, MetricRow.id > after).order_by(MetricRow.id).limit(limit))
    rows = s.execute(q).all()
    texts = [r[4] for r in rows]
    if all(isinstance(t, str) for t in texts):  # drivers that hand JSON back decoded (psycopg) skip this
        texts = json.loads("[" + ",".join(texts) + "]") if texts else []
    return [(r[0], r[1], r[2], r[3], values) for r, values in zip(rows, texts)]


def metric_key_columns(s: Session, job: JobRow, keys: list[str]) -> list[tuple[int, int, int, float, dict[str, Any]]]:
    """``metric_columns``' rows for a few ``keys`` only, every row of the job: the database
    extracts the keys from each row's JSON (SQLite's ``json_extract``, PostgreSQL's ``->>``), so
    Python decodes none of the other keys' values — a big job's first chart, before its whole
    history is in the series cache. A key a row lacks is left out of that row's values. Raises
    the database's error on a row whose JSON it cannot read (the caller falls back)."""
    cols = [MetricRow.values[k].as_float() for k in keys]
    q = (select(MetricRow.id, MetricRow.rank, MetricRow.step, MetricRow.time, *cols)
         .where(MetricRow.job_seq == job.seq).order_by(MetricRow.id))
    out = []
    for r in s.execute(q):
        values = {k: v for k, v in zip(keys, r[4:]) if v is not None}
        out.append((r[0], r[1], r[2], r[3], values))
    return out


def metric_ranks(s: Session, job: JobRow) -> list[int]:
    """Every rank that reported a metric point of the job, ascending."""
    return sorted(s.scalars(select(MetricRow.rank).where(MetricRow.job_seq == job.seq).distinct()))


def recent_steps(s: Session, job: JobRow, count: int) -> list[tuple[int, float]]:
    """(step, time) of the newest ``count`` metric points of the rank that reported last, oldest first."""
    rank = s.scalar(select(MetricRow.rank).where(MetricRow.job_seq == job.seq).order_by(MetricRow.id.desc()).limit(1))
    q = (select(MetricRow.step, MetricRow.time).where(MetricRow.job_seq == job.seq, MetricRow.rank == rank)
         .order_by(MetricRow.id.desc()).limit(count))
    return [(step, t) for step, t in s.execute(q)][::-1]


def _unseen(s: Session, records: Iterable[Any], key_of: Callable[[Any], str]) -> list:
    """The records newer than what was stored before for their key, in sequence order;
    advances each key's cursor."""
    groups: dict[str, list] = {}
    for record in records:
        groups.setdefault(key_of(record), []).append(record)
    out = []
    for key, group in groups.items():
        cursor = s.get(CursorRow, key) or CursorRow(key=key, last_seq=-1)
        fresh = [r for r in sorted(group, key=lambda r: r.seq) if r.seq > cursor.last_seq]
        if fresh:
            cursor.last_seq = fresh[-1].seq
            s.merge(cursor)
            out += fresh
    return out
