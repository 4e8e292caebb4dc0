"""Properties of the scheduling policy over random clusters, running jobs and queues (hypothesis),
and over simulated traces: nothing over-committed, gangs whole (with every role of a job that has
roles besides its workers), quotas kept (counting all roles), only lower-priority preemptible
victims, every job accounted for, determinism, and no job waiting forever."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from torchrelay.scheduler import (Allocation, NodeView, QueuedJob, Quota, SchedulerInput, WorkerShape,
                                  fits_ever, schedule)
from torchrelay.scheduler.simulate import TraceJob, simulate

pytestmark = pytest.mark.timeout(120)

REASONS = {"resources", "gang", "quota", "priority", "reservation", "unschedulable"}
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
THOROUGH = settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def nodes_st(draw):
    count = draw(st.integers(1, 5))
    nodes = []
    for i in range(count):
        gpus = draw(st.sampled_from([0, 0, 2, 4]))
        nodes.append(NodeView(
            f"n{i}", draw(st.sampled_from([2, 4, 8])), gpus, draw(st.sampled_from([8, 16])),
            gpu_type=draw(st.sampled_from(["a100", "h100"])) if gpus else None,
            labels=(("zone", draw(st.sampled_from("ab"))),), ready=draw(st.booleans() | st.just(True))))
    return tuple(nodes)


@st.composite
def job_st(draw, job_id: str, seq: int):
    accel = draw(st.sampled_from(["none", "none", "none", "required", "prefer"]))
    gpu = draw(st.sampled_from([0, 0, 1, 2])) if accel == "none" else draw(st.sampled_from([0, 1]))
    gpu_type = draw(st.sampled_from([None, None, "a100", "h100"])) if gpu or accel != "none" else None
    shape = WorkerShape(cpu=draw(st.sampled_from([0.5, 1, 2])), gpu=gpu, memory=draw(st.sampled_from([0, 1, 4])),
                        gpu_type=gpu_type, accelerator=accel)
    workers = draw(st.integers(1, 6))
    per_node = None
    if workers % 2 == 0 and draw(st.booleans()):
        per_node = workers // 2
    roles = ()
    if draw(st.sampled_from([False, False, True])):  # a parameter-server-like job: servers need no gpu
        roles = tuple((name, draw(st.integers(1, 3)), role_shape)
                      for name, role_shape in [("server", WorkerShape(cpu=draw(st.sampled_from([0.5, 1, 2])),
                                                                      memory=draw(st.sampled_from([0, 1, 4]))))]
                      + ([("helper", WorkerShape(cpu=1, gpu=1, accelerator="required"))]
                         if draw(st.sampled_from([False, False, True])) else []))
    return QueuedJob(job_id, draw(st.sampled_from(["u0", "u1", "u2"])), draw(st.sampled_from([0, 0, 1, 3])), seq,
                     workers, shape, workers_per_node=per_node, nodes=2 if per_node else None,
                     labels=draw(st.sampled_from([(), (), (("zone", "a"),)])),
                     preemptible=draw(st.booleans()),
                     max_runtime_s=draw(st.sampled_from([None, 10.0, 50.0, 200.0])), roles=roles)


@st.composite
def inputs_st(draw):
    nodes = draw(nodes_st())
    # running jobs: whatever the policy places from a first queue, so they are valid by construction
    first = [draw(job_st(f"r{i}", i)) for i in range(draw(st.integers(0, 8)))]
    first_decisions = schedule(SchedulerInput(nodes, (), tuple(first)))
    by_id = {j.job_id: j for j in first}
    running = tuple(
        Allocation(p.job_id, by_id[p.job_id].user, by_id[p.job_id].priority, p.shape, p.placement,
                   preemptible=by_id[p.job_id].preemptible, started_at=draw(st.sampled_from([0.0, 20.0, 40.0])),
                   max_runtime_s=by_id[p.job_id].max_runtime_s,
                   preempting=draw(st.sampled_from([False, False, True])), roles=p.roles)
        for p in first_decisions.placements)
    queue = tuple(draw(job_st(f"q{i}", 100 + i)) for i in range(draw(st.integers(0, 10))))
    quotas = tuple((user, Quota(cpus=draw(st.sampled_from([None, 2, 6])), gpus=draw(st.sampled_from([None, 0, 2])),
                                jobs=draw(st.sampled_from([None, 1, 3]))))
                   for user in ("u0", "u1") if draw(st.booleans()))
    return SchedulerInput(nodes, running, queue, now=50.0, quotas=quotas)


def _use(shape: WorkerShape, workers: int) -> list[float]:
    return [shape.cpu * workers, shape.gpu * workers, shape.memory * workers]


def _parts(held) -> list[tuple[WorkerShape, tuple]]:
    """(shape, placement) of the workers and of every role of an Allocation or a Placement."""
    return [(held.shape, held.placement)] + [(shape, where) for _, shape, where in held.roles]


def check_decisions(inp: SchedulerInput) -> None:
    d = schedule(inp)
    nodes = {n.id: n for n in inp.nodes}
    queued = {j.job_id: j for j in inp.queue}
    run = {a.job_id: a for a in inp.running}
    placed = {p.job_id: p for p in d.placements}

    # every queued job: placed, or waiting with a known reason; order lists each once
    assert sorted(d.order) == sorted(queued)
    assert set(placed).isdisjoint(d.waiting) and set(placed) | set(d.waiting) == set(queued)
    assert all(r.split(":", 1)[0] in REASONS for r in d.waiting.values()), d.waiting

    # no node over-committed, counting running jobs (victims still run through their grace period)
    used = {n: [0.0, 0.0, 0.0] for n in nodes}
    for alloc in inp.running:
        for shape, where in _parts(alloc):
            for node_id, workers in where:
                used[node_id] = [a + b for a, b in zip(used[node_id], _use(shape, workers))]
    for p in d.placements:
        job = queued[p.job_id]
        # gang: all workers, distinct ready nodes, the requested form and resources, eligible nodes
        assert sum(w for _, w in p.placement) == job.workers
        assert len({n for n, _ in p.placement}) == len(p.placement)
        if job.workers_per_node:
            assert [w for _, w in p.placement] == [job.workers_per_node] * job.nodes
        assert (p.shape.cpu, p.shape.memory) == (job.shape.cpu, job.shape.memory)
        if job.shape.accelerator == "prefer":
            assert p.shape.gpu in (0, max(1, job.shape.gpu))
        elif job.shape.gpu or job.shape.accelerator == "required":
            assert p.shape.gpu == max(1, job.shape.gpu)
        if job.shape.gpu_type and p.shape.gpu:
            assert p.shape.gpu_type == job.shape.gpu_type
        for node_id, workers in p.placement:
            node = nodes[node_id]
            assert node.ready
            assert all(dict(node.labels).get(k) == v for k, v in job.labels)
            if p.shape.gpu:
                assert node.gpu_type == p.shape.gpu_type
            used[node_id] = [a + b for a, b in zip(used[node_id], _use(p.shape, workers))]
        # every role of the job, placed with it: all its processes, eligible ready nodes, no gpu
        # unless the role asked for one
        assert [name for name, _, _ in p.roles] == [name for name, _, _ in job.roles]
        for (_, count, asked), (_, granted, where) in zip(job.roles, p.roles):
            assert sum(n for _, n in where) == count and len({n for n, _ in where}) == len(where)
            assert (granted.cpu, granted.memory) == (asked.cpu, asked.memory)
            wants_gpu = asked.gpu or asked.accelerator == "required"
            assert granted.gpu == (max(1, asked.gpu) if wants_gpu else 0)
            for node_id, count_here in where:
                node = nodes[node_id]
                assert node.ready and all(dict(node.labels).get(k) == v for k, v in job.labels)
                if granted.gpu:
                    assert node.gpu_type == granted.gpu_type
                used[node_id] = [a + b for a, b in zip(used[node_id], _use(granted, count_here))]
    for node_id, (cpus, gpus, memory) in used.items():
        node = nodes[node_id]
        assert cpus <= node.cpus + 1e-9 and gpus <= node.gpus and memory <= node.memory, (node_id, used)

    # quotas: a user within quota before the cycle is within it after
    for user, quota in inp.quotas:
        def totals(allocs):
            cpus = sum(shape.cpu * sum(w for _, w in where) for a in allocs for shape, where in _parts(a))
            gpus = sum(shape.gpu * sum(w for _, w in where) for a in allocs for shape, where in _parts(a))
            return cpus, gpus, len(allocs)
        before = [a for a in inp.running if a.user == user]
        after = before + [p for p in d.placements if queued[p.job_id].user == user]
        if len(after) == len(before):
            continue
        cpus, gpus, jobs = totals(after)
        assert quota.cpus is None or cpus <= quota.cpus + 1e-9
        assert quota.gpus is None or gpus <= quota.gpus
        assert quota.jobs is None or jobs <= quota.jobs

    # preemption: only running, preemptible, not already stopping, and lower than the job it serves
    for victim in d.preemptions:
        alloc = run[victim]
        assert alloc.preemptible and not alloc.preempting
        served = [queued[j] for j, r in d.waiting.items() if "preempting" in r and victim in r.split(";")[0]]
        assert served and all(alloc.priority < j.priority for j in served)
    assert len(set(d.preemptions)) == len(d.preemptions)

    # unschedulable means exactly: it would not fit the empty cluster
    for job_id, r in d.waiting.items():
        assert r.startswith("unschedulable") == (not fits_ever(queued[job_id], inp.nodes))

    # determinism, whatever the order of the input's tuples
    rng = random.Random(len(inp.queue))
    shuffled = SchedulerInput(tuple(rng.sample(inp.nodes, len(inp.nodes))),
                              tuple(rng.sample(inp.running, len(inp.running))),
                              tuple(rng.sample(inp.queue, len(inp.queue))), now=inp.now,
                              quotas=tuple(reversed(inp.quotas)))
    again = schedule(shuffled)
    assert sorted(again.placements, key=lambda p: p.job_id) == sorted(d.placements, key=lambda p: p.job_id)
    assert (again.preemptions, again.waiting, again.estimated_start, again.order) == \
        (d.preemptions, d.waiting, d.estimated_start, d.order)


@FAST
@given(inputs_st())
def test_decisions_keep_every_invariant(inp):
    check_decisions(inp)


@pytest.mark.slow
@THOROUGH
@given(inputs_st())
def test_decisions_keep_every_invariant_thoroughly(inp):
    check_decisions(inp)


# ---------------------------------------------------------------- simulated traces

@st.composite
def trace_st(draw, max_jobs: int):
    nodes = draw(nodes_st())
    nodes = tuple(NodeView(n.id, n.cpus, n.gpus, n.memory, n.gpu_type, n.labels, True) for n in nodes)
    trace, clock = [], 0.0
    for i in range(draw(st.integers(1, max_jobs))):
        clock += draw(st.sampled_from([0.0, 0.0, 5.0, 30.0]))
        job = draw(job_st(f"t{i:03d}", i))
        duration = draw(st.sampled_from([5.0, 20.0, 60.0]))
        if job.max_runtime_s is not None:
            job = replace(job, max_runtime_s=max(job.max_runtime_s, duration))
        trace.append(TraceJob(job, clock, duration))
    return nodes, trace


def check_trace(nodes, trace) -> None:
    result = simulate(nodes, trace, schedule)  # raises on over-commitment or a stall
    never = {t.job.job_id for t in trace if not fits_ever(t.job, nodes)}
    assert set(result.unschedulable) == never
    # everything else started and ended; no wait exceeds running the whole trace one job at a time
    bound = max(t.submit_time for t in trace) + sum(t.duration for t in trace)
    for t in trace:
        if t.job.job_id not in never:
            assert t.job.job_id in result.end
            assert result.wait[t.job.job_id] <= bound, (t.job.job_id, result.wait[t.job.job_id], bound)


@FAST
@given(trace_st(max_jobs=14))
def test_under_fair_share_every_job_that_fits_runs_and_waits_a_bounded_time(case):
    check_trace(*case)


@pytest.mark.slow
@THOROUGH
@given(trace_st(max_jobs=40))
def test_under_fair_share_every_job_runs_thoroughly(case):
    check_trace(*case)


def test_a_big_job_is_not_starved_by_a_stream_of_small_ones_from_other_users():
    # one user's 4-worker job against a steady stream of 1-worker jobs that could always backfill
    nodes = (NodeView("a", 4, 0, 16),)
    trace = [TraceJob(QueuedJob("big", "alice", 0, 0, 4, WorkerShape(cpu=1), max_runtime_s=100.0), 1.0, 50.0)]
    trace += [TraceJob(QueuedJob(f"s{i:03d}", f"u{i % 3}", 0, i + 1, 1, WorkerShape(cpu=1), max_runtime_s=40.0),
                       float(i * 10), 40.0) for i in range(60)]
    result = simulate(nodes, trace, schedule)
    assert result.start["big"] <= 60.0  # the reservation lets only jobs that end by then pass it
    assert len(result.end) == len(trace)
