"""Change notification for long-polls: threads bump a key, coroutines wait for a bump.

``Notifier.bump(key)`` is safe from any thread (the service's scheduler thread, request
threads); ``await Notifier.wait(key, seen, timeout)`` returns the key's version as soon as it
differs from ``seen`` or when the timeout passes. Versions start at a boot-time-based number
so an agent's remembered version from a previous server process never looks current.
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

    def version(self, key: str) -> int:
        with self._lock:
            return self._versions.get(key, self._base)

    def bump(self, key: str) -> None:
        """Mark ``key`` changed and wake its waiters. Does not block; any thread."""
        with self._lock:
            self._versions[key] = self._versions.get(key, self._base) + 1
            waiters = self._waiters.pop(key, [])
        for loop, ev in waiters:
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # loop closed at shutdown
                pass

    async def wait(self, key: str, seen: int, timeout: float) -> int:
        """Wait until ``key``'s version differs from ``seen`` or ``timeout`` s pass; returns it."""
        deadline = time.monotonic() + timeout
        while True:
            ev = asyncio.Event()
            with self._lock:
                current = self._versions.get(key, self._base)
                if current != seen:
                    return current
                self._waiters.setdefault(key, []).append((asyncio.get_running_loop(), ev))
            left = deadline - time.monotonic()
            if left <= 0:
                return current
            try:
                await asyncio.wait_for(ev.wait(), left)
            except asyncio.TimeoutError:
                return self.version(key)
