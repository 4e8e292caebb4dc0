"""Growing elastic jobs: running elastic jobs below the workers they ask for take free room back.

A running job with ``Allocation.min_workers`` and ``Allocation.max_workers`` (elastic; started
or shrunk below ``max_workers``) admits new workers at a step boundary
(``torchrelay.train.elastic``), so when nodes free up the scheduler gives them back to it.

Contract:
- ``candidates(allocations, shrunk)``: the running elastic jobs that may grow (not being
  preempted, not shrunk in this cycle, without roles or CPU ranks of a mixed job, fewer
  workers than ``max_workers``), the highest priority first, then the earliest started, then
  job id. ``growable(allocations)``: whether there is one (a cycle with an empty queue
  has something to do).
- ``grow_one(cluster, alloc, free, allowed)``: the most extra workers of ``alloc``'s granted
  shape (and ``labels``) that fit ``free`` on nodes in ``allowed``, up to ``max_workers`` in all,
  and where (a ``Choice`` spread over the nodes, best fit as any gang); None when not one fits.
  Feasibility is monotone in the count, so the count is found by bisection. Pure: no I/O.
The cycle (``policy``) grows only after the queue had its turn, only into what is left free
and does not delay the reservation (as a backfilled job without a runtime limit), and never
a job while a queued job of its priority or higher waits for resources.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from torchrelay.scheduler.cluster import Cluster, alternatives
from torchrelay.scheduler.placement import Choice, feasible, largest_fitting, place_best
from torchrelay.scheduler.types import Allocation, QueuedJob


def workers_of(alloc: Allocation) -> int:
    return sum(count for _, count in alloc.placement)


def candidates(allocations: Iterable[Allocation], shrunk: set[str] | frozenset[str] = frozenset()) -> list[Allocation]:
    """The running elastic jobs that may grow, in the order they are offered room."""
    found = [a for a in allocations
             if a.min_workers is not None and a.max_workers is not None and not a.preempting and not a.roles
             and not a.on_cpu and a.job_id not in shrunk and workers_of(a) < a.max_workers]
    return sorted(found, key=lambda a: (-a.priority, a.started_at, a.job_id))


def growable(allocations: Iterable[Allocation]) -> bool:
    return bool(candidates(allocations))


def grow_one(cluster: Cluster, alloc: Allocation, free: np.ndarray,
             allowed: np.ndarray) -> tuple[int, Choice] | None:
    """How many workers ``alloc`` grows by and where (see the module contract)."""
    want = alloc.max_workers - workers_of(alloc)
    if want <= 0:
        return None
    probe = QueuedJob(alloc.job_id, alloc.user, alloc.priority, 0, 1, alloc.shape, labels=alloc.labels)
    tiers = alternatives(probe, cluster)

    def fits(count: int) -> bool:
        return feasible(cluster, tiers, dataclasses.replace(probe, workers=count), free, allowed)

    if not fits(1):
        return None
    low = largest_fitting(1, want, fits)
    choice = place_best(cluster, tiers, dataclasses.replace(probe, workers=low), free, allowed)
    return (low, choice) if choice is not None else None
