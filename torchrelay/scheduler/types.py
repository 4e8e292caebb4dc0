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

Mixed devices: a job whose shape has accelerator "any" runs its workers on GPU nodes (each
taking ``gpu`` GPUs, a GPU rank) and on nodes without GPUs (taking none, a CPU rank) in one
gang. Its granted ``shape`` is the GPU one; ``Placement.on_cpu`` / ``Allocation.on_cpu`` name
the nodes of ``placement`` whose workers take no GPU, and ``shape_on(shape, on_cpu)`` is the
shape a worker there is granted. ``parts()`` lists (shape, placement) per kind of process.

Elastic jobs (``QueuedJob.min_workers`` / ``Allocation.min_workers``, a spread gang without
roles): a job may start with fewer workers than ``workers``, down to ``min_workers``, and a
running one may be shrunk down to ``min_workers`` to make room for a higher-priority job
(``Decisions.shrinks``) instead of being preempted whole, and one below ``max_workers`` is
grown back when room frees up (``Decisions.grows``). A running elastic job's first placement
entry is its node 0 (it hosts the job's store), which keeps at least one worker.
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
    accelerator: str = "none"  # or "any": gpu GPUs on GPU nodes, none elsewhere (module docstring)


def shape_on(shape: WorkerShape, on_cpu: bool) -> WorkerShape:
    """What a worker of granted ``shape`` takes on a node: a mixed-device worker on a node
    without GPUs takes no GPU (see the module docstring); otherwise ``shape`` itself."""
    if on_cpu and shape.accelerator == "any":
        return WorkerShape(cpu=shape.cpu, gpu=0, memory=shape.memory, gpu_type=None, accelerator="any")
    return shape


def split_parts(shape: WorkerShape, placement: tuple[tuple[str, int], ...], on_cpu: tuple[str, ...],
                roles: tuple[RolePlacement, ...]) -> tuple[tuple[WorkerShape, tuple[tuple[str, int], ...]], ...]:
    """(shape, ((node_id, processes), ...)) of the workers (split into GPU and CPU ones when
    ``on_cpu`` names nodes) and of each role."""
    if on_cpu:
        cpu_nodes = set(on_cpu)
        workers = ((shape, tuple(p for p in placement if p[0] not in cpu_nodes)),
                   (shape_on(shape, True), tuple(p for p in placement if p[0] in cpu_nodes)))
    else:
        workers = ((shape, placement),)
    return workers + tuple((role_shape, where) for _, role_shape, where in roles)


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
    # nodes of ``placement`` whose workers take no GPU (mixed devices; see the module docstring)
    on_cpu: tuple[str, ...] = ()
    # elastic: it may be shrunk down to this many workers (``placement`` holds the workers it
    # runs now, its node 0 first); None: it runs whole or not at all
    min_workers: int | None = None
    # elastic: it may be grown back up to this many workers (the ``workers`` it asks for) when
    # room frees up (``Decisions.grows``); its ``labels`` say where new workers may go
    max_workers: int | None = None
    labels: tuple[tuple[str, str], ...] = ()

    def parts(self) -> tuple[tuple[WorkerShape, tuple[tuple[str, int], ...]], ...]:
        return split_parts(self.shape, self.placement, self.on_cpu, self.roles)


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
    # elastic: it may start with fewer than ``workers`` workers, down to this many (a spread
    # gang without roles: not with ``workers_per_node``); None: all of them or none
    min_workers: int | None = None


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
    # nodes of ``placement`` whose workers take no GPU (mixed devices; see the module docstring)
    on_cpu: tuple[str, ...] = ()

    def parts(self) -> tuple[tuple[WorkerShape, tuple[tuple[str, int], ...]], ...]:
        return split_parts(self.shape, self.placement, self.on_cpu, self.roles)

    def shape_on(self, node_id: str) -> WorkerShape:
        """The shape a worker of this placement is granted on ``node_id``."""
        return shape_on(self.shape, node_id in self.on_cpu)


@dataclass(frozen=True, slots=True)
class Shrink:
    """Release ``release`` ((node_id, workers), ...) of the running elastic job ``job_id`` so
    that ``for_job`` can start (in a later cycle, once they have left); the job goes on with
    the rest of its workers."""

    job_id: str
    release: tuple[tuple[str, int], ...]
    for_job: str

    @property
    def workers(self) -> int:
        return sum(count for _, count in self.release)


@dataclass(frozen=True, slots=True)
class Grow:
    """Start ``add`` ((node_id, workers), ...) more workers of the running elastic job
    ``job_id``, each granted ``shape``: they join the job at a step boundary and receive the
    members' state (``torchrelay.train.elastic``)."""

    job_id: str
    add: tuple[tuple[str, int], ...]
    shape: WorkerShape

    @property
    def workers(self) -> int:
        return sum(count for _, count in self.add)


@dataclass(frozen=True, slots=True)
class Decisions:
    placements: tuple[Placement, ...] = ()
    preemptions: tuple[str, ...] = ()
    # running elastic jobs to shrink instead of preempting them whole (see ``Shrink``)
    shrinks: tuple[Shrink, ...] = ()
    # running elastic jobs below their workers given free room back (see ``Grow``)
    grows: tuple[Grow, ...] = ()
    # job_id -> reason: one of "resources", "gang", "quota", "priority", "reservation",
    # "unschedulable" (can never fit this cluster), optionally with detail after ": "
    waiting: dict[str, str] = field(default_factory=dict)
    # job_id -> estimated start time (same clock as SchedulerInput.now), where known
    estimated_start: dict[str, float] = field(default_factory=dict)
    # every queued job id in the order the policy considered them (what `relay queue` shows)
    order: tuple[str, ...] = ()
