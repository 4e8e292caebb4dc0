"""EASY backfill: one reservation for the first job that cannot start, and start estimates.

Contract:
- A ``Holding`` is a job holding resources: a running allocation, or a job placed or granted
  in this cycle. ``end`` is when it frees them: start + declared max runtime, or ``inf`` when
  no max runtime was declared (the server is expected to stop a job at its max runtime).
- ``reserve(...)`` gives the first blocked job a ``Reservation``: the earliest time ``start``
  at which it fits once holdings end (None when that depends on a job without a max runtime),
  the nodes it would use then, and ``extra``: per node, what is free at ``start`` beyond what
  the reserved job needs (``inf`` on nodes it will not use). A later job may start now if
  either it declares a max runtime that ends by ``start`` (it is gone before the reserved job
  needs the room), or it fits within ``min(free, extra)`` (it takes nothing the reserved job
  needs). With ``start`` None only the second rule applies: the reserved nodes drain until the
  job fits, so it cannot be passed over forever. Returns None when the job cannot fit even with
  every holding ended (it needs nodes that are not ready).
- ``estimate_starts(...)`` plays the waiting jobs forward in queue order, each starting at the
  earliest time it fits after the one before it, every job running to its declared max
  runtime; it stops at the first job whose start depends on a job without a max runtime.
Pure: no clock reads (``now`` comes from the input), no I/O.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from torchrelay.scheduler.cluster import Alternative, Cluster
from torchrelay.scheduler.fitindex import FitIndex
from torchrelay.scheduler.placement import Choice, feasible, place_best, use_of
from torchrelay.scheduler.types import QueuedJob

Tiers = tuple[tuple[Alternative, ...], ...]


@dataclass(slots=True, eq=False)
class Holding:
    job_id: str
    user: str
    priority: int
    preemptible: bool
    preempting: bool
    started_at: float
    end: float  # math.inf when unknown
    nodes: np.ndarray  # node indices (int)
    use: np.ndarray  # per node in ``nodes``: [cpus, gpus, memory]
    total: tuple[float, float, float]  # cpus, gpus, memory over all its nodes (on this cluster or not)
    new: bool = False  # placed or granted in this cycle (never a preemption victim)


@dataclass(slots=True)
class Reservation:
    job_id: str
    start: float | None
    choice: Choice
    extra: np.ndarray  # N×3

    def allows_short(self, now: float, max_runtime_s: float | None) -> bool:
        """Whether a job with this max runtime is gone by the reserved start."""
        return self.start is not None and max_runtime_s is not None and now + max_runtime_s <= self.start


def _released(free: np.ndarray, holdings: list[Holding]) -> np.ndarray:
    """``free`` plus everything ``holdings`` hold."""
    if not holdings:
        return free.copy()
    nodes = np.concatenate([h.nodes for h in holdings])
    use = np.concatenate([h.use for h in holdings])
    return free + np.stack([np.bincount(nodes, weights=use[:, d], minlength=len(free)) for d in range(3)], axis=1)


def reserve(cluster: Cluster, tiers: Tiers, job: QueuedJob, free: np.ndarray, holdings: list[Holding],
            now: float, ready: np.ndarray) -> Reservation | None:
    """The reservation of the first blocked job (see module contract)."""
    ending = sorted((h for h in holdings if h.end < math.inf), key=lambda h: (h.end, h.job_id))
    times = sorted({max(h.end, now) for h in ending})
    # cut[g] = how many holdings have ended once the g-th distinct end time has passed
    cuts, position = [], 0
    for t in times:
        while position < len(ending) and max(ending[position].end, now) <= t:
            position += 1
        cuts.append(position)
    if ending:
        order_nodes = np.concatenate([h.nodes for h in ending])
        order_use = np.concatenate([h.use for h in ending])
        rows = np.cumsum([0] + [len(h.nodes) for h in ending])

    def attempt(group: int) -> tuple[np.ndarray, bool]:
        stop = rows[cuts[group]]
        avail = free + np.stack([np.bincount(order_nodes[:stop], weights=order_use[:stop, d], minlength=len(free))
                                 for d in range(3)], axis=1)
        return avail, feasible(cluster, tiers, job, avail, ready)

    found: tuple[float, np.ndarray, Choice] | None = None
    if times:
        avail, fits = attempt(len(times) - 1)
        if fits:  # feasibility only grows with time: bisect for the earliest group
            low, high = 0, len(times) - 1
            best = avail
            while low < high:
                mid = (low + high) // 2
                avail_mid, fits_mid = attempt(mid)
                if fits_mid:
                    high, best = mid, avail_mid
                else:
                    low = mid + 1
            found = (times[low], best, place_best(cluster, tiers, job, best, ready))
    if found is None:
        avail = _released(free, holdings)
        choice = place_best(cluster, tiers, job, avail, ready)
        if choice is None:
            return None
        start, avail_at_start = None, avail
    else:
        start, avail_at_start, choice = found
    nodes, use = use_of(choice, cluster)
    extra = np.full_like(free, np.inf)
    extra[nodes] = avail_at_start[nodes]
    np.subtract.at(extra, nodes, use)
    return Reservation(job.job_id, start, choice, extra)


def estimate_starts(cluster: Cluster, waiting: list[tuple[QueuedJob, Tiers]], free: np.ndarray,
                    holdings: list[Holding], now: float, ready: np.ndarray) -> dict[str, float]:
    """Estimated start of each waiting job, in order, until one cannot be estimated."""
    # (end, job id, nodes, use, released in all: python floats for the cheap test below)
    # ``total`` may count nodes off this cluster: fine for the bound it is used for
    events = [(h.end, h.job_id, h.nodes, h.use, h.total) for h in holdings if h.end < math.inf]
    heapq.heapify(events)
    avail = free.copy()
    index = FitIndex(cluster, avail, ready)  # exact fit checks; a placement is chosen only once one fits
    clock = now
    out: dict[str, float] = {}
    bounds: dict[tuple, list[float]] = {}
    for job, tiers in waiting:
        smallest = bounds.get((tiers, job.workers))
        if smallest is None:  # the least any alternative takes in all (less a float tolerance)
            smallest = bounds[(tiers, job.workers)] = [
                min(alt.least_need[d] * job.workers for tier in tiers for alt in tier) - 1e-6 for d in range(3)]
        everywhere = avail.sum(axis=0).tolist()  # free on all nodes: bounds free on the eligible ones
        pending: list[tuple[np.ndarray, np.ndarray]] = []
        while True:
            if everywhere[0] >= smallest[0] and everywhere[1] >= smallest[1] and everywhere[2] >= smallest[2]:
                if pending:  # apply the released resources in one go
                    nodes = np.concatenate([n for n, _ in pending])
                    use = np.concatenate([u for _, u in pending])
                    avail += np.stack([np.bincount(nodes, weights=use[:, d], minlength=len(avail))
                                       for d in range(3)], axis=1)
                    index.touch(np.unique(nodes).tolist())
                    pending.clear()
                if index.fits(tiers, job):
                    choice = place_best(cluster, tiers, job, avail, ready, index)
                    break
            if not events:
                return out
            clock = max(clock, events[0][0])
            while events and events[0][0] <= clock:
                _, _, nodes, use, released = heapq.heappop(events)
                pending.append((nodes, use))
                everywhere = [a + b for a, b in zip(everywhere, released)]
        out[job.job_id] = clock
        nodes, use = use_of(choice, cluster)
        np.subtract.at(avail, nodes, use)
        index.touch(nodes.tolist())
        if job.max_runtime_s is not None:
            heapq.heappush(events, (clock + job.max_runtime_s, job.job_id, nodes, use, use.sum(axis=0).tolist()))
    return out
