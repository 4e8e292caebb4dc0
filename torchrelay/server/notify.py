"""Change notification for long-polls: threads bump a key, coroutines wait for a bump.

``Notifier.bump(key)`` is safe from any thread (the service's scheduler thread, request
threads); ``await Notifier.wait(key, seen, timeout)`` returns the key's version as soon as it
differs from ``seen`` or when the timeout passes. Versions start at a boot-time-based number
so an agent's remembered version from a previous server process never looks current.
``Notifier.close()`` (the server is shutting down) ends every wait now and every later one at
once; a loop that waits again and again checks ``closed`` and stops, or it would spin.
"""
from __future__ import annotations

import asyncio
import threading
import time


class Notifier:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._base = int(time.time() * 1000) * 1000
        self._versions: dict[str, int] = {}
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def version(self, key: str) -> int:
        with self._lock:
            return self._versions.get(key, self._base)

    def bump(self, key: str) -> None:
        """Mark ``key`` changed and wake its waiters. Does not block; any thread."""
        with self._lock:
            self._versions[key] = self._versions.get(key, self._base) + 1
            waiters = self._waiters.pop(key, [])
        _wake(waiters)

    def close(self) -> None:
        """Wake every waiter; later waits return at once. Does not block; any thread; idempotent.

        Why: uvicorn lets in-flight requests finish before it exits (up to its graceful timeout), and
        a long-poll in flight would otherwise hold the server's exit for the rest of its wait."""
        with self._lock:
            self._closed = True
            waiters = [waiter for key_waiters in self._waiters.values() for waiter in key_waiters]
            self._waiters.clear()
        _wake(waiters)

    async def wait(self, key: str, seen: int, timeout: float) -> int:
        """Wait until ``key``'s version differs from ``seen``, ``timeout`` s pass or the notifier is
        closed; returns the version."""
        deadline = time.monotonic() + timeout
        while True:
            ev = asyncio.Event()
            with self._lock:
                current = self._versions.get(key, self._base)
                if current != seen or self._closed:
                    return current
                self._waiters.setdefault(key, []).append((asyncio.get_running_loop(), ev))
            left = deadline - time.monotonic()
            if left <= 0:
                return current
            try:
                await asyncio.wait_for(ev.wait(), left)
            except asyncio.TimeoutError:
                return self.version(key)


def _wake(waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]) -> None:
    for loop, ev in waiters:
        try:
            loop.call_soon_threadsafe(ev.set)
        except RuntimeError:  # loop closed at shutdown
            pass
