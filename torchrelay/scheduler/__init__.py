"""Scheduling policy: ``schedule(SchedulerInput) -> Decisions``. Pure: no I/O, no clock reads.

The server builds a ``SchedulerInput`` each cycle, calls ``schedule`` and carries out the
``Decisions``: start each ``Placement``, preempt (checkpoint, stop, requeue without counting
a restart) each job in ``preemptions``, end the workers each ``Shrink`` names (elastic jobs
go on smaller), start the workers each ``Grow`` adds to a running elastic job (they join it),
show ``waiting`` reasons and ``estimated_start``.
``growable(running)``: whether a cycle with an empty queue has anything to do (an elastic job
to grow). ``fits_ever(job, nodes)`` tells at submission whether a job could ever run on these nodes.

The policy (priorities, fair share, quotas, gang placement, EASY backfill, preemption,
heterogeneous requests) is stated in ``policy``'s contract and in docs/scheduling.md. Modules:
``cluster`` (arrays, request alternatives, input checks), ``placement`` (where a gang goes),
``fitindex`` (per-node capacities kept up to date, so fit checks scan no nodes),
``fairshare`` (accounting, quotas, order), ``backfill`` (reservation, estimates),
``preemption`` (victims), ``shrink`` (elastic jobs giving workers back), ``grow`` (and
taking free room back), ``policy`` (the cycle), ``fifo`` (the first-cut baseline),
``simulate`` (an event-driven trace simulator for tests and the benchmark).
"""
from __future__ import annotations

from torchrelay.scheduler.cluster import job_problem
from torchrelay.scheduler.grow import growable
from torchrelay.scheduler.policy import fits_ever, schedule
from torchrelay.scheduler.types import (Allocation, Decisions, Grow, NodeView, Placement, QueuedJob,
                                        Quota, SchedulerInput, Shrink, WorkerShape)

__all__ = ["schedule", "fits_ever", "growable", "job_problem", "Allocation", "Decisions", "Grow", "NodeView",
           "Placement", "QueuedJob", "Quota", "SchedulerInput", "Shrink", "WorkerShape"]
