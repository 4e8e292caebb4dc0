"""A job's launches: how a placement becomes launches, and what each launch's agent is told. Pure.

- ``plan_launches(job_id, attempt, placement, layout)``: one ``LaunchPlan`` per role and node,
  with its ranks, in the rank layout of ``torchrelay.layout`` (workers ``0..W-1`` first, then a
  parameter-server job's servers ``W..W+S-1``), which the worker side reads back.
- ``WorkerEnvironment``: the ``RELAY_*`` variables a launch's workers get, as typed fields
  (what the spec asks, the rank layout, the accelerators granted) rendered by ``variables``.
- ``launch_assignment(...)``: the ``wire.LaunchAssignment`` of one launch in a heartbeat reply.
- Elastic jobs: ``placed_layout`` is the layout of a job the policy started with fewer workers
  than its spec asks (its world is what was placed: the elastic group handles membership);
  ``ranks_to_release`` which ranks of a launch leave when the policy shrinks the job;
  ``grow_launches`` the launches of the workers a grow adds (joiners: ``is_joiner``, whose
  workers get ``RELAY_ELASTIC_JOIN=1``).

GPU *counts* are granted here; which device indices a launch uses is the agent's choice on its
node (``torchrelay.agent.gpus``). No I/O: ``rows.py`` reads the rows these take.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

from torchrelay import scheduler as policy
from torchrelay.layout import RankLayout
from torchrelay.spec import CheckpointPolicy, JobSpec, Strategy
from torchrelay.storage import ArtifactStore
from torchrelay.wire import LaunchAssignment, MpiWorld

JOIN_VAR = "RELAY_ELASTIC_JOIN"  # read by torchrelay.train.elastic.ElasticGroup.from_env


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchPlan:
    """One launch (one torchrun) of an attempt: ``nproc`` processes with global ranks
    ``rank_offset .. rank_offset + nproc - 1``, each granted ``shape``."""

    id: str
    node_id: str
    node_rank: int
    nnodes: int
    nproc: int
    rank_offset: int
    world_size: int
    shape: policy.WorkerShape


def launch_id_of(job_id: str, attempt: int, node_rank: int) -> str:
    return f"{job_id}-a{attempt}-n{node_rank}"


def plan_launches(job_id: str, attempt: int, placement: policy.Placement, layout: RankLayout) -> tuple[LaunchPlan, ...]:
    """The launches of a placement: the workers' first, then each role's, one per node, so that
    ranks follow ``node_rank`` and match ``layout``; a node with workers and servers runs two
    launches. Raises ``ValueError`` when the placement does not hold the layout's world."""
    # a mixed-device job's workers on a node without GPUs are granted none (``Placement.on_cpu``)
    where = [(placement.shape_on(node_id), node_id, nproc) for node_id, nproc in placement.placement]
    where += [(shape, node_id, nproc) for _, shape, nodes in placement.roles for node_id, nproc in nodes]
    world = sum(nproc for _, _, nproc in where)
    workers = sum(nproc for _, nproc in placement.placement)
    if (workers, world) != (layout.workers, layout.world_size):
        raise ValueError(f"job {job_id}: the placement holds {workers} workers of {world} processes, the rank "
                         f"layout {layout.workers} of {layout.world_size}")
    plans, offset = [], 0
    for node_rank, (shape, node_id, nproc) in enumerate(where):
        plans.append(LaunchPlan(id=launch_id_of(job_id, attempt, node_rank), node_id=node_id, node_rank=node_rank,
                                nnodes=len(where), nproc=nproc, rank_offset=offset, world_size=world, shape=shape))
        offset += nproc
    return tuple(plans)


def placed_layout(layout: RankLayout, placement: policy.Placement, min_workers: int | None) -> RankLayout:
    """The rank layout ``placement`` runs: ``layout`` itself, or for an elastic job (``min_workers``)
    placed with fewer workers, that many workers. Raises ``ValueError`` below ``min_workers``."""
    workers = sum(nproc for _, nproc in placement.placement)
    if workers == layout.workers or min_workers is None:
        return layout
    if not min_workers <= workers <= layout.workers:
        raise ValueError(f"job {placement.job_id}: placed with {workers} workers, outside its elastic range "
                         f"[{min_workers}, {layout.workers}]")
    return dataclasses.replace(layout, workers=workers)


