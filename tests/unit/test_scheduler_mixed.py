"""Mixed-device jobs (accelerator "any"): one gang over GPU nodes (GPU ranks, ``gpu`` GPUs each)
and nodes without GPUs (CPU ranks, no GPU), case by case and as properties over random clusters:
the per-node rule, nothing over-committed, fit checks (index, scan, placement) agreeing, quotas
kept, and the running allocation rebuilt from ``on_cpu`` holding what was placed."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from torchrelay.scheduler import (Allocation, NodeView, QueuedJob, Quota, SchedulerInput, WorkerShape,
                                  fits_ever, job_problem, schedule)
from torchrelay.scheduler.cluster import Cluster, alternatives
from torchrelay.scheduler.fifo import schedule_fifo
from torchrelay.scheduler.fitindex import FitIndex
from torchrelay.scheduler.placement import feasible, place_best, use_of
from torchrelay.scheduler.types import shape_on

pytestmark = pytest.mark.timeout(120)

GiB = 1 << 30
ANY = WorkerShape(cpu=1, accelerator="any")


def cpu_node(name, cpus, **kw):
    return NodeView(name, cpus, 0, 64 * GiB, **kw)


def gpu_node(name, gpus, gpu_type, cpus=8, **kw):
    return NodeView(name, cpus, gpus, 64 * GiB, gpu_type=gpu_type, **kw)


def decide(nodes, queue, run=(), quotas=()):
    return schedule(SchedulerInput(tuple(nodes), tuple(run), tuple(queue), quotas=tuple(quotas)))


def job(job_id, workers, shape=ANY, user="alice", seq=1, **kw):
    return QueuedJob(job_id, user, 0, seq, workers, shape, **kw)


NODES = [gpu_node("g1", 2, "a100"), gpu_node("h1", 4, "h100"), cpu_node("c1", 4), cpu_node("c2", 2)]


@pytest.mark.parametrize("workers, shape, placement, on_cpu, granted", [
    # the usual rules (fewest nodes, then the tightest fit): c1 is filled exactly, h1 would not be;
    # a mixed job does not seek GPUs over CPUs
    (4, ANY, (("c1", 4),), ("c1",), ("a100", 1)),
    # more workers than one node holds: GPU and CPU ranks in one gang, on the h100 node
    (8, ANY, (("c1", 4), ("h1", 4)), ("c1",), ("h100", 1)),
    (10, ANY, (("c1", 4), ("h1", 4), ("c2", 2)), ("c1", "c2"), ("h100", 1)),
    # a100 asked for: the h100 node is not eligible (a gang never mixes GPU types), CPU nodes are
    (7, WorkerShape(cpu=1, gpu_type="a100", accelerator="any"), (("c1", 4), ("c2", 2), ("g1", 1)), ("c1", "c2"),
     ("a100", 1)),
    # 2 GPUs per GPU rank: h1 holds 2 of them; CPU ranks take none
    (8, WorkerShape(cpu=1, gpu=2, accelerator="any"), (("c1", 4), ("c2", 2), ("h1", 2)), ("c1", "c2"), ("h100", 2)),
    # 4 cpus per worker: c1 holds one, g1 two (its cpus, not its GPUs, bound it)
    (3, WorkerShape(cpu=4, accelerator="any"), (("g1", 2), ("c1", 1)), ("c1",), ("a100", 1)),
])
def test_mixed_gang_spreads_over_gpu_and_cpu_nodes(workers, shape, placement, on_cpu, granted):
    d = decide(NODES, [job("j", workers, shape)])
    (p,) = d.placements
    assert p.placement == placement
    assert p.on_cpu == on_cpu
    assert (p.shape.gpu_type, p.shape.gpu, p.shape.accelerator) == (*granted, "any")
    for node_id, _ in p.placement:
        assert p.shape_on(node_id).gpu == (0 if node_id in on_cpu else granted[1])
    assert schedule_fifo(SchedulerInput(tuple(NODES), (), (job("j", workers, shape),))).placements == (p,)


def test_a_gpu_node_whose_gpus_are_taken_holds_no_mixed_worker():
    # the rule is per node, not per free resource: a worker on a GPU node always takes a GPU there
    run = [Allocation("r", "bob", 0, WorkerShape(cpu=1, gpu=1, gpu_type="h100"), (("h1", 4),))]
    d = decide(NODES, [job("j", 7, WorkerShape(cpu=1, gpu_type="h100", accelerator="any"))], run)
    assert d.waiting["j"].startswith("gang")  # 6 cpus on c1 + c2; h1's cpus are free but its gpus are not
    d = decide(NODES, [job("j", 6, WorkerShape(cpu=1, gpu_type="h100", accelerator="any"))], run)
    assert d.placements[0].placement == (("c1", 4), ("c2", 2)) and d.placements[0].on_cpu == ("c1", "c2")


def test_cpu_only_cluster_runs_a_mixed_job_on_cpus():
    nodes = [cpu_node("a", 2), cpu_node("b", 2)]
    (p,) = decide(nodes, [job("j", 3)]).placements
    assert p.placement == (("a", 2), ("b", 1)) and p.on_cpu == ("a", "b")
    assert [shape_on(p.shape, True).gpu for _ in p.placement] == [0, 0]


def test_a_running_mixed_job_holds_gpus_only_on_its_gpu_nodes():
    # j holds 1 GPU on g1 and 2 cpus on c2: k (2 GPU workers of a100) must wait, a CPU job fits c1
    held = Allocation("j", "bob", 0, WorkerShape(cpu=1, gpu=1, gpu_type="a100", accelerator="any"),
                      (("g1", 1), ("c2", 2)), on_cpu=("c2",))
    d = decide(NODES, [job("k", 2, WorkerShape(cpu=1, gpu=1, gpu_type="a100")),
                       job("m", 4, WorkerShape(cpu=1), seq=2)], [held])
    assert d.waiting["k"].startswith("gang")  # one GPU of g1 is free, not two
    assert {p.job_id: p.placement for p in d.placements}["m"] == (("c1", 4),)


def test_quota_counts_a_mixed_job_as_if_every_worker_took_gpus():
    # the quota is checked before the placement decides where each worker runs
    d = decide(NODES, [job("j", 3)], quotas=[("alice", Quota(gpus=2))])
    assert d.waiting["j"].startswith("quota")
    d = decide(NODES, [job("j", 2)], quotas=[("alice", Quota(gpus=2))])
    assert d.placements


def test_unschedulable_and_fits_ever():
    assert not fits_ever(job("j", 13), tuple(NODES))   # 6 h100 + cpu nodes hold 10 at most
    assert fits_ever(job("j", 10), tuple(NODES))
    assert decide(NODES, [job("j", 13)]).waiting["j"].startswith("unschedulable")
    assert job_problem(job("j", 2, WorkerShape(cpu=1, accelerator="gpu"))) is not None


def test_a_role_may_not_be_mixed():
    problem = job_problem(job("j", 2, roles=(("server", 1, WorkerShape(cpu=1, accelerator="any")),)))
    assert problem is not None and "accelerator='any'" in problem


# ---------------------------------------------------------------- properties

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def nodes_st(draw):
    nodes = []
    for i in range(draw(st.integers(1, 6))):
        gpus = draw(st.sampled_from([0, 0, 2, 4]))
        nodes.append(NodeView(f"n{i}", draw(st.sampled_from([2, 4, 8])), gpus, draw(st.sampled_from([8, 16])),
                              gpu_type=draw(st.sampled_from(["a100", "h100"])) if gpus else None,
                              ready=draw(st.booleans() | st.just(True))))
    return tuple(nodes)


@st.composite
def job_st(draw, job_id: str, seq: int):
    accel = draw(st.sampled_from(["any", "any", "none", "required"]))
    gpu = draw(st.sampled_from([0, 1, 2])) if accel != "none" else 0
    shape = WorkerShape(cpu=draw(st.sampled_from([0.5, 1, 2])), gpu=gpu, memory=draw(st.sampled_from([0, 1, 4])),
                        gpu_type=draw(st.sampled_from([None, None, "a100"])) if accel != "none" else None,
                        accelerator=accel)
    workers = draw(st.integers(1, 8))
    per_node = workers // 2 if workers % 2 == 0 and draw(st.booleans()) else None
    # now and then a parameter-server-like role beside mixed workers: placed on what they leave
    roles = (("server", draw(st.integers(1, 2)), WorkerShape(cpu=1)),) if draw(st.sampled_from([0, 0, 1])) else ()
    return QueuedJob(job_id, draw(st.sampled_from(["u0", "u1"])), draw(st.sampled_from([0, 1])), seq, workers,
                     shape, workers_per_node=per_node, nodes=2 if per_node else None,
                     max_runtime_s=draw(st.sampled_from([None, 10.0])), roles=roles)


@st.composite
def inputs_st(draw):
    nodes = draw(nodes_st())
    first = [draw(job_st(f"r{i}", i)) for i in range(draw(st.integers(0, 6)))]
    by_id = {j.job_id: j for j in first}
    running = tuple(Allocation(p.job_id, by_id[p.job_id].user, 0, p.shape, p.placement, roles=p.roles,
                               on_cpu=p.on_cpu, max_runtime_s=by_id[p.job_id].max_runtime_s)
                    for p in schedule(SchedulerInput(nodes, (), tuple(first))).placements)
    queue = tuple(draw(job_st(f"q{i}", 100 + i)) for i in range(draw(st.integers(1, 8))))
    quotas = (("u0", Quota(gpus=draw(st.sampled_from([None, 0, 2])))),) if draw(st.booleans()) else ()
    return SchedulerInput(nodes, running, queue, quotas=quotas)


def _totals(held) -> np.ndarray:
    out = np.zeros(3)
    for shape, where in held.parts():
        out += [shape.cpu * sum(w for _, w in where), shape.gpu * sum(w for _, w in where),
                shape.memory * sum(w for _, w in where)]
    return out


@FAST
@given(inputs_st())
def test_mixed_jobs_never_overcommit_and_follow_the_per_node_rule(inp):
    d = schedule(inp)
    nodes = {n.id: n for n in inp.nodes}
    queued = {j.job_id: j for j in inp.queue}
    used = {n: np.zeros(3) for n in nodes}
    placements = list(d.placements)
    for held in list(inp.running) + placements:
        for shape, where in held.parts():
            for node_id, count in where:
                used[node_id] += [shape.cpu * count, shape.gpu * count, shape.memory * count]
    for node_id, (cpus, gpus, memory) in used.items():
        node = nodes[node_id]
        assert cpus <= node.cpus + 1e-9 and gpus <= node.gpus and memory <= node.memory, (node_id, used)
    for p in placements:
        job = queued[p.job_id]
        assert sum(w for _, w in p.placement) == job.workers
        assert [(name, sum(n for _, n in where)) for name, _, where in p.roles] == [(n, c) for n, c, _ in job.roles]
        if job.shape.accelerator != "any":
            assert p.on_cpu == ()
            continue
        # CPU ranks exactly on the nodes without GPUs; GPU ranks on one GPU type, gpu GPUs each
        assert set(p.on_cpu) == {n for n, _ in p.placement if nodes[n].gpus == 0}
        assert p.shape.gpu == max(1, job.shape.gpu)
        for node_id, _ in p.placement:
            if node_id not in p.on_cpu:
                assert nodes[node_id].gpu_type == p.shape.gpu_type
                assert job.shape.gpu_type in (None, p.shape.gpu_type)
    # a quota is never exceeded by what is placed (mixed jobs count their real GPUs once placed)
    for user, quota in inp.quotas:
        mine = [p for p in placements if queued[p.job_id].user == user]
        held = [a for a in inp.running if a.user == user]
        if mine and quota.gpus is not None:
            assert sum(_totals(x)[1] for x in held + mine) <= quota.gpus
    assert schedule(SchedulerInput(tuple(reversed(inp.nodes)), inp.running, tuple(reversed(inp.queue)),
                                   quotas=inp.quotas)).placements == d.placements


@FAST
@given(nodes_st(), st.integers(1, 12), st.sampled_from([0, 1, 2]), st.sampled_from([None, "a100"]),
       st.lists(st.tuples(st.integers(0, 5), st.integers(0, 4), st.integers(0, 3)), max_size=4))
def test_fit_index_scan_and_placement_agree_for_mixed_jobs(nodes, workers, gpu, gpu_type, taken):
    cluster = Cluster(nodes)
    job = QueuedJob("j", "u", 0, 1, workers, WorkerShape(cpu=1, gpu=gpu, memory=1, gpu_type=gpu_type,
                                                         accelerator="any"))
    tiers = alternatives(job, cluster)
    avail = cluster.total.copy()
    index = FitIndex(cluster, avail, cluster.ready)
    index.fits(tiers, job)  # built before the changes below: they reach it through ``touch``
    for node, cpus, gpus in taken:
        if node < len(cluster):
            avail[node, 0] = max(0.0, avail[node, 0] - cpus)
            avail[node, 1] = max(0.0, avail[node, 1] - gpus)
            index.touch([node])
    choice = place_best(cluster, tiers, job, avail, cluster.ready)
    assert feasible(cluster, tiers, job, avail, cluster.ready) is (choice is not None)
    assert index.fits(tiers, job) is (choice is not None)
    if choice is not None:
        assert place_best(cluster, tiers, job, avail, cluster.ready, index) == choice
        used_nodes, use = use_of(choice, cluster)
        assert (avail[used_nodes] - use >= -1e-6).all()
        assert use[~cluster.has_gpu[used_nodes], 1].sum() == 0  # CPU ranks take no GPU
        assert (use[cluster.has_gpu[used_nodes], 1] > 0).all()  # a rank on a GPU node takes GPUs
    # a view that departs from the index on a few nodes (as the backfill view does): the same answers
    override = {node: [max(0.0, avail[node, 0] - 1), avail[node, 1] // 2, avail[node, 2]]
                for node, _, _ in taken[:2] if node < len(cluster)}
    view = avail.copy()
    for node, row in override.items():
        view[node] = row
    choice = place_best(cluster, tiers, job, view, cluster.ready)
    assert index.fits(tiers, job, override or None) is (choice is not None)
    assert place_best(cluster, tiers, job, view, cluster.ready, index, override or None) == choice


def test_a_mixed_job_with_a_server_role_places_both_and_holds_both_when_running():
    servers = (("server", 1, WorkerShape(cpu=2)),)
    d = decide(NODES, [job("j", 8, roles=servers)])
    (p,) = d.placements
    assert p.placement == (("c1", 4), ("h1", 4)) and p.on_cpu == ("c1",)
    assert p.roles[0][2] == (("c2", 1),)  # the server on what the workers leave, a node without GPUs
    held = Allocation("j", "alice", 0, p.shape, p.placement, roles=p.roles, on_cpu=p.on_cpu)
    # g1 and what is left of c2 are free: 2 GPU workers fit on g1, nothing else on c1 or h1
    d = decide(NODES, [job("k", 3, WorkerShape(cpu=1, gpu=1), seq=2)], [held])
    assert d.waiting["k"].startswith(("gang", "resources"))
    d = decide(NODES, [job("k", 2, WorkerShape(cpu=1, gpu=1), seq=2)], [held])
    assert d.placements[0].placement == (("g1", 2),)


def test_a_placed_mixed_job_is_charged_what_it_takes_roles_included_once():
    # j takes 8 workers × 1 cpu + a 2-cpu server = 10 cpus; with a quota of 12 cpus, k (2 cpus) still fits
    servers = (("server", 1, WorkerShape(cpu=2)),)
    quota = [("alice", Quota(cpus=12))]
    d = decide(NODES, [job("j", 8, roles=servers), job("k", 1, WorkerShape(cpu=2), seq=2)], quotas=quota)
    assert {p.job_id for p in d.placements} == {"j", "k"}, d.waiting
    d = decide(NODES, [job("j", 8, roles=servers), job("k", 1, WorkerShape(cpu=3), seq=2)], quotas=quota)
    assert d.waiting["k"].startswith("quota")
