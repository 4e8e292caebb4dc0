"""What the agent owes the server, in order: launch statuses and log and metric batches, numbered.

Every entry gets the next sequence number when it is put; an entry is *waiting*, then *in flight*
(taken by a sender), then either delivered (gone) or back to waiting (sent again later). Statuses
travel in heartbeats, batches in posts of their own (``/jobs/{job}/logs`` and ``/metrics``).

Contract (thread-safe: one lock of its own, never held while calling out; no I/O, no clock):
- ``put_status(launch_id, status)``: a ``preparing`` of that launch still waiting is dropped
  first, since it says nothing the new status does not (node 0's ``running`` repeats the port):
  a launch that started within one heartbeat costs the server two reports instead of three or
  four. ``running`` and ``exited`` are always kept: the job's history shows both.
- ``put_records(launch_id, job_id, logs, metrics)``: one batch per kind (none for no records).
  A launch keeps at most ``max_records`` waiting records; beyond that its oldest are dropped
  (returns how many, so that the caller can say so).
- ``take_statuses(carrier)`` marks and returns the waiting statuses a heartbeat may carry now,
  oldest first: all of them, except an ``exited`` while a batch of its launch put before it was
  not delivered (a launch's last status never reaches the server before its last lines).
  ``Carrier.HEARTBEAT``: the node's own heartbeat; ``Carrier.LONG_POLL``: the same, which then
  waits for the server (until ``end_long_poll``); ``Carrier.ASIDE``: a heartbeat of its own,
  sent only while a long poll is in flight (else the next heartbeat carries them: nothing is
  returned); ``Carrier.FINAL``: the agent is closing, whatever is ready.
- ``take_records()`` marks and returns the waiting batches (none while an earlier take is not
  settled: batches of one launch reach the server in order, its dedup cursor relies on it).
- ``settle(entries, delivered)``: delivered entries are gone; the others wait again.
- ``owes(launch_id)``: whether anything of that launch is waiting or in flight.
"""
from __future__ import annotations

import enum
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from torchrelay import wire

MAX_BUFFERED_RECORDS = 200_000  # per launch; beyond this the oldest are dropped


class EntryKind(enum.Enum):
    STATUS = "status"
    LOGS = "logs"
    METRICS = "metrics"


class Carrier(enum.Enum):
    """Which heartbeat would carry the statuses taken (see ``Outbox.take_statuses``)."""

    HEARTBEAT = "heartbeat"
    LONG_POLL = "long poll"
    ASIDE = "aside"
    FINAL = "final"


@dataclass(frozen=True, kw_only=True, slots=True)
class Entry:
    seq: int
    kind: EntryKind
    launch_id: str
    job_id: str = ""  # batches: the job whose endpoint takes them
    status: wire.LaunchStatus | None = None  # STATUS
    records: tuple = ()  # LOGS: wire.LogRecord, METRICS: wire.MetricRecord


class Outbox:
    def __init__(self, max_records: int = MAX_BUFFERED_RECORDS):
        self.max_records = max_records
        self._lock = threading.Lock()
        self._entries: list[Entry] = []  # in seq order
        self._in_flight: set[int] = set()  # seqs
        self._next_seq = 0
        self._long_poll = False

    def _append(self, **fields) -> Entry:
        entry = Entry(seq=self._next_seq, **fields)
        self._next_seq += 1
        self._entries.append(entry)
        return entry

    def put_status(self, launch_id: str, status: wire.LaunchStatus) -> int:
        """Queue a status change of ``launch_id``; its sequence number."""
        with self._lock:
            self._entries = [e for e in self._entries if not (
                e.kind is EntryKind.STATUS and e.launch_id == launch_id and e.status.state == "preparing"
                and e.seq not in self._in_flight)]
            return self._append(kind=EntryKind.STATUS, launch_id=launch_id, status=status).seq

    def put_records(self, launch_id: str, job_id: str, logs: Sequence[wire.LogRecord],
                    metrics: Sequence[wire.MetricRecord]) -> int:
        """Queue a launch's new records; how many old ones were dropped to stay in bounds."""
        with self._lock:
            for kind, records in ((EntryKind.LOGS, logs), (EntryKind.METRICS, metrics)):
                if records:
                    self._append(kind=kind, launch_id=launch_id, job_id=job_id, records=tuple(records))
            return self._trim(launch_id)

    def _trim(self, launch_id: str) -> int:
        """Drop the oldest waiting records of ``launch_id`` beyond ``max_records``."""
        excess = sum(len(e.records) for e in self._entries if e.launch_id == launch_id) - self.max_records
        if excess <= 0:
            return 0
        kept, dropped = [], 0
        for entry in self._entries:
            if dropped < excess and entry.records and entry.launch_id == launch_id and entry.seq not in self._in_flight:
                cut = min(excess - dropped, len(entry.records))
                dropped += cut
                if cut < len(entry.records):
                    kept.append(replace(entry, records=entry.records[cut:]))
                continue
            kept.append(entry)
        self._entries = kept
        return dropped

    def take_statuses(self, carrier: Carrier) -> list[Entry]:
        """The statuses a heartbeat of ``carrier`` carries now, marked in flight."""
        with self._lock:
            if carrier is Carrier.ASIDE and not self._long_poll:
                return []
            if carrier is Carrier.LONG_POLL:
                self._long_poll = True
            taken = []
            unsent_batches: set[str] = set()  # launches with a batch not delivered yet, so far
            for entry in self._entries:
                if entry.records:
                    unsent_batches.add(entry.launch_id)
                elif entry.seq in self._in_flight:
                    continue
                elif entry.status.state != "exited" or entry.launch_id not in unsent_batches:
                    taken.append(entry)
            self._in_flight.update(e.seq for e in taken)
            return taken

    def end_long_poll(self) -> None:
        with self._lock:
            self._long_poll = False

    def take_records(self) -> list[Entry]:
        """The waiting batches, oldest first, marked in flight ([] while some are in flight)."""
        with self._lock:
            if any(e.records and e.seq in self._in_flight for e in self._entries):
                return []
            taken = [e for e in self._entries if e.records]
            self._in_flight.update(e.seq for e in taken)
            return taken

    def settle(self, entries: Iterable[Entry], delivered: bool) -> None:
        """``entries`` (taken before) were delivered (gone), or were not (they wait again)."""
        seqs = {e.seq for e in entries}
        with self._lock:
            self._in_flight -= seqs
            if delivered:
                self._entries = [e for e in self._entries if e.seq not in seqs]

    def owes(self, launch_id: str) -> bool:
        """Whether anything of ``launch_id`` is still to be delivered."""
        with self._lock:
            return any(e.launch_id == launch_id for e in self._entries)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
