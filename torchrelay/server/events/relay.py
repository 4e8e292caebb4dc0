"""One thread per sink: read the store's events after the sink's cursors, publish, move the cursors.

Contract:
- ``EventRelay(url, engine, sink=None)``; ``start()`` starts its daemon thread; ``stop()``
  (idempotent) ends it and closes the sink, waiting at most ``timeout`` s.
- Three feeds (``model.FEEDS``): job events (state changes and checkpoint commits), node
  events, and a metric summary per job every ``summary_s`` (5 s). Delivery is at least once
  and in ``seq`` order within each feed: a batch is read after the feed's cursor in ``seq``
  order, the cursor moves only past what the broker confirmed (``model.next_cursor``) and is kept in the store (``event_cursors``, one row per
  sink URL and feed), so a restarted server resumes where the broker last confirmed; a
  consumer drops a ``(kind, seq)`` it has seen.
- While the broker cannot be reached the relay logs it (the first time and then once a
  minute), keeps the events (they are rows of the store anyway) and tries again with a backoff
  of 0.2 s doubling to 5 s; it never raises. It only reads the store and writes its own cursor
  row, outside the server's writer lock, so a broker that hangs delays nothing of the control
  plane (heartbeats, submits).
- ``active`` (default: always): whether this server should publish now. Among several servers
  on one state store only the leader does (``main.serve`` passes its leadership), so two relays
  never send one feed at once; a relay that becomes active re-reads its cursors from the store,
  where the previous leader left them.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import select

from torchrelay.server.events.model import Event, job_event, metric_summaries, next_cursor
from torchrelay.server.events.sinks import Sink, SinkUnavailable, make_sink
from torchrelay.server.events.urls import SinkUrl
from torchrelay.server.store import EventCursorRow, EventRow, MetricRow, NodeEventRow
from torchrelay.server.views import job_id_of

log = logging.getLogger(__name__)
BATCH = 2000  # events a publish carries: the sink streams them and waits for the confirms once


def read_job_events(engine: Any, after: int, limit: int = BATCH) -> list[Event]:
    """The store's job events after ``after``, oldest first: kind ``state``, or ``checkpoint``
    for a commit (with its step, attempt and url)."""
    table = EventRow.__table__
    with engine.connect() as conn:
        rows = conn.execute(select(table.c.id, table.c.job_seq, table.c.time, table.c.state, table.c.message,
                                   table.c.kind, table.c.detail)
                            .where(table.c.id > after).order_by(table.c.id).limit(limit)).all()
    return [job_event(r.id, job_id_of(r.job_seq), r.time, r.state, r.message or "", r.kind, r.detail) for r in rows]


def read_node_events(engine: Any, after: int, limit: int = BATCH) -> list[Event]:
    table = NodeEventRow.__table__
    with engine.connect() as conn:
        rows = conn.execute(select(table.c.id, table.c.node_name, table.c.time, table.c.state)
                            .where(table.c.id > after).order_by(table.c.id).limit(limit)).all()
    return [Event(seq=r.id, time=r.time, kind="node", node=r.node_name, state=r.state) for r in rows]


def read_metric_summaries(engine: Any, after: int, limit: int = 10_000) -> list[Event]:
    """One summary per job of the metric points stored after ``after`` (``metric_summaries``)."""
    table = MetricRow.__table__
    with engine.connect() as conn:
        rows = conn.execute(select(table.c.id, table.c.job_seq, table.c.rank, table.c.step, table.c.time,
                                   table.c["values"]).where(table.c.id > after).order_by(table.c.id).limit(limit)).all()
    return metric_summaries([(r.id, job_id_of(r.job_seq), r.rank, r.step, r.time, r[5] or {}) for r in rows])


# feed -> how its events are read after a cursor
FEED_READERS: dict[str, Callable[[Any, int], list[Event]]] = {
    "state": read_job_events, "node": read_node_events, "metrics": read_metric_summaries}


def load_cursor(engine: Any, name: str) -> int:
    table = EventCursorRow.__table__
    with engine.connect() as conn:
        seq = conn.execute(select(table.c.seq).where(table.c.name == name)).scalar()
    return int(seq or 0)


def save_cursor(engine: Any, name: str, seq: int) -> None:
    table = EventCursorRow.__table__
    with engine.begin() as conn:
        if conn.execute(table.update().where(table.c.name == name).values(seq=seq)).rowcount == 0:
            conn.execute(table.insert().values(name=name, seq=seq))


class EventRelay:
    def __init__(self, url: SinkUrl, engine: Any, sink: Sink | None = None, idle_s: float = 0.05,
                 summary_s: float = 5.0, active: Callable[[], bool] = lambda: True):
        self.url = url
        self.active = active
        self.summary_s = summary_s
        self.engine = engine
        self.sink = sink or make_sink(url)
        self.idle_s = idle_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"relay-events-{url.kind}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.sink.close()

    def _run(self) -> None:
        cursors: dict[str, int] = {}
        due: dict[str, float] = {}  # feed -> monotonic time of its next read
        backoff, warned_at = 0.2, None
        while not self._stop.is_set():
            if not self.active():
                cursors.clear()  # whoever leads meanwhile moves them: read them again when we lead
                self._stop.wait(max(self.idle_s, 0.5))
                continue
            try:
                busy = False
                for feed, read in FEED_READERS.items():
                    if time.monotonic() < due.get(feed, 0.0):
                        continue
                    name = f"{self.url.redacted}#{feed}"
                    if feed not in cursors:
                        cursors[feed] = load_cursor(self.engine, name)
                    events = read(self.engine, cursors[feed])
                    if feed == "metrics":  # a summary every few seconds, not one per point
                        due[feed] = time.monotonic() + self.summary_s
                    if not events:
                        continue
                    confirmed = self.sink.publish(events)
                    if confirmed:
                        cursors[feed] = next_cursor(cursors[feed], events, confirmed)
                        save_cursor(self.engine, name, cursors[feed])
                        busy, backoff, warned_at = True, 0.2, None
                if not busy:
                    self._stop.wait(self.idle_s)
            except SinkUnavailable as exc:
                if warned_at is None or time.monotonic() - warned_at > 60:
                    log.warning("events: %s; keeping them and retrying", exc)
                    warned_at = time.monotonic()
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            except Exception:  # noqa: BLE001 - the relay must outlive a store hiccup
                log.exception("events to %s: unexpected error; retrying", self.url.redacted)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
