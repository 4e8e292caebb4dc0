"""A listener on the agent's advertised address that lets the server check peers can reach it.

An agent can hold its address and still be out of its peers' reach (a firewall, a NAT, an
address on an interface other hosts have no route to); a job placed there would fail later
with a gloo time-out. ``ReachProbe(host)`` listens on ``host`` at a port the OS picks and
answers every connection with ``wire.reach_greeting(token)`` and closes it; the agent registers ``port``
and ``token``, and the server connects before it calls the node ready
(``torchrelay.server.reachability``). The token makes sure the server reached this agent, not
some other listener on that address and port (its own loopback, say).

Contract: ``ReachProbe(host)`` binds at once (raises ``OSError`` when ``host`` is not an
address of this host); a daemon thread answers until ``close()`` (idempotent).
"""
from __future__ import annotations

import secrets
import socket
import threading

from torchrelay.wire import reach_greeting

__all__ = ["ReachProbe"]


class ReachProbe:
    """See the module docstring."""

    def __init__(self, host: str) -> None:
        self.token = secrets.token_hex(8)
        self._sock = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.port: int = self._sock.getsockname()[1]
        self._closed = threading.Event()
        threading.Thread(target=self._serve, name="relay-agent-reach", daemon=True).start()

    def _serve(self) -> None:
        answer = reach_greeting(self.token)
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    conn.sendall(answer)
                except OSError:
                    pass

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
