"""A cluster's servers as clients and agents name them, and which one to talk to now.

``RELAY_ADDRESS`` (and ``relay agent --address``) may name several servers of one cluster,
comma-separated: ``http://a:8470,http://b:8470``. One leads; the others answer 503
``NotLeader`` naming it (``torchrelay.server.leadership``). ``ServerList`` holds the current
choice: ``moved(failed, leader)`` after a call to ``failed`` got no answer (``leader`` None:
the next address, round the list) or a ``NotLeader`` (go to ``leader``). ``seen(address,
cluster_id)`` after every reply: every server of the list must serve one cluster (one
database); the first reply's ``x-relay-cluster`` is kept, and a server that answers with another
raises ``ClusterMismatch`` naming both. Pure but for a lock; thread-safe.
"""
from __future__ import annotations

import threading
from urllib.parse import urlsplit

__all__ = ["parse_addresses", "ServerList", "ClusterMismatch"]


class ClusterMismatch(ValueError):
    """Two servers of the list serve two clusters (two databases)."""


def parse_addresses(value: str) -> tuple[str, ...]:
    """The URLs in ``value`` (comma-separated), without trailing slashes. Raises ``ValueError``
    naming an entry that is not an http(s) URL with a host."""
    out = []
    for entry in (part.strip() for part in value.split(",")):
        if not entry:
            continue
        parts = urlsplit(entry)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"server address {entry!r} is not a URL; give e.g. http://10.0.0.1:8470 "
                             "(several servers of one cluster: comma-separated)")
        out.append(entry.rstrip("/"))
    if not out:
        raise ValueError(f"no server address in {value!r}; give e.g. http://10.0.0.1:8470")
    return tuple(out)


class ServerList:
    """Which of a cluster's servers to call now (see the module docstring)."""

    def __init__(self, addresses: tuple[str, ...]) -> None:
        self.addresses = addresses
        self._current = addresses[0]
        self._lock = threading.Lock()
        self._cluster: tuple[str, str] | None = None  # (cluster id, the server that first said it)

    @property
    def current(self) -> str:
        return self._current

    def moved(self, failed: str, leader: str | None = None) -> str:
        """The address to call after ``failed`` did not do (see the module docstring); unchanged
        when another thread moved on already."""
        with self._lock:
            if self._current != failed:
                return self._current
            if leader:
                self._current = leader.rstrip("/")
            elif len(self.addresses) > 1:
                index = self.addresses.index(failed) if failed in self.addresses else -1
                self._current = self.addresses[(index + 1) % len(self.addresses)]
            return self._current

    def seen(self, address: str, cluster_id: str | None) -> None:
        """``address`` answered as a server of ``cluster_id`` (None: a server that does not say).
        Raises ``ClusterMismatch`` when an earlier reply came from another cluster."""
        if not cluster_id:
            return
        with self._lock:
            if self._cluster is None:
                self._cluster = (cluster_id, address)
                return
            first_id, first = self._cluster
        if cluster_id != first_id:
            raise ClusterMismatch(
                f"{address} serves cluster {cluster_id} but {first} serves cluster {first_id}: the servers of "
                "one cluster share one database; name only that cluster's servers (RELAY_ADDRESS, --address) "
                "or give them the same --db")
