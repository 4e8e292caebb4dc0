"""The server's jobs as the scheduling policy sees them, and its decisions as people read them. Pure.

- ``queued_job(seq, spec)``: a waiting job as a ``scheduler.QueuedJob``; ``job_roles(spec)``:
  its processes besides the workers (a parameter-server job's servers);
- ``allocation(...)``: a job holding nodes, from its live launches, as a ``scheduler.Allocation``;
- ``placement_summary(...)``: the "placed on a×2, b×2" text of a placement's event;
- ``never_fits_message(spec, nodes)``: why a submission is refused as unschedulable;
- ``queue_rows(...)``: ``relay queue``'s rows from one cycle's decisions;
- ``job_labels``, ``submission_probe``, ``waiting_reason``: an mpirun job needs nodes with Open
  MPI (``wire.MPIRUN_LABEL``), is taken where none is yet, and waits saying so.
- ``elastic_min(spec)``: the ``min_workers`` the policy may start or shrink an elastic job to
  (``strategy.elastic``; a spread gang only); ``shrink_event(...)`` / ``grow_event(...)``: the
  events a shrink and a grow record; ``all_running`` / ``workers_finished``: when a job is not
  shrunk or grown (launches still starting; workers already done).

No I/O: ``rows.py`` reads what these take and ``control.py`` carries out the decisions.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Protocol, Sequence

from torchrelay import scheduler as policy
from torchrelay.layout import RankLayout
from torchrelay.server.views import job_id_of
from torchrelay.spec import JobSpec, JobState, LaunchState, ParameterServerStrategy, Resources
from torchrelay.wire import MPIRUN_LABEL

# the jobs a cycle reads: those waiting and those holding (or about to hold) nodes
SCHEDULER_STATES = (JobState.QUEUED, JobState.SCHEDULED, JobState.RUNNING, JobState.RESTARTING,
                    JobState.CANCELLING)


def worker_shape(res: Resources) -> policy.WorkerShape:
    return policy.WorkerShape(cpu=res.cpu, gpu=res.gpu, memory=res.memory, gpu_type=res.gpu_type,
                              accelerator=res.accelerator_mode)


def job_roles(spec: JobSpec) -> tuple[tuple[str, int, policy.WorkerShape], ...]:
    """The job's processes besides its workers, as the policy places them: a parameter-server
    job's servers with their own resources (ranks after the workers': ``torchrelay.layout``)."""
    if isinstance(spec.strategy, ParameterServerStrategy):
        return (("server", spec.strategy.servers, worker_shape(spec.strategy.server_resources)),)
    return ()


# why an mpirun job waits where no node can run it, after the policy's own reason
MPI_HINT = (f"launcher: mpirun runs only on nodes whose agent found Open MPI's mpirun and orted (label "
            f"{MPIRUN_LABEL[0]}={MPIRUN_LABEL[1]}); install Open MPI there (Debian: openmpi-bin) and restart the agent")


def job_labels(spec: JobSpec) -> tuple[tuple[str, str], ...]:
    """The node labels a job needs: its spec's, and for an mpirun job ``wire.MPIRUN_LABEL``."""
    labels = dict(spec.labels)
    if spec.launcher == "mpirun":
        labels.setdefault(*MPIRUN_LABEL)
    return tuple(sorted(labels.items()))


def submission_probe(spec: JobSpec, probe: policy.QueuedJob) -> policy.QueuedJob:
    """What a submission is checked against the ready nodes with: ``probe`` without the MPI
    label, so that an mpirun job on a cluster with no Open MPI node yet is taken and waits,
    its reason in ``relay queue`` (``waiting_reason``), rather than refused."""
    if spec.launcher != "mpirun" or MPIRUN_LABEL[0] in spec.labels:
        return probe
    return dataclasses.replace(probe, labels=tuple(sorted(spec.labels.items())))


def waiting_reason(reason: str, spec: JobSpec) -> str:
    """The policy's ``reason`` as people read it: an mpirun job that fits no node says why."""
    if spec.launcher == "mpirun" and reason.startswith("unschedulable"):
        return f"{reason}; {MPI_HINT}"
    return reason


def elastic_min(spec: JobSpec) -> int | None:
    """``strategy.elastic.min_workers`` of a job the policy may run with fewer workers than
    ``workers`` (start it smaller, shrink it); None for any other job. A job placed as
    ``nodes`` × ``workers_per_node``, or with roles, runs whole."""
    elastic = getattr(spec.strategy, "elastic", None)
    if elastic is None or spec.nodes is not None or job_roles(spec):
        return None
    return min(elastic.min_workers, spec.workers)


