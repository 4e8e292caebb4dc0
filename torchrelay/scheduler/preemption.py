"""Preemption: which lower-priority jobs a blocked job may stop so that it can start.

Contract:
- ``choose_victims(...)`` considers only holdings that are preemptible, strictly lower in
  priority than the job, and not placed in this cycle. Candidates are taken in this order:
  jobs already being preempted (they cost nothing more), then the lowest priority, then the
  most recently started (the least work lost), then job id. It takes the shortest prefix of
  that order after which the job fits, then drops every victim the job's placement does not
  need. Returns ``(victims, choice)`` or None when even stopping every candidate would not do.
- ``allowed`` masks the nodes the job may use (the reserved nodes of an earlier job are off
  limits, so preemption never jumps a reservation).
Pure; the caller applies the decision.
"""
from __future__ import annotations

import numpy as np

from torchrelay.scheduler.backfill import Holding, Tiers
from torchrelay.scheduler.cluster import Cluster
from torchrelay.scheduler.placement import Choice, place_best
from torchrelay.scheduler.types import QueuedJob

_PRUNE_TRIES = 16  # bounded: each try is one placement


def _freed(free: np.ndarray, victims: list[Holding]) -> np.ndarray:
    avail = free.copy()
    for victim in victims:
        np.add.at(avail, victim.nodes, victim.use)
    return avail


def choose_victims(cluster: Cluster, tiers: Tiers, job: QueuedJob, free: np.ndarray,
                   holdings: list[Holding], allowed: np.ndarray) -> tuple[list[Holding], Choice] | None:
    """The victims to stop for ``job`` and where it will run (see module contract)."""
    candidates = sorted(
        (h for h in holdings if h.preemptible and not h.new and h.priority < job.priority),
        key=lambda h: (not h.preempting, h.priority, -h.started_at, h.job_id))
    if not candidates:
        return None

    def attempt(victims: list[Holding]) -> Choice | None:
        return place_best(cluster, tiers, job, _freed(free, victims), allowed)

    if attempt(candidates) is None:
        return None
    low, high = 1, len(candidates)  # feasibility grows with the prefix: bisect for the shortest
    while low < high:
        mid = (low + high) // 2
        if attempt(candidates[:mid]) is not None:
            high = mid
        else:
            low = mid + 1
    victims = candidates[:low]
    choice = attempt(victims)
    assert choice is not None
    used = {i for i, _ in choice.placement}
    victims = [v for v in victims if used.intersection(int(i) for i in v.nodes)]
    choice = attempt(victims) or choice
    for victim in reversed(list(victims)[-_PRUNE_TRIES:]):
        if victim.preempting:
            continue
        rest = [v for v in victims if v is not victim]
        smaller = attempt(rest)
        if smaller is not None:
            victims, choice = rest, smaller
    return victims, choice
