"""An event-driven cluster simulator for a scheduling policy. Pure: simulated time, no I/O.

Contract:
- ``simulate(nodes, trace, policy)`` replays ``trace`` (jobs with a submit time and a true run
  time) on ``nodes``: at every arrival or completion it runs one cycle of ``policy``
  (``schedule`` or ``fifo.schedule_fifo``), starts what it places, and stops and requeues what
  it preempts (no grace period; a victim keeps the work done so far, as a checkpointed job
  would, and keeps its place in submit order), then runs another cycle at the same instant.
- It checks, after every cycle, that no node is over-committed and raises ``AssertionError``
  naming the node if one is: a policy bug, never a property of the trace.
- ``mixed_cluster`` and ``mixed_trace`` build seeded random clusters and workloads (CPU and
  GPU nodes of two types; gangs of 1 to 16 workers; several users and priorities; most jobs
  with a declared max runtime) for the tests and the benchmark.
- Returns ``SimResult`` with each job's start and end, its wait (first start − submit), and the
  cluster's utilisation (busy cpu-seconds and gpu-seconds over capacity × makespan, averaged
  over the kinds the cluster has). Jobs the policy calls ``unschedulable`` are dropped and
  listed in ``SimResult.unschedulable``. Raises ``RuntimeError`` if jobs remain that never start
  although nothing runs (the policy stalled), or after ``max_cycles`` cycles.
"""
from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from torchrelay.scheduler.types import (Allocation, Decisions, NodeView, QueuedJob, Quota,
                                        SchedulerInput)


@dataclass(frozen=True, slots=True)
class TraceJob:
    job: QueuedJob
    submit_time: float
    duration: float  # true run time; at most job.max_runtime_s when that is declared


@dataclass(slots=True)
class SimResult:
    start: dict[str, float] = field(default_factory=dict)  # first start
    end: dict[str, float] = field(default_factory=dict)
    wait: dict[str, float] = field(default_factory=dict)
    preemptions: int = 0
    unschedulable: list[str] = field(default_factory=list)  # dropped: could never run
    cycles: int = 0
    utilisation: float = 0.0
    makespan: float = 0.0

    @property
    def mean_wait(self) -> float:
        return sum(self.wait.values()) / len(self.wait) if self.wait else 0.0


def simulate(nodes: tuple[NodeView, ...], trace: list[TraceJob],
             policy: Callable[[SchedulerInput], Decisions], *,
             quotas: tuple[tuple[str, Quota], ...] = (), max_cycles: int = 1_000_000,
             on_cycle: Callable[[SchedulerInput, Decisions], None] | None = None) -> SimResult:
    """Replay ``trace`` under ``policy`` (see module contract)."""
    if not trace:
        return SimResult()
    by_id = {t.job.job_id: t for t in trace}
    events: list[tuple[float, int, str, str]] = []  # (time, kind: 0 end / 1 arrival, job, token)
    for t in trace:
        heapq.heappush(events, (t.submit_time, 1, t.job.job_id, ""))
    queue: dict[str, QueuedJob] = {}
    running: dict[str, Allocation] = {}
    remaining = {t.job.job_id: t.duration for t in trace}
    token: dict[str, str] = {}  # which start an end event belongs to (a preempted run's end is stale)
    result = SimResult()
    capacity = {n.id: (n.cpus, n.gpus, n.memory) for n in nodes}
    busy = [0.0, 0.0]
    while events:
        now = events[0][0]
        while events and events[0][0] == now:
            _, kind, job_id, tok = heapq.heappop(events)
            if kind == 1:
                queue[job_id] = by_id[job_id].job
            elif token.get(job_id) == tok and job_id in running:
                _add_busy(busy, running.pop(job_id), now)
                result.end[job_id] = now
        while True:
            inp = SchedulerInput(nodes=nodes, running=tuple(running.values()), queue=tuple(queue.values()),
                                 now=now, quotas=quotas)
            decisions = policy(inp)
            result.cycles += 1
            if result.cycles > max_cycles:
                raise RuntimeError(f"simulation exceeded max_cycles={max_cycles}")
            if on_cycle is not None:
                on_cycle(inp, decisions)
            for job_id, reason in decisions.waiting.items():
                if reason.startswith("unschedulable"):  # the cluster never changes here: drop it
                    result.unschedulable.append(queue.pop(job_id).job_id)
            for victim in decisions.preemptions:
                alloc = running.pop(victim)
                remaining[victim] -= now - alloc.started_at
                _add_busy(busy, alloc, now)
                queue[victim] = by_id[victim].job
                result.preemptions += 1
                token[victim] = ""
            for placement in decisions.placements:
                job = queue.pop(placement.job_id)
                alloc = Allocation(job.job_id, job.user, job.priority, placement.shape, placement.placement,
                                   preemptible=job.preemptible, started_at=now,
                                   max_runtime_s=job.max_runtime_s, roles=placement.roles,
                                   on_cpu=placement.on_cpu)
                running[job.job_id] = alloc
                result.start.setdefault(job.job_id, now)
                tok = f"{job.job_id}@{now}"
                token[job.job_id] = tok
                heapq.heappush(events, (now + remaining[job.job_id], 0, job.job_id, tok))
            _check_not_overcommitted(capacity, running)
            if not decisions.preemptions:
                break
        if not events and queue:
            raise RuntimeError(f"policy stalled with {len(queue)} jobs queued and {len(running)} running, "
                               f"e.g. {sorted(queue)[:5]}")
    _account(result, trace, nodes, busy)
    return result