def shrink_event(shrink: policy.Shrink, ranks: Sequence[int], workers_before: int, names: Mapping[str, str]) -> str:
    """What a shrink records on the shrunk job: which ranks leave, where, and for which job."""
    where = ", ".join(f"{names.get(n, n)}×{k}" for n, k in shrink.release)
    return (f"shrinking for higher-priority job {shrink.for_job}: rank(s) {', '.join(map(str, ranks))} leave "
            f"({where}); elastic: {workers_before} → {workers_before - len(ranks)} workers")


def all_running(live: Sequence[Any]) -> bool:
    """Whether every live launch (rows with ``state``) of an attempt reported running: an
    elastic job whose launches (its joiners' included) are still starting is neither shrunk nor
    grown until they are."""
    return all(x.state == LaunchState.RUNNING.value for x in live)


def workers_finished(launches: Sequence[Any]) -> bool:
    """Whether some launch of an attempt (rows with ``state``, ``succeeded``, ``rank_offset``,
    ``nproc``, ``released``) exited successfully with ranks no shrink released: its workers
    finished training, so the job is ending and a joiner would find nothing to join."""
    return any(x.state == LaunchState.EXITED.value and x.succeeded
               and not set(range(x.rank_offset, x.rank_offset + x.nproc)) <= set(x.released or ())
               for x in launches)


def grow_event(grow: policy.Grow, ranks: Sequence[int], workers_before: int, names: Mapping[str, str]) -> str:
    """What a grow records on the grown job: which ranks join, where."""
    where = ", ".join(f"{names.get(n, n)}×{k}" for n, k in grow.add)
    return (f"growing: rank(s) {', '.join(map(str, ranks))} join ({where}) and receive the members' state; "
            f"elastic: {workers_before} → {workers_before + len(ranks)} workers")


def queued_job(seq: int, spec: JobSpec) -> policy.QueuedJob:
    """What the policy is told of a waiting job: it never changes while the job waits."""
    return policy.QueuedJob(
        job_id=job_id_of(seq), user=spec.user or "", priority=spec.priority, submit_seq=seq,
        workers=spec.workers, shape=worker_shape(spec.resources),
        workers_per_node=spec.workers_per_node if spec.nodes else None, nodes=spec.nodes,
        labels=job_labels(spec), preemptible=spec.preemptible,
        max_runtime_s=spec.max_runtime_s, roles=job_roles(spec), min_workers=elastic_min(spec))


class LiveLaunch(Protocol):
    """A launch that has not exited, with what the policy granted each of its processes (the
    rows ``rows.py`` reads have these attributes)."""

    node_id: str
    nproc: int
    rank_offset: int
    cpu: float
    gpu: int
    memory: int
    # and optionally ``released``: the ranks of an elastic launch asked to leave (a shrink)


def held_workers(launch: LiveLaunch) -> int:
    """The workers ``launch`` holds: its processes less those asked to leave (a shrink)."""
    return launch.nproc - len(getattr(launch, "released", None) or ())


def _granted(launch: LiveLaunch, gpu_type: str | None) -> policy.WorkerShape:
    return policy.WorkerShape(cpu=launch.cpu, gpu=launch.gpu, memory=launch.memory,
                              gpu_type=gpu_type if launch.gpu else None,
                              accelerator="required" if launch.gpu else "none")


def allocation(*, seq: int, spec: JobSpec, live: Sequence[LiveLaunch], started_at: float,
               preempting: bool, running: bool = True) -> policy.Allocation:
    """A job holding nodes (``live``: its current attempt's launches, not empty, in node rank
    order). A parameter-server job's server launches are those whose ranks the layout gives its
    servers. An elastic job's workers asked to leave (a shrink) are given back at once: each
    has the job's ``stop_grace_s`` to go (SIGKILL then), and its node 0 keeps a worker. Only a
    ``running`` job (a launch of it reported running) may be shrunk, or grown back up to its
    ``workers`` (``max_workers``; its launches of joiners count as any)."""
    layout = RankLayout.of_spec(spec)
    elastic = elastic_min(spec)
    if elastic is not None:  # workers only; a grown one's joiners have ranks past its first world
        workers, servers = list(live), []
    else:
        workers = [x for x in live if not layout.is_server(x.rank_offset)]
        servers = [x for x in live if layout.is_server(x.rank_offset)]
    roles: tuple = ()
    if servers:
        server_gpu_type = (spec.strategy.server_resources.gpu_type
                           if isinstance(spec.strategy, ParameterServerStrategy) else None)
        roles = (("server", _granted(servers[0], server_gpu_type), tuple((x.node_id, x.nproc) for x in servers)),)
    shape, on_cpu = _granted((workers or list(live))[0], spec.resources.gpu_type), ()
    if spec.resources.accelerator_mode == "any":
        shape, on_cpu = _mixed(spec.resources, workers)
    return policy.Allocation(
        job_id=job_id_of(seq), user=spec.user or "", priority=spec.priority, shape=shape, on_cpu=on_cpu,
        placement=_per_node(workers),
        preemptible=spec.preemptible, started_at=started_at, max_runtime_s=spec.max_runtime_s,
        preempting=preempting, roles=roles, min_workers=elastic if running else None,
        max_workers=spec.workers if running and elastic is not None else None,
        labels=job_labels(spec) if elastic is not None else ())


