"""How many more workers each node can take, kept up to date, so a fit check scans no nodes.

Contract:
- ``FitIndex(cluster, avail, allowed)`` watches ``avail`` (N×3: the caller's own array, which it
  changes in place and then reports with ``touch(nodes)``) on the nodes in ``allowed``.
- ``caps(alt, labels)``: per node, exactly ``placement.capacity(avail, cluster.need_rows(alt), mask)`` with
  ``mask = cluster.eligible(alt, labels) & allowed``, as of the last ``touch``. The array is the
  index's own: callers copy it before changing it.
- ``fits(tiers, job)``: exactly ``placement.feasible(cluster, tiers, job, avail, allowed)``, in a
  time that does not grow with the number of nodes: a spread gang of ``w`` workers fits iff the
  capacities sum to at least ``w`` (a node with room for all ``w`` makes the sum reach ``w`` as
  well), and ``k`` nodes of ``p`` workers fit iff at least ``k`` nodes have capacity >= ``p``.
- A job with roles: ``fits`` is exactly ``placement.place_gang(...) is not None`` on the same
  view (the step-by-step routine ``place_best`` uses for it). Cheap necessary checks (the
  workers alone, then each role alone, must fit) answer most "no"s, and a sufficient one (each
  role has room wherever the processes before it go) most "yes"es, without placing anything.
- ``override``: a few nodes whose rows differ from ``avail`` (``{node: [cpus, gpus, memory]}``),
  for a view that is ``avail`` everywhere else (the backfill view ``min(free, extra)`` differs
  only on the reserved job's nodes); ``fits`` and ``caps`` accept it.
Per (need, eligible nodes) pair the figures are built on first use (one numpy pass) and brought
up to date on the next use after a ``touch``: node by node when few nodes changed, by a fresh
numpy pass when many did. Why hand-written: the scheduling cycle asks "does this gang fit?"
thousands of times against a view that changes on a few nodes between questions. Pure.
"""
from __future__ import annotations

import math

import numpy as np

from torchrelay.scheduler.cluster import Alternative, Cluster, without_roles
from torchrelay.scheduler.placement import _EPS, _UNBOUNDED, capacity, gang_fits
from torchrelay.scheduler.types import QueuedJob

_REBUILD = 48  # more touched nodes than this since a pair's last use: one numpy pass is cheaper


def node_capacity(row: list[float], need: tuple[float, float, float]) -> int:
    """``placement.capacity`` for one eligible node, in plain floats (the same IEEE operations,
    so the same result)."""
    cap = _UNBOUNDED
    for dim in range(3):
        if need[dim] > 0:
            cap = min(cap, math.floor((row[dim] + _EPS) / need[dim]))
    return cap if cap > 0 else 0


class _Pair:
    """The capacities of every node for one need on one set of eligible nodes."""

    __slots__ = ("need", "mask", "cap", "total", "at_least", "seen", "top")

    def __init__(self, need: tuple[float, float, float] | np.ndarray, mask: np.ndarray, avail: np.ndarray,
                 seen: int) -> None:
        self.need = need
        self.mask = mask
        self.cap = capacity(avail, need, mask)
        self.total = int(self.cap.sum())
        self.at_least: dict[int, int] = {}  # p -> nodes with capacity >= p, for the p asked so far
        self.seen = seen
        # at least the largest capacity; computed on first use (only jobs with roles ask)
        self.top: int | None = None

    def need_at(self, node: int) -> tuple[float, float, float]:
        """What one worker takes on ``node`` (a mixed alternative's need differs per node)."""
        need = self.need
        return need if isinstance(need, tuple) else tuple(need[node].tolist())

    def count_at_least(self, per_node: int) -> int:
        found = self.at_least.get(per_node)
        if found is None:
            found = self.at_least[per_node] = int(np.count_nonzero(self.cap >= per_node))
        return found

    def rebuild(self, avail: np.ndarray) -> None:
        self.cap = capacity(avail, self.need, self.mask)
        self.total = int(self.cap.sum())
        self.at_least = {p: int(np.count_nonzero(self.cap >= p)) for p in self.at_least}
        self.top = None

    def update(self, node: int, row: list[float]) -> None:
        if not self.mask[node]:
            return
        old, new = int(self.cap[node]), node_capacity(row, self.need_at(node))
        if old == new:
            return
        self.cap[node] = new
        self.total += new - old
        if self.top is not None and new > self.top:
            self.top = new
        for p in self.at_least:
            self.at_least[p] += (new >= p) - (old >= p)


