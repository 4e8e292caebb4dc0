"""Server-sent event streams: a job's logs, metrics and events, and the cluster's events.

Contract:
- A stream is ``text/event-stream``. It opens with ``retry: 1000``; then each message is
  ``id: <row id>`` / ``event: <kind>`` / ``data: <JSON array of rows>``, the rows in id order
  and the id the last row's own (log line, metric point or event row id). A client that
  reconnects with ``Last-Event-ID`` (or ``?after=`` on its first connect) gets exactly the
  rows after that id: nothing missed, nothing repeated.
- A job's stream ends with ``event: end`` (data: the job's state) once the job is finished
  and every row is sent; the cluster's event stream never ends. A comment line
  (``: keepalive``) goes out when nothing happened for ``keepalive_s``.
- News is awaited on the service's notifier keys (``logs:<seq>``, ``metrics:<seq>``,
  ``events:<seq>``, ``events``), as the long-polls do; reads run in the thread pool.
- Clients following the same feed from the same row share one read and one encoding
  (``SharedReads``): a hundred browsers on one job cost about one.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from anyio.to_thread import run_sync
from pydantic import TypeAdapter

from torchrelay.errors import InvalidSpec
from torchrelay.server.service import ClusterService
from torchrelay.spec import JobState
from torchrelay.wire import EventRecord, LogLine, MetricPoint

KEEPALIVE_S = 15.0
_LOGS = TypeAdapter(list[LogLine])
_METRICS = TypeAdapter(list[MetricPoint])
_EVENTS = TypeAdapter(list[EventRecord])


@dataclass(frozen=True, slots=True)
class Chunk:
    """One read of a feed: the encoded message (b"" when no rows), the last row id, whether
    the read was a full page (more may be waiting) and whether the job had finished."""

    message: bytes
    last_id: int
    full: bool
    finished: JobState | None


@dataclass(frozen=True, slots=True)
class Feed:
    """What a stream follows: ``ident`` names it for sharing; ``read(after)`` blocks (SQL)."""

    ident: str
    notify_key: str
    read: Callable[[int], Chunk]


MAX_ROW_ID = 2**63 - 1  # the state store's 64-bit keys: a larger id would overflow the query


def start_id(last_event_id: str | None, after: int) -> int:
    """The row id a stream starts after: the ``Last-Event-ID`` header wins over ``?after=``.
    Raises InvalidSpec naming a header (or ``after``) that is not a row id."""
    if last_event_id is None or last_event_id.strip() == "":
        if after > MAX_ROW_ID:
            raise InvalidSpec(f"after={after} is not a row id (at most {MAX_ROW_ID})")
        return after
    try:
        value = int(last_event_id)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_ROW_ID:
        raise InvalidSpec(f"Last-Event-ID {last_event_id!r} is not a row id; send the `id:` of the last "
                          f"message received (a whole number 0 .. {MAX_ROW_ID})")
    return value


def message(kind: str, last_id: int, data: bytes) -> bytes:
    return b"id: %d\nevent: %s\ndata: %s\n\n" % (last_id, kind.encode(), data)


# ------------------------------------------------------------------ the feeds


def log_feed(svc: ClusterService, job_id: str, seq: int, rank: int | None, limit: int = 2000) -> Feed:
    def read(after: int) -> Chunk:
        page = svc.logs(job_id, after, rank, limit)
        return _chunk("logs", page.lines, _LOGS, page.next_after, limit, page.job_state)
    return Feed(f"logs:{seq}:{rank}", f"logs:{seq}", read)


def metric_feed(svc: ClusterService, job_id: str, seq: int, limit: int = 5000) -> Feed:
    def read(after: int) -> Chunk:
        page = svc.metrics(job_id, after, limit)
        return _chunk("metrics", page.points, _METRICS, page.next_after, limit, page.job_state)
    return Feed(f"metrics:{seq}", f"metrics:{seq}", read)


def event_feed(svc: ClusterService, job_id: str | None, seq: int | None, user: str | None = None,
               limit: int = 1000) -> Feed:
    """A job's events (``job_id``), or every job's (None; with ``user``: that user's jobs' only)."""
    def read(after: int) -> Chunk:
        events, state = svc.events(after, job_id, limit)
        last = events[-1].id if events else after
        full = len(events) >= limit
        if user is not None and events:
            mine = {j.id for j in svc.list_jobs(None, 10000, user=user)}
            events = [e for e in events if e.job_id in mine]
        chunk = _chunk("events", events, _EVENTS, last, limit, state)
        return Chunk(chunk.message if events else b"", last, full, chunk.finished)
    key = "events" if seq is None else f"events:{seq}"
    return Feed(key if user is None else f"{key}@{user}", key, read)


def _chunk(kind: str, rows: list, adapter: TypeAdapter, last_id: int, limit: int, state: JobState | None) -> Chunk:
    data = message(kind, last_id, adapter.dump_json(rows)) if rows else b""
    return Chunk(data, last_id, len(rows) >= limit, state if state is not None and state.terminal else None)


# ------------------------------------------------------------------ following


class SharedReads:
    """One read per (feed, start row, notifier version), whoever asks: concurrent followers of a
    feed await the same future. Keeps at most ``capacity`` results (the oldest go first).
    Event-loop only."""

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self._results: dict[tuple[str, int, int], asyncio.Future[Chunk]] = {}

    async def read(self, feed: Feed, after: int, version: int) -> Chunk:
        key = (feed.ident, after, version)
        task = self._results.get(key)
        if task is None:
            if len(self._results) >= self.capacity:
                for old in list(self._results)[: self.capacity // 2]:
                    if self._results[old].done():
                        del self._results[old]
            # a task of its own: a follower that goes away does not cancel the others' read
            task = asyncio.ensure_future(run_sync(feed.read, after))
            task.add_done_callback(lambda t: t.cancelled() or t.exception() is None or self._results.pop(key, None))
            self._results[key] = task
        return await asyncio.shield(task)


async def follow(svc: ClusterService, feed: Feed, after: int, shared: SharedReads,
                 keepalive_s: float = KEEPALIVE_S) -> AsyncIterator[bytes]:
    """The SSE bytes of ``feed`` from row ``after`` on; see the module docstring."""
    yield b"retry: 1000\n\n"
    while True:
        version = svc.notifier.version(feed.notify_key)
        chunk = await shared.read(feed, after, version)
        if chunk.message:
            yield chunk.message
            after = chunk.last_id
        if chunk.full:
            continue
        if chunk.finished is not None:
            if not chunk.message:
                yield b'event: end\ndata: "%s"\n\n' % chunk.finished.value.encode()
                return
            continue  # drain: read once more before the end
        if svc.notifier.closed:
            return  # the server is shutting down: the browser's EventSource reconnects (retry above)
        if await svc.notifier.wait(feed.notify_key, version, keepalive_s) == version:
            yield b": keepalive\n\n"