def _per_node(workers: Sequence[LiveLaunch]) -> tuple[tuple[str, int], ...]:
    """((node_id, workers held), ...) in node rank order, node 0 first (kept even when it holds
    none); a node with several launches of the job (a grown elastic job's joiners) once."""
    held: dict[str, int] = {}
    for i, x in enumerate(workers):
        count = held_workers(x)
        if i == 0 or count:
            held[x.node_id] = held.get(x.node_id, 0) + count
    return tuple(held.items())


def _mixed(res: Resources, workers: Sequence[LiveLaunch]) -> tuple[policy.WorkerShape, tuple[str, ...]]:
    """A mixed-device job's granted shape (its GPU ranks') and the nodes whose workers took no GPU."""
    gpus = max([x.gpu for x in workers if x.gpu] or [max(1, res.gpu)])
    shape = policy.WorkerShape(cpu=res.cpu, gpu=gpus, memory=res.memory, gpu_type=res.gpu_type, accelerator="any")
    return shape, tuple(x.node_id for x in workers if not x.gpu)


def placement_summary(placement: policy.Placement, spec: JobSpec, names: Mapping[str, str],
                      gpu_types: Mapping[str, str | None]) -> str:
    """Where a placement puts the job, e.g. ``a×2, b×2 (1 a100 per worker); servers on c×1``."""
    text = ", ".join(f"{names[n]}×{k}" for n, k in placement.placement)
    granted = placement.shape
    on_gpus = [n for n, _ in placement.placement if n not in placement.on_cpu]
    if granted.gpu and on_gpus:
        kinds = sorted({gpu_types.get(n) or "gpu" for n in on_gpus})
        text += f" ({granted.gpu} {'/'.join(kinds)} per {'GPU rank' if placement.on_cpu else 'worker'})"
    elif spec.resources.accelerator_mode == "prefer":
        text += " (on CPUs: the gang did not fit on accelerators)"
    if placement.on_cpu:
        text += "; CPU ranks on " + ", ".join(names[n] for n in placement.on_cpu)
    for role, _, where in placement.roles:
        text += f"; {role}s on " + ", ".join(f"{names[n]}×{k}" for n, k in where)
    placed = sum(k for _, k in placement.placement)
    if placed < spec.workers:
        text += f" (elastic: {placed} of {spec.workers} workers, all the cluster had room for)"
    return text


def never_fits_message(spec: JobSpec, nodes: Sequence[policy.NodeView]) -> str:
    res = spec.resources
    servers = "".join(f" and {count} {name}s × (cpu={shape.cpu:g}, gpu={shape.gpu}, memory={shape.memory})"
                      for name, count, shape in job_roles(spec))
    return (f"job {spec.name!r} can never run here: it needs {spec.workers} workers × "
            f"(cpu={res.cpu:g}, gpu={res.gpu}, memory={res.memory}){servers} but the cluster's "
            f"{len(nodes)} ready node(s) hold cpus={sum(n.cpus for n in nodes):g}, "
            f"gpus={sum(n.gpus for n in nodes)}, memory={sum(n.memory for n in nodes)} in all; "
            f"lower `workers` or the per-worker `resources`, or add nodes")


class WaitingJob(Protocol):
    """A waiting job's row fields ``relay queue`` shows (the rows ``rows.py`` reads have them)."""

    name: str
    user: str | None
    state: str
    submitted_at: float


def queue_rows(decisions: policy.Decisions, queue: Sequence[policy.QueuedJob],
               waiting: Mapping[str, tuple[WaitingJob, JobSpec]]) -> list[dict[str, Any]]:
    """The waiting jobs (``queue``, with their rows and specs in ``waiting``) in the order the
    policy considers them, each with why it waits and, where declared max runtimes allow, its
    estimated start."""
    placed = {p.job_id for p in decisions.placements}
    order = list(decisions.order) or [q.job_id for q in queue]
    out = []
    for position, job_id in enumerate(order, 1):
        row, spec = waiting[job_id]
        out.append({"position": position, "id": job_id, "name": row.name, "user": row.user,
                    "priority": spec.priority, "workers": RankLayout.of_spec(spec).world_size,
                    "state": row.state, "submitted_at": row.submitted_at, "max_runtime_s": spec.max_runtime_s,
                    "reason": "starting" if job_id in placed else waiting_reason(decisions.waiting.get(job_id, ""), spec),
                    "estimated_start": decisions.estimated_start.get(job_id)})
    return out
