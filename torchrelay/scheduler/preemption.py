"""Preemption: which lower-priority jobs a blocked job may stop so that it can start.

Contract:
- ``VictimPool(holdings, n_nodes)`` holds the jobs that may be preempted in this cycle: running,
  preemptible, not placed in this cycle. ``remove`` takes one out once it is chosen.
- ``choose(cluster, tiers, job, free, allowed)`` considers only pool jobs strictly lower in
  priority than ``job``, and only nodes in ``allowed`` (the caller masks out the nodes an
  earlier job has reserved, so preemption never jumps a reservation). It counts, level by
  level from the lowest priority up, the resources of candidate victims as free (jobs already
  being preempted count at every level: they cost nothing more) and takes the first level at
  which the job fits; on the nodes of that placement it picks victims cheapest first (already
  being preempted, lowest priority, most recently started: the least work lost, then job id)
  until each node has room for its share (all of the job's roles on that node together), then
  drops any victim the others make unnecessary.
  Returns ``(victims, choice)`` or None when stopping every candidate would not do. Pure.
"""
from __future__ import annotations

import numpy as np

from torchrelay.scheduler.backfill import Holding, Tiers
from torchrelay.scheduler.cluster import Cluster
from torchrelay.scheduler.placement import Choice, feasible, place_best, use_of
from torchrelay.scheduler.types import QueuedJob

_EPS = 1e-6


def _cost(holding: Holding) -> tuple:
    return (not holding.preempting, holding.priority, -holding.started_at, holding.job_id)


class VictimPool:
    def __init__(self, holdings: list[Holding], n_nodes: int) -> None:
        pool = sorted((h for h in holdings if h.preemptible and not h.new), key=_cost)
        self._pool = pool
        self._preempting: dict[int, np.ndarray] = {}  # priority -> per-node resources
        self._by_level: dict[int, np.ndarray] = {}
        self._removed: set[str] = set()
        # thousands of running jobs: their rows in one array each (pool order) rather than a
        # Python loop per job and node
        nodes = np.concatenate([h.nodes for h in pool]) if pool else np.zeros(0, dtype=np.int64)
        use = np.concatenate([h.use for h in pool]) if pool else np.zeros((0, 3))
        owner = np.repeat(np.arange(len(pool)), [len(h.nodes) for h in pool])
        keys = [(h.preempting, h.priority) for h in pool]
        groups: dict[tuple[bool, int], int] = {}
        row_group = np.array([groups.setdefault(k, len(groups)) for k in keys], dtype=np.int64)[owner]
        for (preempting, priority), group in groups.items():
            rows = row_group == group  # the group's rows, still in pool order (same sums)
            table = self._preempting if preempting else self._by_level
            table[priority] = np.stack([np.bincount(nodes[rows], weights=use[rows, d], minlength=n_nodes)
                                        for d in range(3)], axis=1)
        # per node, the pool jobs on it in cost order: rows sorted by node, stable
        by_node = np.argsort(nodes, kind="stable")
        self._row_nodes = nodes[by_node]
        self._row_owner = owner[by_node]
        # a job at this priority or below can never preempt anything in this cycle
        self.lowest_priority = min((h.priority for h in pool), default=None)

    def _on_node(self, node: int) -> list[Holding]:
        """The pool jobs on ``node``, cheapest to stop first."""
        low, high = np.searchsorted(self._row_nodes, (node, node + 1))
        pool = self._pool
        return [pool[i] for i in self._row_owner[low:high].tolist()]

    def remove(self, holding: Holding) -> None:
        self._removed.add(holding.job_id)
        table = self._preempting if holding.preempting else self._by_level
        np.subtract.at(table[holding.priority], holding.nodes, holding.use)

    def choose(self, cluster: Cluster, tiers: Tiers, job: QueuedJob, free: np.ndarray,
               allowed: np.ndarray) -> tuple[list[Holding], Choice] | None:
        """The victims to stop for ``job`` and where it will run (see module contract)."""
        levels = sorted(p for p in self._by_level if p < job.priority)
        avail = free.copy()
        for priority, resources in self._preempting.items():
            if priority < job.priority:
                avail += resources
        choice, top = None, None
        for level in [None, *levels]:
            if level is not None:
                avail = avail + self._by_level[level]
            if feasible(cluster, tiers, job, avail, allowed):  # cheaper than placing at every level
                choice = place_best(cluster, tiers, job, avail, allowed)
                top = level
                break
        if choice is None:
            return None
        nodes, use = use_of(choice, cluster)
        deficit = {int(n): np.maximum(u - free[n], 0.0) for n, u in zip(nodes, use)}
        victims: list[Holding] = []
        taken: set[str] = set()
        for node in sorted(deficit, key=lambda n: cluster.ids[n]):
            for holding in self._on_node(node):
                if deficit[node].max() <= _EPS:
                    break
                if holding.job_id in self._removed or holding.job_id in taken:
                    continue
                if holding.priority >= job.priority or (
                        not holding.preempting and (top is None or holding.priority > top)):
                    continue
                victims.append(holding)
                taken.add(holding.job_id)
                for n, u in zip(holding.nodes, holding.use):
                    if int(n) in deficit:
                        deficit[int(n)] = deficit[int(n)] - u
        if any(d.max() > _EPS for d in deficit.values()):  # cannot happen: the level said it fits
            return None
        for victim in reversed(list(victims)):  # drop a victim the others make unnecessary
            back = {int(n): u for n, u in zip(victim.nodes, victim.use) if int(n) in deficit}
            if all((deficit[n] + u).max() <= _EPS for n, u in back.items()):
                for n, u in back.items():
                    deficit[n] = deficit[n] + u
                victims.remove(victim)
        return victims, choice
