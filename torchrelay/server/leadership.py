"""Which of several servers on one PostgreSQL leads: a session advisory lock, held on a
connection of its own.

Contract:
- ``Leadership(service, url)``: ``url`` is where clients and agents reach this server.
  ``start()`` does not block. On SQLite (one server per store) the server leads at once. On
  PostgreSQL a thread tries ``pg_try_advisory_lock`` every ``poll_s`` on a connection it keeps;
  the server that gets it writes itself in the ``cluster`` row and starts the service's control
  loop (``service.start()``: every READY node gets a fresh heartbeat timeout, so agents that
  were looking for a leader are not called lost). The lock lives as long as that connection:
  a leader killed with -9 loses it as soon as PostgreSQL sees the socket close, and a follower
  takes over at its next poll.
- A leader whose lock connection breaks (PostgreSQL restarted, a network blip) tries to take
  the lock again for ``regain_s``, leading on meanwhile (its other writes fail while the
  database is away). If another server took it, this one ends its process (``on_deposed``,
  by default ``os._exit(3)``): a service manager starts it again as a follower, and nothing of
  the deposed leader writes on.
- ``is_leader``; ``leader_url``: the leader as the ``cluster`` row names it (followers re-read
  it every poll); ``cluster_id``: the store's identity. ``guard(app)`` makes a follower answer
  every API call but ``/health`` with 503 ``NotLeader`` naming the leader, and every reply
  carries ``x-relay-role`` (leader or follower), ``x-relay-leader`` and ``x-relay-cluster``
  (clients and agents refuse servers of two clusters: ``torchrelay.servers``).
- ``stop()``: ends the thread, stops the service, releases the lock (closes its connection).
  Idempotent.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from sqlalchemy import select, text

from torchrelay.server.store import ClusterRow
from torchrelay.wire import API_PREFIX

__all__ = ["Leadership"]

_log = logging.getLogger("torchrelay.server.leadership")
LOCK_KEY = 0x72656C61795F6C64  # "relay_ld": the lock every server of one cluster contends for
_OPEN_PATHS = (f"{API_PREFIX}/health", f"{API_PREFIX}/openapi.json", f"{API_PREFIX}/docs")


def _exit_deposed() -> None:
    os._exit(3)


class Leadership:
    """See the module docstring."""

    def __init__(self, service: Any, url: str, *, poll_s: float = 0.5, regain_s: float = 30.0,
                 restart_grace_s: float = 5.0, on_deposed: Callable[[], None] = _exit_deposed) -> None:
        self.service, self.url = service, url
        self.engine = service.engine
        self.poll_s, self.regain_s, self.on_deposed = poll_s, regain_s, on_deposed
        self.restart_grace_s = restart_grace_s
        self.shared = self.engine.dialect.name == "postgresql"  # several servers can share the store
        self.is_leader = False
        self.leader_url: str | None = None
        with self.engine.connect() as conn:
            self.cluster_id: str = conn.execute(select(ClusterRow.cluster_id).where(ClusterRow.id == 1)).scalar()
        self._lock_conn: Any = None
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ life

    def start(self) -> None:
        """Lead at once on SQLite; on PostgreSQL try the lock before returning (the app serves
        no request before this returns: a lone server leads from its first reply), for up to
        ``restart_grace_s`` when the ``cluster`` row names this very URL (this server restarted:
        its predecessor's connection and lock go as soon as PostgreSQL sees it closed), then
        poll in a thread."""
        if not self.shared:
            self._lead()
            return
        deadline = time.monotonic() + self.restart_grace_s
        try:
            while not self._try_lock():
                if self._read_leader() != self.url or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            else:
                self._lead()
        except Exception:  # noqa: BLE001 - the database is away: the thread tries again
            _log.warning("first leadership attempt failed", exc_info=True)
        self._thread = threading.Thread(target=self._run, name="relay-leadership", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll_s + 10)
        self.service.stop()  # a follower's too: its engine and writer thread
        self._close_lock()

    # ------------------------------------------------------------ the election

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                if self.is_leader:
                    self._keep()
                elif self._try_lock():
                    self._lead()
                else:
                    self.leader_url = self._read_leader()
            except Exception:  # noqa: BLE001 - the database may be away: try again at the next poll
                _log.warning("leadership poll failed", exc_info=True)
            self._stopped.wait(self.poll_s)

    def _try_lock(self) -> bool:
        self._close_lock()
        conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        try:
            got = bool(conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": LOCK_KEY}).scalar())
        except Exception:
            conn.close()
            raise
        if got:
            self._lock_conn = conn
        else:
            conn.close()
        return got

    def _lead(self) -> None:
        with self.service.db.write() as rows:
            row = rows.s.get(ClusterRow, 1)
            row.leader_url, row.leader_since = self.url, time.time()
        self.is_leader, self.leader_url = True, self.url
        _log.warning("leading the cluster at %s", self.url)
        self.service.start()

    def _keep(self) -> None:
        """Check the lock's connection; when it broke, take the lock again, or step down."""
        try:
            self._lock_conn.execute(text("SELECT 1"))
            return
        except Exception:  # noqa: BLE001 - the connection (and with it the lock) is gone
            _log.warning("lost the leadership lock's connection; taking the lock again")
        deadline = time.monotonic() + self.regain_s
        while not self._stopped.is_set() and time.monotonic() < deadline:
            try:
                if self._try_lock():
                    return
                holder = self._read_leader()
                _log.error("another server (%s) leads now: this one stops", holder)
                self.is_leader = False
                self.on_deposed()
                return
            except Exception:  # noqa: BLE001 - the database is still away
                self._stopped.wait(self.poll_s)
        if not self._stopped.is_set():
            _log.error("could not take the leadership lock again within %g s: this server stops", self.regain_s)
            self.is_leader = False
            self.on_deposed()

    def _read_leader(self) -> str | None:
        with self.engine.connect() as conn:
            return conn.execute(select(ClusterRow.leader_url).where(ClusterRow.id == 1)).scalar()

    def _close_lock(self) -> None:
        if self._lock_conn is not None:
            try:
                self._lock_conn.close()
            except Exception:  # noqa: BLE001 - already broken
                pass
            self._lock_conn = None

    # ------------------------------------------------------------ what a follower answers

    def guard(self, app: FastAPI) -> None:
        """Install the follower's answer on ``app`` (see the module docstring)."""
        app.add_middleware(_FollowerGuard, leadership=self)

    def reply_headers(self) -> list[tuple[bytes, bytes]]:
        out = [(b"x-relay-role", b"leader" if self.is_leader else b"follower"),
               (b"x-relay-cluster", self.cluster_id.encode())]
        if self.leader_url:
            out.append((b"x-relay-leader", self.leader_url.encode()))
        return out


class _FollowerGuard:
    """Pure ASGI middleware (no per-request task or body buffering, unlike ``BaseHTTPMiddleware``:
    long polls pass through untouched): a follower's 503, and the role headers on every reply."""

    def __init__(self, app: Any, leadership: Leadership) -> None:
        self.app, self.leadership = app, leadership

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        lead = self.leadership
        headers = lead.reply_headers()
        path = scope["path"]
        if not lead.is_leader and path.startswith(API_PREFIX) and not path.startswith(_OPEN_PATHS):
            leader = lead.leader_url if lead.leader_url != lead.url else None
            detail = (f"this server ({lead.url}) follows; the leader is {leader}" if leader
                      else f"this server ({lead.url}) follows and no leader is known yet; try again shortly")
            response = JSONResponse({"error": "NotLeader", "detail": detail, "leader": leader}, status_code=503)
            response.raw_headers.extend(headers)
            await response(scope, receive, send)
            return

        async def send_with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), *headers]
            await send(message)

        await self.app(scope, receive, send_with_headers)