def ranks_to_release(*, rank_offset: int, nproc: int, released: Sequence[int] | None, count: int) -> list[int]:
    """The ``count`` ranks of a launch (ranks ``rank_offset .. rank_offset + nproc - 1``) that
    leave in a shrink: the highest not released yet (so node 0's first rank is the last to go).
    Raises ``ValueError`` when fewer than ``count`` are left."""
    gone = set(released or ())
    left = [rank for rank in range(rank_offset + nproc - 1, rank_offset - 1, -1) if rank not in gone]
    if count > len(left):
        raise ValueError(f"cannot release {count} ranks of ranks {rank_offset}..{rank_offset + nproc - 1}: "
                         f"only {len(left)} are left")
    return sorted(left[:count])


class AttemptLaunch(Protocol):
    node_rank: int
    nproc: int
    rank_offset: int
    world_size: int


def grow_launches(job_id: str, attempt: int, launches: Sequence[AttemptLaunch], add: Sequence[tuple[str, int]],
                  shape: policy.WorkerShape) -> tuple[LaunchPlan, ...]:
    """The launches that start a grown elastic job's new workers (``add``: (node_id, workers),
    ...) beside its attempt's ``launches`` (all of them, exited ones too; node 0 first): one per
    node, with ranks after every rank the attempt ever used (a joiner's member id is its rank,
    never one a member had), node ranks after the last, and the world size of the attempt's
    first world, so that ``is_joiner`` tells them (their ranks lie past it). ``nnodes`` counts
    every launch of the attempt with them (the others' is updated to it). Raises ``ValueError``
    for an attempt without launches or an empty ``add``."""
    if not launches or not add or any(k < 1 for _, k in add):
        raise ValueError(f"job {job_id}: cannot grow by {list(add)} an attempt with {len(launches)} launches")
    rank = max(x.rank_offset + x.nproc for x in launches)
    node_rank = max(x.node_rank for x in launches) + 1
    world, nnodes = launches[0].world_size, len(launches) + len(add)
    plans = []
    for i, (node_id, nproc) in enumerate(add):
        plans.append(LaunchPlan(id=launch_id_of(job_id, attempt, node_rank + i), node_id=node_id,
                                node_rank=node_rank + i, nnodes=nnodes, nproc=nproc, rank_offset=rank,
                                world_size=world, shape=shape))
        rank += nproc
    return tuple(plans)


def is_joiner(launch: AttemptLaunch) -> bool:
    """Whether ``launch`` starts workers that join a running elastic job (``grow_launches``)."""
    return launch.rank_offset >= launch.world_size


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerEnvironment:
    """What a launch's workers are told beside torchrun's RANK etc.: the job's ``env``, then
    RELAY_STRATEGY and RELAY_CHECKPOINT (JSON), RELAY_JOB_NAME, RELAY_WORKERS (the layout's
    worker ranks), RELAY_ACCELERATOR (``gpu`` or ``cpu``: what was granted, which for
    accelerator "prefer" may be CPUs although GPUs were asked for), RELAY_GPUS_PER_WORKER and,
    with GPUs, RELAY_GPU_TYPE (the node's); RELAY_MIXED_DEVICES=1 for a job of accelerator "any"
    (its ranks may run on different devices: every rank builds a gloo group); RELAY_MEMORY_PER_WORKER
    (bytes of ``resources.memory``, when given: ``prepare`` refuses a training state that cannot fit it)."""

    job_name: str
    layout: RankLayout
    strategy: Strategy
    checkpoint: CheckpointPolicy
    user_env: Mapping[str, str]
    memory_per_worker: int = 0
    gpus_per_worker: int = 0
    gpu_type: str | None = None
    mixed_devices: bool = False

    @classmethod
    def of_spec(cls, spec: JobSpec) -> WorkerEnvironment:
        """The environment of ``spec``'s launches before accelerators are granted."""
        return cls(job_name=spec.name, layout=RankLayout.of_spec(spec), strategy=spec.strategy,
                   checkpoint=spec.checkpoint, user_env=spec.env, memory_per_worker=spec.resources.memory,
                   mixed_devices=spec.resources.accelerator_mode == "any")

    def granted(self, gpus_per_worker: int, node_gpu_type: str | None) -> WorkerEnvironment:
        return dataclasses.replace(self, gpus_per_worker=gpus_per_worker,
                                   gpu_type=node_gpu_type if gpus_per_worker else None)

    @property
    def accelerator(self) -> str:
        return "gpu" if self.gpus_per_worker else "cpu"

    def job_variables(self) -> dict[str, str]:
        """The variables that only depend on the job's spec (the same for each of its launches)."""
        env = dict(self.user_env)
        env["RELAY_STRATEGY"] = json.dumps(self.strategy.model_dump(mode="json"))
        env["RELAY_CHECKPOINT"] = json.dumps(self.checkpoint.model_dump(mode="json", by_alias=True))
        env["RELAY_JOB_NAME"] = self.job_name
        env["RELAY_WORKERS"] = str(self.layout.workers)
        if self.mixed_devices:
            env["RELAY_MIXED_DEVICES"] = "1"
        if self.memory_per_worker:
            env["RELAY_MEMORY_PER_WORKER"] = str(self.memory_per_worker)
        return env

    def variables(self, job_variables: Mapping[str, str] | None = None) -> dict[str, str]:
        """Every variable; ``job_variables``: ``self.job_variables()`` computed before (kept per job)."""
        env = dict(self.job_variables() if job_variables is None else job_variables)
        env["RELAY_ACCELERATOR"] = self.accelerator
        env["RELAY_GPUS_PER_WORKER"] = str(self.gpus_per_worker)
        if self.gpu_type:
            env["RELAY_GPU_TYPE"] = self.gpu_type
        return env


