"""Which of a node's GPUs each launch may use.

The server places GPU *counts* on a node (``RELAY_GPUS_PER_WORKER`` × the launch's workers);
the agent turns a count into device indices and hands them to the launch as
``CUDA_VISIBLE_DEVICES``, so two jobs on one node never share a device and a CPU-only launch
on a GPU node sees no device at all.

Contract:
- ``GpuSlots(total)`` holds indices ``0 .. total-1``. ``take(launch_id, count)`` gives the
  lowest free indices (deterministic), is idempotent for a launch id (a reconcile that sees
  the same launch again gets the same devices) and raises ``GpuShortage`` naming what is held
  when too few are free; ``release(launch_id)`` frees them (idempotent). Thread-safe, no I/O.
- ``visible_devices(indices, node_gpus)``: the ``CUDA_VISIBLE_DEVICES`` value, or None on a
  node without GPUs (the variable is then left as the agent found it).
"""
from __future__ import annotations

import threading


class GpuShortage(RuntimeError):
    """More GPUs were asked of this node than are free (the server and the agent disagree)."""


class GpuSlots:
    def __init__(self, total: int):
        if total < 0:
            raise ValueError(f"total={total!r} gpus must be >= 0")
        self.total = total
        self._held: dict[str, tuple[int, ...]] = {}
        self._lock = threading.Lock()

    def take(self, launch_id: str, count: int) -> tuple[int, ...]:
        """The device indices of ``launch_id`` (``count`` of them). Raises ``GpuShortage``."""
        if count < 0:
            raise ValueError(f"count={count!r} must be >= 0")
        with self._lock:
            held = self._held.get(launch_id)
            if held is not None and len(held) == count:
                return held
            busy = {i for other, indices in self._held.items() if other != launch_id for i in indices}
            free = [i for i in range(self.total) if i not in busy]
            if len(free) < count:
                holders = ", ".join(f"{other}: {list(ix)}" for other, ix in sorted(self._held.items()) if ix)
                raise GpuShortage(f"launch {launch_id} needs {count} gpus but only {len(free)} of this node's "
                                  f"{self.total} are free (held: {holders or 'none'})")
            self._held[launch_id] = tuple(free[:count])
            return self._held[launch_id]

    def release(self, launch_id: str) -> None:
        with self._lock:
            self._held.pop(launch_id, None)

    def held(self) -> dict[str, tuple[int, ...]]:
        with self._lock:
            return dict(self._held)


def visible_devices(indices: tuple[int, ...], node_gpus: int) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` for a launch given ``indices`` on a node with ``node_gpus``."""
    if node_gpus <= 0:
        return None
    return ",".join(str(i) for i in indices)