class FitIndex:
    """Capacities per (need, eligible nodes) over one view of free resources (see module contract)."""

    def __init__(self, cluster: Cluster, avail: np.ndarray, allowed: np.ndarray) -> None:
        self.cluster = cluster
        self.avail = avail
        self.allowed = allowed
        self._pairs: dict[tuple, _Pair] = {}
        self._touched: list[int] = []

    def touch(self, nodes) -> None:
        """``avail`` changed on ``nodes`` (an iterable of node indices). Cheap: work is deferred."""
        self._touched.extend(int(i) for i in nodes)

    def pair(self, alt: Alternative, labels: tuple[tuple[str, str], ...]) -> _Pair:
        key = (alt.need, alt.gpu_key, labels)
        pair = self._pairs.get(key)
        touched = self._touched
        if pair is None:
            mask = self.cluster.eligible(alt, labels) & self.allowed
            pair = self._pairs[key] = _Pair(self.cluster.need_rows(alt), mask, self.avail, len(touched))
        elif pair.seen < len(touched):
            pending = touched[pair.seen:]
            if len(pending) > _REBUILD:
                pair.rebuild(self.avail)
            else:
                avail = self.avail
                for node in sorted(set(pending)):
                    pair.update(node, avail[node].tolist())
            pair.seen = len(touched)
        return pair

    def fits(self, tiers, job: QueuedJob, override: dict[int, list[float]] | None = None) -> bool:
        """Whether any alternative of ``tiers`` has room for all of ``job`` (see module contract)."""
        if job.roles:
            return self._fits_with_roles(tiers, job, override)
        per_node = job.workers_per_node
        for tier in tiers:
            for alt in tier:
                pair = self.pair(alt, job.labels)
                if per_node:
                    count = pair.count_at_least(per_node)
                    if override:
                        for node, row in override.items():
                            if pair.mask[node]:
                                old, new = int(pair.cap[node]), node_capacity(row, pair.need_at(node))
                                count += (new >= per_node) - (old >= per_node)
                    if count >= (job.nodes or 1):
                        return True
                else:
                    total = pair.total
                    if override:
                        for node, row in override.items():
                            if pair.mask[node]:
                                total += node_capacity(row, pair.need_at(node)) - int(pair.cap[node])
                    if total >= job.workers:
                        return True
        return False

    def _fits_with_roles(self, tiers, job: QueuedJob, override: dict[int, list[float]] | None) -> bool:
        roles = self.cluster.roles_of(job)
        # necessary, and answered without a placement: the workers alone, each role alone
        if not self.fits(tiers, without_roles(job), override):
            return False
        if not all(self.fits(role.tiers, role.probe, override) for role in roles):
            return False
        if self._roles_have_room(roles, job, override):
            return True
        view = self.avail
        if override:
            view = view.copy()
            for node, row in override.items():
                view[node] = row
        return gang_fits(self.cluster, tiers, job, view, self.allowed, self, override)

    def _roles_have_room(self, roles, job: QueuedJob, override: dict[int, list[float]] | None) -> bool:
        """Sufficient (given that the workers fit): every role fits wherever the processes placed
        before it go. Those take at most one node each, and a node taken away costs a role at
        most the largest capacity any node has for it; so a role whose capacity in all, less
        that much per earlier process, still holds its processes fits after any placement of
        them. Answers the usual case (a few servers on a large cluster) without placing."""
        taken = job.nodes if job.workers_per_node else job.workers
        for role in roles:
            count = role.probe.workers
            if not any(self._room(alt, job.labels, override, taken) >= count for tier in role.tiers for alt in tier):
                return False
            taken += count
        return True

    def _room(self, alt: Alternative, labels, override, taken: int) -> int:
        """Capacity for ``alt`` in all, less ``taken`` times the largest a node has (a lower bound
        on what is left once ``taken`` nodes are used by others)."""
        pair = self.pair(alt, labels)
        if pair.top is None:
            pair.top = int(pair.cap.max(initial=0))
        total, top = pair.total, pair.top
        for node, row in (override or {}).items():
            if pair.mask[node]:
                new = node_capacity(row, pair.need_at(node))
                total += new - int(pair.cap[node])
                top = max(top, new)
        return total - taken * top

    def caps(self, alt: Alternative, labels: tuple[tuple[str, str], ...],
             override: dict[int, list[float]] | None = None) -> np.ndarray:
        """Per-node capacity for ``alt`` (the index's array unless ``override`` changes it)."""
        pair = self.pair(alt, labels)
        if not override:
            return pair.cap
        cap = pair.cap.copy()
        for node, row in override.items():
            if pair.mask[node]:
                cap[node] = node_capacity(row, pair.need_at(node))
        return cap
