"""The cluster as arrays for one scheduling cycle, and what a job may run as.

Contract:
- ``Cluster(nodes)`` indexes nodes in id order (so input order never changes a decision) and
  holds ``total`` (N×3: cpus, gpus, memory bytes) and the ``ready`` mask. It never changes.
- ``alternatives(job, cluster)`` lists what a job may be granted, as tiers tried in order: a
  job asking for "any accelerator" gets one ``Alternative`` per GPU type in the cluster (a gang
  never mixes GPU types); "prefer" adds a CPU tier after the GPU tier; "any" (workers of any
  device in one gang) is one tier, one ``Alternative`` per GPU type, each eligible on the nodes
  without GPUs and the nodes of that type (``mixed``). Pure.
- A mixed alternative's need differs per node: a worker on a node with GPUs takes ``gpu`` GPUs
  there (it is a GPU rank), one on a node without GPUs takes none (``Cluster.need_rows``). The
  rule depends only on the node, never on what is free, so capacities stay monotone.
- ``usage(shape, workers)`` is the resource vector a number of workers takes.
- ``Cluster.roles_of(job)``: per role of ``job`` (``QueuedJob.roles``) a ``RoleRequest``: the
  role's processes as a job of their own (spread freely, the job's labels), its tiers of
  alternatives and what it takes in all. Cached per cycle.
- ``check_input`` raises ``InvalidSpec`` for input no cycle can use (duplicate ids, negative
  node resources); ``job_problem`` names what is wrong with one job. Nothing else here raises.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from torchrelay.errors import InvalidSpec
from torchrelay.scheduler.types import QueuedJob, SchedulerInput, WorkerShape

CPU, GPU, MEM = 0, 1, 2
ACCELERATOR_MODES = ("none", "required", "prefer", "any")


@dataclass(frozen=True, slots=True)
class Alternative:
    """One way to run a job: the granted worker shape and which nodes may take it."""

    shape: WorkerShape  # as granted: gpu_type is the node type the gang runs on, gpu may be 0
    need: tuple[float, float, float]  # per worker: cpus, gpus, memory (on a GPU node, if mixed)
    # (runs on GPUs?, which type, mixed?): which nodes may take it; derived from ``shape``, kept
    # as a field because fit checks ask for it thousands of times a cycle
    gpu_key: tuple[bool, str | None, bool] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        gpu = self.shape.gpu > 0
        object.__setattr__(self, "gpu_key", (gpu, self.shape.gpu_type if gpu else None, self.mixed))

    @property
    def mixed(self) -> bool:
        """Workers of any device: GPU ranks on GPU nodes, CPU ranks on nodes without GPUs."""
        return self.shape.accelerator == "any"

    @property
    def least_need(self) -> tuple[float, float, float]:
        """The least one worker takes on any node (a mixed worker on a CPU node takes no GPU)."""
        return (self.need[0], 0.0, self.need[2]) if self.mixed else self.need


@dataclass(frozen=True, slots=True)
class RoleRequest:
    """One role of a job as the placement sees it (see ``Cluster.roles_of``)."""

    name: str
    probe: QueuedJob  # the role's processes as a gang of their own: spread, the job's labels
    tiers: tuple[tuple[Alternative, ...], ...]
    # what the role takes in all (cpus, gpus, memory): the same for every alternative, as a
    # role may not use accelerator "prefer"
    demand: tuple[float, float, float]


class Cluster:
    """Static arrays over the nodes of one cycle (see module contract)."""

    def __init__(self, nodes: tuple) -> None:
        ordered = sorted(nodes, key=lambda n: n.id)
        self.nodes = ordered
        self.ids = [n.id for n in ordered]
        self.index = {node_id: i for i, node_id in enumerate(self.ids)}
        self.total = np.array([[n.cpus, n.gpus, n.memory] for n in ordered], dtype=np.float64).reshape(-1, 3)
        self.ready = np.array([n.ready for n in ordered], dtype=bool)
        self.has_gpu = self.total[:, GPU] > 0
        self.gpu_types = sorted({n.gpu_type for n in ordered if n.gpus > 0}, key=lambda t: (t is not None, t or ""))
        self._labels = [dict(n.labels) for n in ordered]
        self._label_columns: dict[str, np.ndarray] = {}  # label key -> each node's value (or None)
        self._gpu_type_column = np.array([n.gpu_type for n in ordered], dtype=object).reshape(-1)
        self._masks: dict[tuple, np.ndarray] = {}
        self._need_rows: dict[tuple, np.ndarray] = {}
        self._roles: dict[tuple, tuple[RoleRequest, ...]] = {}
        # dims a node has at all, for the fragmentation score (avoid dividing by zero)
        self.inv_total = np.where(self.total > 0, 1.0 / np.where(self.total > 0, self.total, 1.0), 0.0)

    def __len__(self) -> int:
        return len(self.ids)

    def eligible(self, alt: Alternative, labels: tuple[tuple[str, str], ...]) -> np.ndarray:
        """Nodes (ready or not) whose GPU type and labels suit ``alt``; cached per cycle."""
        key = (alt.gpu_key, labels)
        mask = self._masks.get(key)
        if mask is None:
            wants_gpu, gpu_type, mixed = alt.gpu_key
            mask = np.ones(len(self.ids), dtype=bool)
            if mixed:
                mask &= ~self.has_gpu | _equal(self._gpu_type_column, gpu_type)
            elif wants_gpu:
                mask &= self.has_gpu & _equal(self._gpu_type_column, gpu_type)
            for k, v in dict(labels).items():
                column = self._label_columns.get(k)
                if column is None:
                    column = np.array([node_labels.get(k) for node_labels in self._labels], dtype=object).reshape(-1)
                    self._label_columns[k] = column
                mask &= _equal(column, v)
            self._masks[key] = mask
        return mask

    def need_rows(self, alt: Alternative) -> tuple[float, float, float] | np.ndarray:
        """What one worker of ``alt`` takes on each node: ``alt.need`` itself, or for a mixed
        alternative an N×3 array (no GPUs on the nodes without GPUs); cached per cycle."""
        if not alt.mixed:
            return alt.need
        rows = self._need_rows.get(alt.need)
        if rows is None:
            rows = self._need_rows[alt.need] = np.tile(np.asarray(alt.need, dtype=np.float64), (len(self.ids), 1))
            rows[~self.has_gpu, GPU] = 0.0
        return rows

    def roles_of(self, job: QueuedJob) -> tuple[RoleRequest, ...]:
        """``job``'s roles besides its workers, in order (see module contract); () for none."""
        if not job.roles:
            return ()
        key = (job.roles, job.labels)
        found = self._roles.get(key)
        if found is None:
            requests = []
            for name, count, shape in job.roles:
                probe = QueuedJob(job.job_id, job.user, job.priority, job.submit_seq, count, shape, labels=job.labels)
                tiers = alternatives(probe, self)
                demand = tuple(usage(tiers[0][0].shape, count).tolist())
                requests.append(RoleRequest(name, probe, tiers, demand))
            found = self._roles[key] = tuple(requests)
        return found


