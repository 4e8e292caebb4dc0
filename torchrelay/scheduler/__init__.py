"""Scheduling policy: ``schedule(SchedulerInput) -> Decisions``. Pure: no I/O, no clock reads.

First cut: first-in first-out (priority, then submit order) with gang placement; a job that
does not fit blocks the jobs behind it (no backfill yet). Workers are packed onto as few
nodes as possible.
"""
from __future__ import annotations

from torchrelay.scheduler.types import (Allocation, Decisions, NodeView, Placement, QueuedJob,
                                        Quota, SchedulerInput, WorkerShape)

__all__ = ["schedule", "fits_ever", "Allocation", "Decisions", "NodeView", "Placement", "QueuedJob",
           "Quota", "SchedulerInput", "WorkerShape"]


def _capacity(node: NodeView, shape: WorkerShape, free: dict[str, list[float]]) -> int:
    cpu, gpu, mem = free[node.id]
    if shape.gpu and (node.gpus < shape.gpu or (shape.gpu_type and node.gpu_type != shape.gpu_type)):
        return 0
    limits = []
    if shape.cpu > 0:
        limits.append(int(cpu // shape.cpu + 1e-9))
    if shape.gpu > 0:
        limits.append(int(gpu // shape.gpu))
    if shape.memory > 0:
        limits.append(int(mem // shape.memory))
    return max(0, min(limits)) if limits else 1 << 30


def _place(job: QueuedJob, nodes: list[NodeView], free: dict[str, list[float]]) -> tuple[tuple[str, int], ...] | None:
    labels = dict(job.labels)
    eligible = [n for n in nodes if n.ready and all(dict(n.labels).get(k) == v for k, v in labels.items())]
    caps = {n.id: _capacity(n, job.shape, free) for n in eligible}
    if job.workers_per_node:
        chosen = [n for n in sorted(eligible, key=lambda n: n.id) if caps[n.id] >= job.workers_per_node]
        if len(chosen) < (job.nodes or 1):
            return None
        return tuple((n.id, job.workers_per_node) for n in chosen[: job.nodes or 1])
    # pack: largest capacity first, fewest nodes
    order = sorted(eligible, key=lambda n: (-caps[n.id], n.id))
    left, out = job.workers, []
    for node in order:
        if left <= 0:
            break
        take = min(caps[node.id], left)
        if take > 0:
            out.append((node.id, take))
            left -= take
    return tuple(out) if left <= 0 else None


def fits_ever(job: QueuedJob, nodes: tuple[NodeView, ...]) -> bool:
    """Whether ``job`` could be placed on an empty cluster of ``nodes``."""
    free = {n.id: [n.cpus, n.gpus, n.memory] for n in nodes}
    return _place(job, [n for n in nodes], free) is not None


def schedule(inp: SchedulerInput) -> Decisions:
    free = {n.id: [n.cpus, float(n.gpus), float(n.memory)] for n in inp.nodes}
    for alloc in inp.running:
        for node_id, workers in alloc.placement:
            if node_id in free:
                free[node_id][0] -= alloc.shape.cpu * workers
                free[node_id][1] -= alloc.shape.gpu * workers
                free[node_id][2] -= alloc.shape.memory * workers
    nodes = list(inp.nodes)
    placements, waiting = [], {}
    blocked = False
    for job in sorted(inp.queue, key=lambda j: (-j.priority, j.submit_seq)):
        if blocked:
            waiting[job.job_id] = "priority: behind an earlier job that does not fit yet"
            continue
        if not fits_ever(job, inp.nodes):
            waiting[job.job_id] = "unschedulable: more than the cluster can ever hold"
            continue
        where = _place(job, nodes, free)
        if where is None:
            waiting[job.job_id] = "resources: gang does not fit the free resources"
            blocked = True
            continue
        for node_id, workers in where:
            free[node_id][0] -= job.shape.cpu * workers
            free[node_id][1] -= job.shape.gpu * workers
            free[node_id][2] -= job.shape.memory * workers
        placements.append(Placement(job.job_id, where, job.shape))
    return Decisions(placements=tuple(placements), waiting=waiting)