class AssignedLaunch(Protocol):
    """The launch columns an assignment is built from (the rows ``rows.py`` reads have them)."""

    id: str
    job_seq: int
    attempt: int
    node_rank: int
    nnodes: int
    nproc: int
    rank_offset: int
    world_size: int
    desired: str
    stop_reason: str | None
    stop_grace_s: float | None
    bundle: str | None
    cpu: float
    memory: int
    # and optionally ``released``: an elastic launch's ranks asked to leave (a shrink)


def mpi_world(plans: tuple[LaunchPlan, ...]) -> dict:
    """The MPI world an mpirun job's node 0 starts with (``wire.MpiWorld`` as stored): its
    slots, processes per node by node rank; no daemon handed over yet."""
    return {"slots": [plan.nproc for plan in plans], "daemons": {}}


def with_daemons(world: dict | None, daemons: Mapping[int, str]) -> dict | None:
    """``world`` (an mpirun job's, as stored) with the daemons node 0 handed over added; None
    for a job that has no MPI world (a report that names daemons changes nothing then)."""
    if world is None:
        return None
    return {**world, "daemons": {**world.get("daemons", {}), **{str(k): v for k, v in daemons.items()}}}


def launch_assignment(launch: AssignedLaunch, *, job_id: str, argv: list[str], env: dict[str, str],
                      spec_stop_grace_s: float, master: tuple, store_url: str,
                      store_options: Mapping[str, str] | None = None, launcher: str = "torchrun") -> LaunchAssignment:
    """``launch`` as its agent is told of it. ``master``: the address of the attempt's node 0,
    the port it reported (None until then) and, for an mpirun job, its MPI world (as stored);
    ``stop_grace_s`` is the launch's own when a stop set one (``relay cancel --no-checkpoint``:
    0), else the spec's. ``store_options``: the store's public options
    (``ArtifactStore.public_options``: never a credential). A joiner's workers (``is_joiner``)
    get ``RELAY_ELASTIC_JOIN=1``: ``ElasticGroup.from_env`` joins the running group."""
    world = master[2] if len(master) > 2 else None
    if is_joiner(launch):
        env = {**env, JOIN_VAR: "1"}
    return LaunchAssignment(
        launch_id=launch.id, job_id=job_id, attempt=launch.attempt, desired=launch.desired,  # type: ignore[arg-type]
        stop_reason=launch.stop_reason,
        stop_grace_s=spec_stop_grace_s if launch.stop_grace_s is None else launch.stop_grace_s,
        node_rank=launch.node_rank, nnodes=launch.nnodes, nproc_per_node=launch.nproc,
        world_size=launch.world_size, rank_offset=launch.rank_offset, master_addr=master[0], master_port=master[1],
        entrypoint=argv, bundle=launch.bundle, env=env, store_url=store_url, store_options=dict(store_options or {}),
        job_store_prefix=ArtifactStore.job_prefix(job_id), cpu=launch.cpu, memory=launch.memory,
        launcher=launcher,  # type: ignore[arg-type]
        released_ranks=list(getattr(launch, "released", None) or ()),  # (a Slurm attempt's launch has none)
        mpi=MpiWorld.model_validate(world) if launcher == "mpirun" and world is not None else None)
