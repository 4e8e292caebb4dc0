"""Where a gang goes. Pure numpy over one cycle's arrays; no I/O.

Contract:
- ``capacity(avail, need, mask)``: how many more workers of per-worker ``need`` each node can
  take (0 off ``mask``); ``need`` is one row for every node, or N×3 (one per node: a mixed
  alternative, ``Cluster.need_rows``), and so is every ``need`` below.
- ``place(cluster, alt, job, avail, mask)``: all of the job's workers, or None. Never exceeds
  ``avail`` on any node. With ``workers_per_node`` it picks exactly ``nodes`` nodes; otherwise
  it spreads ``workers`` freely. Among placements it prefers, in this order:
    1. the fewest nodes;
    2. for CPU-only workers, nodes without GPUs (a CPU job should not strand a GPU);
    3. the least fragmentation: the smallest sum, over the chosen nodes, of the fraction of
       each resource left free (best fit);
    4. the lowest node id (determinism).
- ``feasible(...)``: whether ``place_best`` would find a placement, without choosing one.
- ``place_best(cluster, tiers, job, avail, mask)``: the first tier of alternatives that has a
  placement; within a tier (one alternative per GPU type) the fewest nodes, then the least
  fragmentation, then the tier's own order. Returns ``Choice`` or None.
- A job with roles (``QueuedJob.roles``): its workers are placed as above, then each role in
  turn, with the same rules, on what the workers and the roles before it leave; when a role
  does not fit, the workers' next alternative in that order is tried (same tier first), and the
  gang fits only if every role does (``Choice.roles``). ``feasible`` runs the same routine, so
  "does it fit" and "where" always agree. ``use_of`` counts all roles, one row per node.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from torchrelay.scheduler.cluster import GPU, Alternative, Cluster, RoleRequest, without_roles
from torchrelay.scheduler.types import QueuedJob

_UNBOUNDED = 1 << 40  # capacity of a node for a worker that needs nothing
_EPS = 1e-6  # cpus are floats: 0.1 * 3 must still fit 0.3
_GPU_NODE_PENALTY = 4.0  # larger than any fragmentation score (3 dims, each at most 1)


@dataclass(frozen=True, slots=True)
class Choice:
    alt: Alternative
    placement: tuple[tuple[int, int], ...]  # (node index, workers)
    score: float
    # per role of the job, in order: (name, granted alternative, ((node index, processes), ...))
    roles: tuple[tuple[str, Alternative, tuple[tuple[int, int], ...]], ...] = ()


def capacity(avail: np.ndarray, need, mask: np.ndarray) -> np.ndarray:
    """Workers of ``need`` each node can still take; 0 where ``mask`` is False."""
    cap = np.full(avail.shape[0], _UNBOUNDED, dtype=np.int64)
    if isinstance(need, np.ndarray):  # per node
        for dim in range(3):
            takes = need[:, dim] > 0
            fit = np.floor((avail[takes, dim] + _EPS) / need[takes, dim]).astype(np.int64)
            cap[takes] = np.minimum(cap[takes], fit)
        cap[~mask] = 0
        np.maximum(cap, 0, out=cap)
        return cap
    for dim in range(3):
        if need[dim] > 0:
            np.minimum(cap, np.floor((avail[:, dim] + _EPS) / need[dim]).astype(np.int64), out=cap)
    cap[~mask] = 0
    np.maximum(cap, 0, out=cap)
    return cap


def _scores(cluster: Cluster, avail: np.ndarray, need: np.ndarray, nodes: np.ndarray,
            workers: np.ndarray | int) -> np.ndarray:
    """Fragmentation score of putting ``workers`` on each of ``nodes`` (lower is better)."""
    if need.ndim == 2:  # per node (mixed devices): never a GPU-node penalty, its GPU ranks use them
        taken = need[nodes] * (workers[:, None] if isinstance(workers, np.ndarray) else workers)
        left = np.maximum(avail[nodes] - taken, 0.0) * cluster.inv_total[nodes]
        return left.sum(axis=1)
    # in place on one temporary: this runs once or twice per placement over many nodes
    left = avail[nodes] - (np.multiply.outer(workers, need) if isinstance(workers, np.ndarray) else workers * need)
    np.maximum(left, 0.0, out=left)
    left *= cluster.inv_total[nodes]
    score = left.sum(axis=1)
    if need[GPU] == 0:
        score += _GPU_NODE_PENALTY * cluster.has_gpu[nodes]
    return score


def _best(nodes: np.ndarray, scores: np.ndarray) -> int:
    return int(nodes[np.lexsort((nodes, scores))[0]])


def place(cluster: Cluster, alt: Alternative, job: QueuedJob, avail: np.ndarray,
          mask: np.ndarray | None, cap: np.ndarray | None = None) -> tuple[tuple[tuple[int, int], ...], float] | None:
    """(placement, score) for all of ``job``'s workers as ``alt``, or None (see module contract).
    ``cap``, when given, is ``capacity(avail, cluster.need_rows(alt), mask)`` already known (it is not changed)."""
    need = np.asarray(cluster.need_rows(alt), dtype=np.float64)
    cap = capacity(avail, cluster.need_rows(alt), mask) if cap is None else cap.copy()
    if job.workers_per_node:
        per_node, count = job.workers_per_node, job.nodes or 1
        cand = np.flatnonzero(cap >= per_node)
        if cand.size < count:
            return None
        scores = _scores(cluster, avail, need, cand, per_node)
        order = np.lexsort((cand, scores))[:count]
        picked = sorted(int(i) for i in cand[order])
        return tuple((i, per_node) for i in picked), float(scores[order].sum())
    workers = job.workers
    np.minimum(cap, workers, out=cap)
    cand = np.flatnonzero(cap > 0)
    if cand.size == 0 or int(cap[cand].sum()) < workers:
        return None
    whole = cand[cap[cand] >= workers]
    if whole.size:
        scores = _scores(cluster, avail, need, whole, workers)
        best = int(np.argmin(scores))  # the first minimum: ``whole`` is in node order, so the lowest node
        return ((int(whole[best]), workers),), float(scores[best])
    # Fewest nodes: the largest capacities first; the last node is the best fit for what is left.
    full_scores = _scores(cluster, avail, need, cand, cap[cand])
    order = cand[np.lexsort((cand, full_scores, -cap[cand]))]
    cumulative = np.cumsum(cap[order])
    count = int(np.searchsorted(cumulative, workers)) + 1
    head = order[: count - 1]
    remainder = workers - int(cumulative[count - 2])
    rest = order[count - 1:]
    rest = rest[cap[rest] >= remainder]
    last_scores = _scores(cluster, avail, need, rest, remainder)
    last = _best(rest, last_scores)
    placement = tuple((int(i), int(cap[i])) for i in head) + ((last, remainder),)
    head_score = float(_scores(cluster, avail, need, head, cap[head]).sum())
    return placement, head_score + float(last_scores.min())


def place_best(cluster: Cluster, tiers: tuple[tuple[Alternative, ...], ...], job: QueuedJob,
               avail: np.ndarray, ready: np.ndarray, index=None, override=None) -> Choice | None:
    """The preferred placement over ``tiers`` on nodes in ``ready`` (see module contract).
    ``index`` (a ``fitindex.FitIndex`` over ``avail`` and ``ready``, with ``override`` rows where
    ``avail`` departs from it) skips the alternatives that cannot fit and the capacity pass."""
    if job.roles:
        return place_gang(cluster, tiers, job, avail, ready, index, override)
    for tier in tiers:
        best: tuple | None = None
        for rank, alt in enumerate(tier):
            if index is not None:
                if not index.fits(((alt,),), job, override):
                    continue
                found = place(cluster, alt, job, avail, None, index.caps(alt, job.labels, override))
            else:
                found = place(cluster, alt, job, avail, cluster.eligible(alt, job.labels) & ready)
            if found is None:
                continue
            placement, score = found
            key = (len(placement), score, rank)
            if best is None or key < best[0]:
                best = (key, Choice(alt, placement, score))
        if best is not None:
            return best[1]
    return None


def feasible(cluster: Cluster, tiers: tuple[tuple[Alternative, ...], ...], job: QueuedJob,
             avail: np.ndarray, ready: np.ndarray) -> bool:
    """Whether ``place_best`` would find a placement (cheaper: no scoring, unless the job has roles)."""
    if job.roles:
        return gang_fits(cluster, tiers, job, avail, ready)
    for tier in tiers:
        for alt in tier:
            cap = capacity(avail, cluster.need_rows(alt), cluster.eligible(alt, job.labels) & ready)
            if job.workers_per_node:
                if int(np.count_nonzero(cap >= job.workers_per_node)) >= (job.nodes or 1):
                    return True
            elif int(np.minimum(cap, job.workers).sum()) >= job.workers:
                return True
    return False


def place_gang(cluster: Cluster, tiers: tuple[tuple[Alternative, ...], ...], job: QueuedJob,
               avail: np.ndarray, ready: np.ndarray, index=None, override=None) -> Choice | None:
    """The placement of ``job``'s workers and all its roles, or None (see module contract).
    Step by step: what the workers and each role leave decides where the next role goes.
    ``index``/``override`` as for ``place_best`` (``avail`` is then the view they describe)."""
    return _gang(cluster, tiers, job, avail, ready, index, override, decide=False)


def gang_fits(cluster: Cluster, tiers: tuple[tuple[Alternative, ...], ...], job: QueuedJob,
              avail: np.ndarray, ready: np.ndarray, index=None, override=None) -> bool:
    """Exactly ``place_gang(...) is not None``, cheaper: the last role is only counted, not placed."""
    return _gang(cluster, tiers, job, avail, ready, index, override, decide=True) is not None


def _gang(cluster, tiers, job, avail, ready, index, override, decide):
    roles = cluster.roles_of(job)
    bare = without_roles(job)
    for tier in tiers:
        options = []
        for rank, alt in enumerate(tier):
            if index is not None:
                if not index.fits(((alt,),), bare, override):
                    continue
                found = place(cluster, alt, job, avail, None, index.caps(alt, job.labels, override))
            else:
                found = place(cluster, alt, job, avail, cluster.eligible(alt, job.labels) & ready)
            if found is not None:
                placement, score = found
                options.append(((len(placement), score, rank), alt, placement, score))
        options.sort(key=lambda option: option[0])
        for _, alt, placement, score in options:
            placed = _place_roles(cluster, roles, avail, ready, alt, placement, index, override, decide)
            if placed is not None:
                return Choice(alt, placement, score, placed)
    return None


def _place_roles(cluster: Cluster, roles: tuple[RoleRequest, ...], avail: np.ndarray, ready: np.ndarray,
                 alt: Alternative, placement: tuple[tuple[int, int], ...], index, override,
                 decide: bool) -> tuple | None:
    """Each role in turn on what ``placement`` (and the roles before it) leave; None if one
    fails. With ``decide`` the last role is only checked (its entry is left out)."""
    left = avail.copy()
    # with an index: the rows where what is left departs from the index's own view
    rows = dict(override) if (index is not None and override) else {}
    _take(cluster, left, alt, placement, rows if index is not None else None)
    placed = []
    last = len(roles) - 1
    for position, role in enumerate(roles):
        if decide and position == last:
            if index is not None:
                fits = index.fits(role.tiers, role.probe, rows or None)
            else:
                fits = feasible(cluster, role.tiers, role.probe, left, ready)
            return tuple(placed) if fits else None
        if index is not None:
            choice = place_best(cluster, role.tiers, role.probe, left, ready, index, rows or None)
        else:
            choice = place_best(cluster, role.tiers, role.probe, left, ready)
        if choice is None:
            return None
        _take(cluster, left, choice.alt, choice.placement, rows if index is not None else None)
        placed.append((role.name, choice.alt, choice.placement))
    return tuple(placed)


def _take(cluster: Cluster, left: np.ndarray, alt: Alternative, placement: tuple[tuple[int, int], ...],
          rows: dict[int, list[float]] | None) -> None:
    """Take ``placement`` off ``left`` (and note the changed rows in ``rows``, when given)."""
    need = cluster.need_rows(alt)
    for node, count in placement:
        left[node] -= np.multiply(count, need[node] if alt.mixed else need)
        if rows is not None:
            rows[node] = left[node].tolist()


def on_cpu(cluster: Cluster, choice: Choice) -> tuple[int, ...]:
    """The node indices of ``choice``'s workers that take no GPU (a mixed choice's CPU nodes)."""
    if not choice.alt.mixed:
        return ()
    return tuple(i for i, _ in choice.placement if not cluster.has_gpu[i])


def nodes_of(choice: Choice) -> list[int]:
    """Every node index ``choice`` uses (workers and roles), each once, in ascending order."""
    if not choice.roles:
        return sorted(i for i, _ in choice.placement)
    return sorted({i for i, _ in choice.placement} | {i for _, _, p in choice.roles for i, _ in p})


def use_of(choice: Choice, cluster: Cluster | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(node indices, per-node [cpus, gpus, memory]) that ``choice`` takes, workers and roles;
    each node once; a mixed choice needs ``cluster`` (its per-node needs)."""
    nodes = np.array([i for i, _ in choice.placement], dtype=np.int64)
    workers = np.array([w for _, w in choice.placement], dtype=np.float64)
    if choice.alt.mixed:
        use = workers[:, None] * cluster.need_rows(choice.alt)[nodes]
    else:
        use = np.multiply.outer(workers, np.asarray(choice.alt.need, dtype=np.float64))
    if not choice.roles:
        return nodes, use
    rows: dict[int, np.ndarray] = dict(zip(nodes.tolist(), use))
    for _, alt, placement in choice.roles:
        for node, count in placement:
            taken = np.multiply(float(count), np.asarray(alt.need, dtype=np.float64))
            rows[node] = rows[node] + taken if node in rows else taken
    ordered = sorted(rows)
    return np.array(ordered, dtype=np.int64), np.array([rows[i] for i in ordered], dtype=np.float64).reshape(-1, 3)


def largest_fitting(low: int, high: int, fits) -> int:  # noqa: ANN001 - fits: Callable[[int], bool]
    """The largest count in ``low..high`` for which ``fits`` holds, by bisection (fitting is
    monotone: fewer workers fit wherever more do); ``low`` itself must fit."""
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low
