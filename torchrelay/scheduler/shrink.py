"""Shrinking elastic jobs: which workers running elastic jobs give back so a blocked job can start.

A running job with ``Allocation.min_workers`` (elastic) goes on when some of its workers leave
(``torchrelay.train.elastic``), so a higher-priority job that needs room takes some of its
workers rather than stopping it whole (``preemption``).

Contract:
- ``ShrinkPool(cluster, allocations)`` holds the candidates: running elastic jobs, preemptible,
  not being preempted, with more workers than their ``min_workers``. Each keeps at least
  ``min_workers`` workers in all and at least one on its node 0 (the first entry of its
  placement: that launch hosts the job's store). ``drop(job_id)`` takes one out (it is
  being preempted whole); ``take(job_id, per_node)`` books workers given back in this cycle.
- ``choose(cluster, tiers, job, free, allowed)`` considers only candidates strictly lower in
  priority than ``job``, and only nodes in ``allowed``. Level by level from the lowest priority
  up, it counts every worker a candidate may give back on a node as free (a bound: a job's
  total is capped by its spare below) and places the job at the first level where it fits,
  then on each node of that placement takes workers from candidates cheapest
  first (lowest priority, most recently started, job id), as few as cover the node's deficit,
  within each job's spare. Returns ``({job_id: {node index: workers}}, choice)``, or None when
  shrinking alone cannot make room (the caller then preempts whole). Pure: no I/O.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from torchrelay.scheduler.cluster import Alternative, Cluster
from torchrelay.scheduler.placement import Choice, feasible, place_best, use_of
from torchrelay.scheduler.types import Allocation, QueuedJob, shape_on

_EPS = 1e-6
Tiers = tuple[tuple[Alternative, ...], ...]


@dataclass(slots=True, eq=False)
class _Elastic:
    job_id: str
    priority: int
    started_at: float
    spare: int  # workers it may still give back (its workers now less its min_workers)
    head: int | None  # node index of its node 0 (keeps a worker), None when not on this cluster
    counts: dict[int, int]  # node index -> workers there now
    per_worker: dict[int, np.ndarray]  # node index -> [cpus, gpus, memory] one worker takes there

    def releasable(self, node: int) -> int:
        """Workers it may give back on ``node`` (at most its spare)."""
        return min(self.counts.get(node, 0) - (node == self.head), self.spare)


class ShrinkPool:
    def __init__(self, cluster: Cluster, allocations: tuple[Allocation, ...] | list[Allocation]) -> None:
        self._jobs: dict[str, _Elastic] = {}
        for alloc in allocations:
            if alloc.min_workers is None or not alloc.preemptible or alloc.preempting or alloc.roles:
                continue
            workers = sum(count for _, count in alloc.placement)
            if workers <= alloc.min_workers:
                continue
            counts: dict[int, int] = {}
            per_worker: dict[int, np.ndarray] = {}
            for node_id, count in alloc.placement:
                node = cluster.index.get(node_id)
                if node is None or count <= 0:
                    continue
                counts[node] = counts.get(node, 0) + count
                shape = shape_on(alloc.shape, node_id in alloc.on_cpu)
                per_worker[node] = np.array([shape.cpu, shape.gpu, shape.memory], dtype=np.float64)
            head = cluster.index.get(alloc.placement[0][0]) if alloc.placement else None
            self._jobs[alloc.job_id] = _Elastic(alloc.job_id, alloc.priority, alloc.started_at,
                                                workers - alloc.min_workers, head, counts, per_worker)
        # a job at this priority or below can shrink nothing in this cycle
        self.lowest_priority = min((j.priority for j in self._jobs.values()), default=None)

    def drop(self, job_id: str) -> None:
        self._jobs.pop(job_id, None)

    def take(self, job_id: str, per_node: dict[int, int]) -> dict[int, np.ndarray]:
        """Book ``per_node`` workers given back by ``job_id``; returns what they held there
        (node index -> [cpus, gpus, memory])."""
        job = self._jobs[job_id]
        held = {}
        for node, count in per_node.items():
            job.counts[node] -= count
            job.spare -= count
            held[node] = count * job.per_worker[node]
        return held

    def choose(self, cluster: Cluster, tiers: Tiers, job: QueuedJob, free: np.ndarray,
               allowed: np.ndarray) -> tuple[dict[str, dict[int, int]], Choice] | None:
        """The workers to take back for ``job`` and where it will run (see module contract)."""
        if self.lowest_priority is None or job.priority <= self.lowest_priority:
            return None
        candidates = sorted((j for j in self._jobs.values() if j.priority < job.priority and j.spare > 0),
                            key=lambda j: (j.priority, -j.started_at, j.job_id))
        if not candidates:
            return None
        avail, choice = free.copy(), None
        for level in sorted({cand.priority for cand in candidates}):  # the lowest priorities first
            for cand in candidates:
                if cand.priority != level:
                    continue
                for node in cand.counts:
                    count = cand.releasable(node)
                    if count > 0 and allowed[node]:
                        avail[node] += count * cand.per_worker[node]
            if feasible(cluster, tiers, job, avail, allowed):
                choice = place_best(cluster, tiers, job, avail, allowed)
                candidates = [cand for cand in candidates if cand.priority <= level]
                break
        if choice is None:
            return None
        nodes, use = use_of(choice, cluster)
        spare = {cand.job_id: cand.spare for cand in candidates}
        release: dict[str, dict[int, int]] = {}
        for node, need in sorted(zip(nodes.tolist(), use), key=lambda p: cluster.ids[p[0]]):
            deficit = np.maximum(need - free[node], 0.0)
            for cand in candidates:
                if deficit.max() <= _EPS:
                    break
                mine = release.setdefault(cand.job_id, {})
                room = min(cand.counts.get(node, 0) - (node == cand.head) - mine.get(node, 0), spare[cand.job_id])
                count = min(room, _workers_for(deficit, cand.per_worker.get(node)))
                if count <= 0:
                    continue
                mine[node] = mine.get(node, 0) + count
                spare[cand.job_id] -= count
                deficit = deficit - count * cand.per_worker[node]
            if deficit.max() > _EPS:
                return None
        return {job_id: per_node for job_id, per_node in release.items() if per_node}, choice


def _workers_for(deficit: np.ndarray, per_worker: np.ndarray | None) -> int:
    """How many workers of ``per_worker`` cover ``deficit`` in every dimension they take (what
    they do not take is left to other candidates); 0 when they take nothing that is short."""
    if per_worker is None:
        return 0
    short = np.flatnonzero((deficit > _EPS) & (per_worker > 0))
    return max((math.ceil((deficit[d] - _EPS) / per_worker[d]) for d in short), default=0)