def _equal(column: np.ndarray, value: object) -> np.ndarray:
    """Element-wise ``==`` of an object column with one value (None included), as a bool array."""
    return np.fromiter((x == value for x in column.tolist()), dtype=bool, count=len(column))


def usage(shape: WorkerShape, workers: int) -> np.ndarray:
    """Resources ``workers`` workers of ``shape`` take: [cpus, gpus, memory]."""
    return np.array([shape.cpu * workers, shape.gpu * workers, shape.memory * workers], dtype=np.float64)


def without_roles(job: QueuedJob) -> QueuedJob:
    """``job`` with its workers only (for "would the workers alone fit?")."""
    return replace(job, roles=()) if job.roles else job


def _alt(shape: WorkerShape) -> Alternative:
    return Alternative(shape=shape, need=(float(shape.cpu), float(shape.gpu), float(shape.memory)))


def alternatives(job: QueuedJob, cluster: Cluster) -> tuple[tuple[Alternative, ...], ...]:
    """Tiers of ways to run ``job``: the first tier with a placement wins (see module contract)."""
    shape = job.shape
    if shape.accelerator == "any":
        types = [shape.gpu_type] if shape.gpu_type is not None else (cluster.gpu_types or [None])
        return (tuple(_alt(replace(shape, gpu=max(1, shape.gpu), gpu_type=t)) for t in types),)
    wants_gpu = shape.gpu > 0 or shape.accelerator in ("required", "prefer")
    tiers: list[tuple[Alternative, ...]] = []
    if wants_gpu:
        gpus = max(1, shape.gpu)
        types = [shape.gpu_type] if shape.gpu_type is not None else cluster.gpu_types
        if not types:  # no GPU node at all: keep one tier so "unschedulable" can be reported
            types = [shape.gpu_type]
        tiers.append(tuple(_alt(replace(shape, gpu=gpus, gpu_type=t)) for t in types))
    if not wants_gpu or shape.accelerator == "prefer":
        tiers.append((_alt(replace(shape, gpu=0, gpu_type=None)),))
    return tuple(tiers)