def _parts(alloc: Allocation):
    """(shape, placement) of the workers (GPU and CPU ones apart) and of each role of ``alloc``."""
    return alloc.parts()


def _add_busy(busy: list[float], alloc: Allocation, now: float) -> None:
    for shape, placement in _parts(alloc):
        processes = sum(w for _, w in placement)
        busy[0] += (now - alloc.started_at) * processes * shape.cpu
        busy[1] += (now - alloc.started_at) * processes * shape.gpu


def _check_not_overcommitted(capacity: dict[str, tuple[float, int, int]], running: dict[str, Allocation]) -> None:
    used: dict[str, list[float]] = {n: [0.0, 0.0, 0.0] for n in capacity}
    for alloc in running.values():
        for shape, placement in _parts(alloc):
            for node_id, workers in placement:
                u = used[node_id]
                u[0] += shape.cpu * workers
                u[1] += shape.gpu * workers
                u[2] += shape.memory * workers
    for node_id, (cpus, gpus, memory) in capacity.items():
        u = used[node_id]
        if u[0] > cpus + 1e-6 or u[1] > gpus or u[2] > memory:
            raise AssertionError(f"node {node_id!r} over-committed: uses cpus={u[0]:g}/{cpus:g}, "
                                 f"gpus={u[1]:g}/{gpus}, memory={u[2]:g}/{memory}")


def _account(result: SimResult, trace: list[TraceJob], nodes: tuple[NodeView, ...], busy: list[float]) -> None:
    for t in trace:
        if t.job.job_id in result.start:
            result.wait[t.job.job_id] = result.start[t.job.job_id] - t.submit_time
    if not result.end:
        return
    result.makespan = max(result.end.values()) - min(t.submit_time for t in trace)
    capacities = (sum(n.cpus for n in nodes), sum(n.gpus for n in nodes))
    shares = [b / (c * result.makespan) for b, c in zip(busy, capacities) if c > 0]
    result.utilisation = sum(shares) / len(shares) if shares and result.makespan > 0 else 0.0


def mixed_cluster(rng: random.Random, size: int) -> tuple[NodeView, ...]:
    """``size`` nodes: about 60% CPU (16/32/64 cpus), 25% a100 ×4, 15% h100 ×8."""
    nodes = []
    for i in range(size):
        roll = rng.random()
        if roll < 0.6:
            cpus = rng.choice((16, 32, 64))
            nodes.append(NodeView(f"cpu-{i:05d}", cpus, 0, cpus * (4 << 30), labels=(("zone", rng.choice("ab")),)))
        elif roll < 0.85:
            nodes.append(NodeView(f"a100-{i:05d}", 32, 4, 256 << 30, gpu_type="a100",
                                  labels=(("zone", rng.choice("ab")),)))
        else:
            nodes.append(NodeView(f"h100-{i:05d}", 64, 8, 512 << 30, gpu_type="h100",
                                  labels=(("zone", rng.choice("ab")),)))
    return tuple(nodes)


def random_job(rng: random.Random, seq: int, users: int, *, priorities: tuple[int, ...] = (0, 0, 0, 1, 5),
               max_gang: int = 16) -> QueuedJob:
    """One job of a mixed workload (see ``mixed_trace``)."""
    from torchrelay.scheduler.types import WorkerShape

    kind = rng.random()
    workers = rng.choice([1, 1, 1, 2, 2, 4, 4, 8, 16][: max(1, min(9, max_gang.bit_length() + 4))])
    workers = min(workers, max_gang)
    if kind < 0.55:
        shape = WorkerShape(cpu=rng.choice((1, 2, 4)), memory=rng.choice((1, 2, 4)) << 30)
    elif kind < 0.75:
        shape = WorkerShape(cpu=4, gpu=1, memory=16 << 30, accelerator="required")
    elif kind < 0.85:
        shape = WorkerShape(cpu=8, gpu=rng.choice((1, 2)), memory=32 << 30, gpu_type=rng.choice(("a100", "h100")))
    else:
        shape = WorkerShape(cpu=2, memory=8 << 30, accelerator="prefer")
    per_node = None
    if workers >= 4 and rng.random() < 0.3:
        per_node = workers // 2
    labels = (("zone", "a"),) if rng.random() < 0.1 else ()
    return QueuedJob(f"j{seq:06d}", f"u{rng.randrange(users)}", rng.choice(priorities), seq, workers, shape,
                     workers_per_node=per_node, nodes=2 if per_node else None, labels=labels,
                     preemptible=rng.random() < 0.8,
                     max_runtime_s=rng.choice((60.0, 300.0, 900.0, 3600.0)) if rng.random() < 0.85 else None)


def mixed_trace(rng: random.Random, jobs: int, users: int, *, mean_gap_s: float,
                priorities: tuple[int, ...] = (0, 0, 0, 1, 5), max_gang: int = 16) -> list[TraceJob]:
    """``jobs`` arrivals (exponential gaps of mean ``mean_gap_s``); true run time between 20%
    and 100% of the declared max runtime (or 60-3600 s when none is declared)."""
    trace, clock = [], 0.0
    for seq in range(jobs):
        clock += rng.expovariate(1.0 / mean_gap_s) if mean_gap_s > 0 else 0.0
        job = random_job(rng, seq, users, priorities=priorities, max_gang=max_gang)
        limit = job.max_runtime_s or rng.choice((60.0, 300.0, 900.0, 3600.0))
        trace.append(TraceJob(job, round(clock, 3), round(limit * rng.uniform(0.2, 1.0), 3)))
    return trace
