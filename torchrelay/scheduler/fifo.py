"""Plain first-in first-out: the baseline the benchmark compares the policy with.

Contract: ``schedule_fifo(inp)`` considers jobs by priority, then submit order; places each with
the same gang placement as the policy; the first job that does not fit blocks every job behind
it (no backfill, no fair share, no preemption, quotas ignored). Jobs that can never fit (or are
malformed) are skipped as ``unschedulable``. Jobs with roles are placed with all their roles, as
by the policy. Pure.
"""
from __future__ import annotations

import numpy as np

from torchrelay.scheduler.cluster import Cluster, alternatives, job_problem, usage
from torchrelay.scheduler.placement import feasible, on_cpu, place_best, use_of
from torchrelay.scheduler.types import Decisions, Placement, SchedulerInput


def schedule_fifo(inp: SchedulerInput) -> Decisions:
    cluster = Cluster(inp.nodes)
    free = cluster.total.copy()
    for alloc in inp.running:
        for shape, placement in alloc.parts():
            for node_id, workers in placement:
                if node_id in cluster.index:
                    free[cluster.index[node_id]] -= usage(shape, workers)
    everywhere = np.ones(len(cluster), dtype=bool)
    placements, waiting, blocked = [], {}, False
    order = sorted(inp.queue, key=lambda j: (-j.priority, j.submit_seq, j.job_id))
    ever: dict[tuple, bool] = {}  # per job kind: could it fit the empty cluster?
    for job in order:
        tiers = alternatives(job, cluster)
        kind = (job.shape, job.workers, job.workers_per_node, job.labels, job.roles)
        if kind not in ever:
            ever[kind] = job_problem(job) is None and feasible(cluster, tiers, job, cluster.total, everywhere)
        if not ever[kind]:
            waiting[job.job_id] = "unschedulable: does not fit this cluster even when it is empty"
            continue
        if blocked:
            waiting[job.job_id] = "priority: behind an earlier job that does not fit yet"
            continue
        choice = place_best(cluster, tiers, job, free, cluster.ready)
        if choice is None:
            waiting[job.job_id] = "resources: the gang does not fit the free resources"
            blocked = True
            continue
        nodes, use = use_of(choice, cluster)
        np.subtract.at(free, nodes, use)
        ids = cluster.ids
        roles = tuple((name, alt.shape, tuple((ids[i], w) for i, w in placement))
                      for name, alt, placement in choice.roles)
        placements.append(Placement(job.job_id, tuple((ids[i], w) for i, w in choice.placement),
                                    choice.alt.shape, roles, tuple(ids[i] for i in on_cpu(cluster, choice))))
    return Decisions(placements=tuple(placements), waiting=waiting, order=tuple(j.job_id for j in order))
