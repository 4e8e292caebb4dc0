"""Inputs and outputs of the scheduling policy: plain frozen data, no I/O, no clock.

The server builds a ``SchedulerInput`` from its store each cycle, calls
``torchrelay.scheduler.schedule(input)`` and carries out the returned ``Decisions``.

Roles: a job may run processes of other shapes next to its workers (a parameter-server job's
servers need cpu and memory, no gpu). ``workers`` and ``shape`` always mean the workers;
``QueuedJob.roles`` lists the other roles as ``(name, count, shape)``, and ``Allocation.roles`` /
``Placement.roles`` where each runs as ``(name, granted shape, ((node_id, count), ...))``. A
role's processes are placed like workers (same nodes' labels, readiness, no over-commit),
spread freely over nodes, all or nothing together with the workers. Empty (the default): the
job is one shape, exactly as before.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class WorkerShape:
    """Resources one worker needs. ``gpu_type`` None = any type; ``accelerator`` is
    "none" (cpu only), "required" (gpu > 0 of gpu_type or any), or "prefer" (gpus if a
    gang fits on accelerators, else run on cpu with gpu=0)."""

    cpu: float = 1.0
    gpu: int = 0
    memory: int = 0
    gpu_type: str | None = None
    accelerator: str = "none"


# (role name, granted shape, ((node_id, processes), ...)): where one role of a job runs
RolePlacement = tuple[str, WorkerShape, tuple[tuple[str, int], ...]]


@dataclass(frozen=True, slots=True)
class NodeView:
    id: str
    cpus: float
    gpus: int
    memory: int
    gpu_type: str | None = None
    labels: tuple[tuple[str, str], ...] = ()
    ready: bool = True


@dataclass(frozen=True, slots=True)
class Allocation:
    """A running (or scheduled) job holding resources: ``placement`` is ((node_id, workers), ...)."""

    job_id: str
    user: str
    priority: int
    shape: WorkerShape
    placement: tuple[tuple[str, int], ...]
    preemptible: bool = True
    started_at: float = 0.0
    max_runtime_s: float | None = None
    # already asked to stop by an earlier preemption decision: its resources are the first a
    # preemptor counts on, and it is not listed again in ``Decisions.preemptions``
    preempting: bool = False
    # the job's other roles (see the module docstring): they hold resources as its workers do
    roles: tuple[RolePlacement, ...] = ()


@dataclass(frozen=True, slots=True)
class QueuedJob:
    job_id: str
    user: str
    priority: int
    submit_seq: int
    workers: int
    shape: WorkerShape
    workers_per_node: int | None = None
    nodes: int | None = None
    labels: tuple[tuple[str, str], ...] = ()
    preemptible: bool = True
    max_runtime_s: float | None = None
    # (name, processes, shape) of each role besides the workers; names unique, not "workers";
    # a role's shape may not use accelerator "prefer" (its demand must be known before placing)
    roles: tuple[tuple[str, int, WorkerShape], ...] = ()


@dataclass(frozen=True, slots=True)
class Quota:
    cpus: float | None = None
    gpus: int | None = None
    jobs: int | None = None


@dataclass(frozen=True, slots=True)
class SchedulerInput:
    nodes: tuple[NodeView, ...]
    running: tuple[Allocation, ...]
    queue: tuple[QueuedJob, ...]
    now: float = 0.0
    quotas: tuple[tuple[str, Quota], ...] = ()
    # how many waiting jobs (in queue order) get an ``estimated_start``; bounds the cycle's cost
    estimate_limit: int = 100


@dataclass(frozen=True, slots=True)
class Placement:
    job_id: str
    placement: tuple[tuple[str, int], ...]  # (node_id, workers), node_rank = index
    shape: WorkerShape  # the shape actually granted (differs for accelerator="prefer" on cpu)
    # each of the job's roles, in ``QueuedJob.roles`` order; each role's nodes most processes first
    roles: tuple[RolePlacement, ...] = ()


@dataclass(frozen=True, slots=True)
class Decisions:
    placements: tuple[Placement, ...] = ()
    preemptions: tuple[str, ...] = ()
    # job_id -> reason: one of "resources", "gang", "quota", "priority", "reservation",
    # "unschedulable" (can never fit this cluster), optionally with detail after ": "
    waiting: dict[str, str] = field(default_factory=dict)
    # job_id -> estimated start time (same clock as SchedulerInput.now), where known
    estimated_start: dict[str, float] = field(default_factory=dict)
    # every queued job id in the order the policy considered them (what `relay queue` shows)
    order: tuple[str, ...] = ()
