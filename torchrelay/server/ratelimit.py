"""Bad-credential rate limit per client address (pure: the clock is an argument; no I/O).

``FailureLimiter(limit, window_s)``: ``failed(addr, now)`` counts one bad credential from
``addr``; ``blocked(addr, now)`` is True while ``addr`` has ``limit`` or more failures within the
last ``window_s`` seconds (a sliding window: the oldest failure leaves it ``window_s`` after it
came). ``retry_after(addr, now)`` is how many seconds until it is not blocked. Memory is bounded:
at most ``max_addresses`` addresses are tracked, the least recently failed forgotten first.
Not thread-safe by itself; ``guard`` calls it from the event loop only.
"""
from __future__ import annotations

from collections import OrderedDict, deque


class FailureLimiter:
    def __init__(self, limit: int = 30, window_s: float = 60.0, max_addresses: int = 10000):
        if limit < 1 or window_s <= 0:
            raise ValueError(f"limit {limit!r} must be >= 1 and window_s {window_s!r} above 0")
        self.limit, self.window_s, self.max_addresses = limit, window_s, max_addresses
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def _recent(self, addr: str, now: float) -> deque[float]:
        times = self._failures.get(addr)
        if times is None:
            return deque()
        while times and times[0] <= now - self.window_s:
            times.popleft()
        if not times:
            del self._failures[addr]
        return times

    def failed(self, addr: str, now: float) -> None:
        times = self._recent(addr, now)
        times.append(now)
        while len(times) > self.limit:  # what blocks is the newest `limit` failures
            times.popleft()
        self._failures[addr] = times
        self._failures.move_to_end(addr)
        while len(self._failures) > self.max_addresses:
            self._failures.popitem(last=False)

    def blocked(self, addr: str, now: float) -> bool:
        return len(self._recent(addr, now)) >= self.limit

    def retry_after(self, addr: str, now: float) -> float:
        times = self._recent(addr, now)
        if len(times) < self.limit:
            return 0.0
        return max(0.0, times[-self.limit] + self.window_s - now)