def check_input(inp: SchedulerInput) -> None:
    """Raise ``InvalidSpec`` naming the first duplicated id or malformed node: input no cycle can use."""
    node_ids = {node.id for node in inp.nodes}
    job_ids = {a.job_id for a in inp.running} | {j.job_id for j in inp.queue}
    malformed = any(node.cpus < 0 or node.gpus < 0 or node.memory < 0 for node in inp.nodes)
    if (len(node_ids) == len(inp.nodes) and len(job_ids) == len(inp.running) + len(inp.queue)
            and not malformed and inp.estimate_limit >= 0):
        return  # the usual case, checked in bulk; the loops below name the first problem
    seen_nodes: set[str] = set()
    for node in inp.nodes:
        if node.id in seen_nodes:
            raise InvalidSpec(f"node id {node.id!r} appears twice in the scheduler input; node ids are unique")
        seen_nodes.add(node.id)
        if node.cpus < 0 or node.gpus < 0 or node.memory < 0:
            raise InvalidSpec(f"node {node.id!r} has negative resources (cpus={node.cpus}, gpus={node.gpus}, "
                              f"memory={node.memory}); use values >= 0")
    seen_jobs: set[str] = set()
    for job_id in [a.job_id for a in inp.running] + [j.job_id for j in inp.queue]:
        if job_id in seen_jobs:
            raise InvalidSpec(f"job id {job_id!r} appears twice among running and queued jobs; job ids are unique")
        seen_jobs.add(job_id)
    if inp.estimate_limit < 0:
        raise InvalidSpec(f"estimate_limit={inp.estimate_limit}; use 0 or more")


def job_problem(job: QueuedJob) -> str | None:
    """Why ``job`` is malformed (a sentence naming the value), or None. The server may call it
    at submission; ``schedule`` reports such a job as waiting "unschedulable" instead of failing
    the whole cycle."""
    return gang_problem(job) or runtime_problem(job)


def gang_problem(job: QueuedJob) -> str | None:
    """The part of ``job_problem`` about the shape and the gang (what a job kind shares)."""
    shape = job.shape
    if shape.accelerator not in ACCELERATOR_MODES:
        return f"accelerator={shape.accelerator!r}; use one of {', '.join(ACCELERATOR_MODES)}"
    if shape.cpu < 0 or shape.gpu < 0 or shape.memory < 0:
        return f"per-worker cpu={shape.cpu}, gpu={shape.gpu}, memory={shape.memory}; each must be >= 0"
    if shape.accelerator == "none" and shape.gpu == 0 and shape.gpu_type is not None:
        return (f"gpu_type={shape.gpu_type!r} with gpu=0; ask for gpu >= 1 or set accelerator to "
                f"'required' or 'prefer'")
    if job.workers < 1:
        return f"workers={job.workers}; a job has at least 1 worker"
    if (job.nodes is None) != (job.workers_per_node is None):
        return f"nodes={job.nodes} and workers_per_node={job.workers_per_node} go together; give both or neither"
    if job.nodes is not None and (job.nodes < 1 or job.workers_per_node < 1
                                  or job.nodes * job.workers_per_node != job.workers):
        return (f"nodes × workers_per_node = {job.nodes} × {job.workers_per_node} does not equal "
                f"workers={job.workers}")
    if job.min_workers is not None:
        problem = elastic_problem(job)
        if problem is not None:
            return problem
    return roles_problem(job) if job.roles else None


def elastic_problem(job: QueuedJob) -> str | None:
    """The part of ``job_problem`` about an elastic job's ``min_workers``."""
    if not 1 <= job.min_workers <= job.workers:
        return f"min_workers={job.min_workers}; an elastic job's min_workers lies in [1, workers={job.workers}]"
    if job.workers_per_node is not None or job.roles:
        return (f"min_workers={job.min_workers} with {'workers_per_node' if job.workers_per_node else 'roles'}; "
                f"an elastic job is a spread gang of workers only: give min_workers=None")
    return None


def roles_problem(job: QueuedJob) -> str | None:
    """The part of ``job_problem`` about ``job.roles``."""
    names: set[str] = set()
    for role in job.roles:
        if not (isinstance(role, tuple) and len(role) == 3 and isinstance(role[2], WorkerShape)):
            return f"role {role!r} is not (name, count, WorkerShape)"
        name, count, shape = role
        if not isinstance(name, str) or not name or name == "workers":
            return f"role name {name!r}; use a non-empty name other than 'workers'"
        if name in names:
            return f"role {name!r} appears twice; role names are unique"
        names.add(name)
        if not isinstance(count, int) or count < 1:
            return f"role {name!r} has count={count!r}; a role runs at least 1 process"
        if shape.accelerator not in ("none", "required"):
            return (f"role {name!r}: accelerator={shape.accelerator!r}; a role uses 'none' or 'required' "
                    f"('prefer' is for workers only)")
        if shape.cpu < 0 or shape.gpu < 0 or shape.memory < 0:
            return f"role {name!r}: cpu={shape.cpu}, gpu={shape.gpu}, memory={shape.memory}; each must be >= 0"
        if shape.accelerator == "none" and shape.gpu == 0 and shape.gpu_type is not None:
            return (f"role {name!r}: gpu_type={shape.gpu_type!r} with gpu=0; ask for gpu >= 1 or set "
                    f"accelerator to 'required'")
    return None


def runtime_problem(job: QueuedJob) -> str | None:
    """The part of ``job_problem`` about the declared max runtime."""
    if job.max_runtime_s is not None and not job.max_runtime_s > 0:
        return f"max_runtime_s={job.max_runtime_s}; use a positive number of seconds or None"
    return None
