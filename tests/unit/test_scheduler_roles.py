"""Jobs with roles besides their workers (a parameter-server job's servers: cpu and memory, no
gpu), case by case: where the roles land, all or nothing with the workers, waiting reasons,
quotas, backfill and preemption counting every role; and the fit index agreeing with the
step-by-step placement for such jobs over random clusters."""
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

pytestmark = pytest.mark.timeout(60)

GiB = 1 << 30
GPU_WORKER = WorkerShape(cpu=1, gpu=1, memory=4 * GiB)
SERVER = WorkerShape(cpu=2, memory=8 * GiB)


def gpu_node(name, gpus=4, cpus=8, gpu_type="a100", **kw):
    return NodeView(name, cpus, gpus, 64 * GiB, gpu_type=gpu_type, **kw)


def cpu_node(name, cpus=8, **kw):
    return NodeView(name, cpus, 0, 32 * GiB, **kw)


def ps_job(job_id="ps", workers=4, shape=GPU_WORKER, servers=2, server=SERVER, user="alice", priority=0, **kw):
    return QueuedJob(job_id, user, priority, kw.pop("seq", 1), workers, shape,
                     roles=(("server", servers, server),), **kw)


def cpu_job(job_id, workers, user="bob", priority=0, **kw):
    return QueuedJob(job_id, user, priority, kw.pop("seq", 2), workers, WorkerShape(cpu=1), **kw)


def decide(nodes, queue, run=(), now=0.0, quotas=()):
    return schedule(SchedulerInput(tuple(nodes), tuple(run), tuple(queue), now=now, quotas=tuple(quotas)))


def servers_of(decisions, job_id="ps"):
    (placement,) = [p for p in decisions.placements if p.job_id == job_id]
    (role,) = placement.roles
    return role


def gpus_used(decisions):
    return sum(p.shape.gpu * n for p in decisions.placements for _, n in p.placement) + \
        sum(shape.gpu * n for p in decisions.placements for _, shape, where in p.roles for _, n in where)


# ---------------------------------------------------------------- where the servers land

@pytest.mark.parametrize("nodes, server_nodes", [
    # a CPU node is there: the servers go on it rather than on the GPU nodes' spare cpus
    ([gpu_node("g1"), cpu_node("c1")], {"c1"}),
    # GPU nodes only: the servers take their spare cpus (4 left on g1 after 4 workers)
    ([gpu_node("g1")], {"g1"}),
    # the workers fill g1's gpus and cpus: the servers go to the other GPU node, taking no gpu
    ([gpu_node("g1", cpus=4), gpu_node("g2", gpus=1, cpus=8)], {"g2"}),
])
def test_servers_land_on_cpu_nodes_or_spare_cpus_and_never_take_a_gpu(nodes, server_nodes):
    d = decide(nodes, [ps_job()])
    (p,) = d.placements
    assert sum(n for _, n in p.placement) == 4 and p.shape.gpu == 1
    name, shape, where = servers_of(d)
    assert name == "server" and shape.gpu == 0 and shape.cpu == 2 and shape.memory == 8 * GiB
    assert sum(n for _, n in where) == 2 and {node for node, _ in where} == server_nodes
    assert gpus_used(d) == 4  # the workers' gpus only


def test_a_gpu_left_free_by_the_servers_goes_to_the_next_gpu_job():
    nodes = [gpu_node("g1", gpus=4, cpus=16)]
    d = decide(nodes, [ps_job(workers=3, seq=1), QueuedJob("next", "bob", 0, 2, 1, GPU_WORKER)])
    assert {p.job_id for p in d.placements} == {"ps", "next"}
    assert gpus_used(d) == 4


def test_roles_go_after_the_workers_with_the_same_rules_each_role_in_turn():
    nodes = [cpu_node("a", 4), cpu_node("b", 8), cpu_node("c", 2)]
    job = QueuedJob("j", "u", 0, 1, 4, WorkerShape(cpu=1),
                    roles=(("server", 2, WorkerShape(cpu=2)), ("coordinator", 1, WorkerShape(cpu=2))))
    (p,) = decide(nodes, [job]).placements
    assert p.placement == (("a", 4),)                            # tightest single node
    assert [r[0] for r in p.roles] == ["server", "coordinator"]  # in the job's order
    assert p.roles[0][2] == (("b", 2),)                          # both servers on one node
    assert p.roles[1][2] == (("c", 1),)                          # what is left, tightest


def test_workers_take_their_next_alternative_when_the_roles_do_not_fit_next_to_the_first():
    # any accelerator: the a100 node is the tighter fit for the workers, but then the server
    # (16 GiB) finds no room: a's cpus are gone and h has 8 GiB. On h100 it fits on a.
    nodes = [NodeView("a", 4, 2, 64 * GiB, gpu_type="a100"), NodeView("h", 4, 4, 8 * GiB, gpu_type="h100")]
    shape = WorkerShape(cpu=2, gpu=1)
    job = ps_job(workers=2, shape=shape, servers=1, server=WorkerShape(cpu=4, memory=16 * GiB))
    (p,) = decide(nodes, [job]).placements
    assert p.placement == (("h", 2),) and p.shape.gpu_type == "h100"
    assert p.roles[0][2] == (("a", 1),)
    # without the server the a100 node is the choice
    (bare,) = decide(nodes, [QueuedJob("b", "u", 0, 1, 2, shape)]).placements
    assert bare.placement == (("a", 2),)


def test_roles_respect_labels_and_readiness():
    nodes = [gpu_node("g", cpus=4, labels=(("zone", "a"),)), cpu_node("c1", labels=(("zone", "b"),)),
             cpu_node("c2", labels=(("zone", "a"),), ready=False), cpu_node("c3", labels=(("zone", "a"),))]
    d = decide(nodes, [ps_job(labels=(("zone", "a"),))])
    assert servers_of(d)[2] == (("c3", 2),)


# ---------------------------------------------------------------- waiting

def test_a_job_whose_servers_do_not_fit_now_waits_with_a_reason_naming_them():
    nodes = [gpu_node("g1", cpus=7), cpu_node("c1", 4)]  # g1: 3 cpus left next to the workers
    run = [Allocation("r", "bob", 0, WorkerShape(cpu=1), (("c1", 4),), max_runtime_s=100.0)]
    d = decide(nodes, [ps_job(server=WorkerShape(cpu=3))], run, now=10.0)
    assert d.placements == ()
    reason = d.waiting["ps"]
    assert reason.startswith("gang:") and "4 workers would fit now" in reason and "server ×2 (3 cpu each)" in reason
    assert d.estimated_start["ps"] == 100.0  # the servers fit on c1 once r has ended


def test_a_job_whose_servers_never_fit_is_unschedulable_naming_them():
    nodes = [gpu_node("g1", cpus=4)]  # the workers take all 4 cpus
    job = ps_job(servers=1, server=WorkerShape(cpu=1))
    d = decide(nodes, [job])
    assert d.waiting["ps"].startswith("unschedulable:") and "server ×1" in d.waiting["ps"]
    assert not fits_ever(job, tuple(nodes))
    assert fits_ever(ps_job(workers=3, servers=1, server=WorkerShape(cpu=1)), tuple(nodes))


def test_running_roles_hold_their_resources():
    run = [Allocation("r", "bob", 0, WorkerShape(cpu=1), (("a", 1),), roles=(("server", WorkerShape(cpu=3), (("a", 1),)),))]
    d = decide([cpu_node("a", 4)], [cpu_job("j", 1)], run)
    assert d.placements == () and d.waiting["j"].startswith("resources")


def test_the_reserved_jobs_server_nodes_are_kept_for_it():
    # a: 4 cpus, half used until t=100; b: 2 cpus, free. The head's 4 workers need all of a and
    # its server all of b: a job without a runtime may not take b now.
    nodes = [cpu_node("a", 4), cpu_node("b", 2)]
    run = [Allocation("r", "bob", 0, WorkerShape(cpu=1), (("a", 2),), max_runtime_s=100.0)]
    head = QueuedJob("head", "alice", 0, 0, 4, WorkerShape(cpu=1), workers_per_node=4, nodes=1,
                     roles=(("server", 1, WorkerShape(cpu=2)),))
    d = decide(nodes, [head, cpu_job("long", 1, seq=1), cpu_job("short", 1, seq=2, max_runtime_s=50.0)], run, now=10.0)
    assert d.estimated_start["head"] == 100.0
    assert d.waiting["long"].startswith("reservation")
    assert {p.job_id for p in d.placements} == {"short"}  # ends by 60, before the reserved start


# ---------------------------------------------------------------- quotas and fair share

@pytest.mark.parametrize("server_cpu, ok", [(1, True), (2, False)])
def test_quotas_count_the_servers(server_cpu, ok):
    # 4 workers × 1 cpu + 2 servers × server_cpu against a quota of 6 cpus
    job = ps_job(shape=WorkerShape(cpu=1), server=WorkerShape(cpu=server_cpu))
    d = decide([cpu_node("a", 16)], [job], quotas=[("alice", Quota(cpus=6))])
    assert bool(d.placements) is ok
    if not ok:
        assert d.waiting["ps"] == "quota: user 'alice' would use 8 cpus, quota 6"


def test_a_running_jobs_servers_count_against_the_quota_and_the_fair_share():
    run = [Allocation("r", "alice", 0, WorkerShape(cpu=1), (("a", 1),),
                      roles=(("server", WorkerShape(cpu=4), (("a", 1),)),))]
    queue = [cpu_job("alice2", 1, user="alice", seq=1), cpu_job("bob1", 1, user="bob", seq=2)]
    d = decide([cpu_node("a", 16)], queue, run, quotas=[("alice", Quota(cpus=5))])
    assert d.waiting["alice2"] == "quota: user 'alice' would use 6 cpus, quota 5"
    d = decide([cpu_node("a", 16)], queue, run)
    assert d.order == ("bob1", "alice2")  # alice holds 5 of 16 cpus, bob none


# ---------------------------------------------------------------- preemption

def test_preemption_frees_enough_for_every_role():
    # workers alone (2 × 2 cpus) would need one victim; with the servers (2 × 2 cpus) both go
    run = [Allocation("low1", "bob", 0, WorkerShape(cpu=1), (("a", 4),), started_at=0.0),
           Allocation("low2", "bob", 0, WorkerShape(cpu=1), (("a", 4),), started_at=10.0)]
    job = ps_job("urgent", workers=2, shape=WorkerShape(cpu=2), server=WorkerShape(cpu=2), priority=5)
    d = decide([cpu_node("a", 8)], [job], run, now=20.0)
    assert set(d.preemptions) == {"low1", "low2"}
    assert "preempting" in d.waiting["urgent"]
    workers_only = QueuedJob("urgent", "alice", 5, 1, 2, WorkerShape(cpu=2))
    assert decide([cpu_node("a", 8)], [workers_only], run, now=20.0).preemptions == ("low2",)


def test_a_victims_roles_count_as_freed():
    # low holds a's 8 cpus: 2 in workers, 6 in its server; stopping it frees all 8
    run = [Allocation("low", "bob", 0, WorkerShape(cpu=1), (("a", 2),), started_at=0.0,
                      roles=(("server", WorkerShape(cpu=6), (("a", 1),)),))]
    d = decide([cpu_node("a", 8)], [cpu_job("urgent", 8, priority=5, seq=1), cpu_job("small", 1, seq=2)], run)
    assert d.preemptions == ("low",) and "preempting" in d.waiting["urgent"]
    assert d.placements == ()  # nothing of a is free while low stops


# ---------------------------------------------------------------- malformed roles, fifo

@pytest.mark.parametrize("roles, words", [
    ((("", 1, SERVER),), "role name ''"),
    ((("workers", 1, SERVER),), "role name 'workers'"),
    ((("server", 1, SERVER), ("server", 1, SERVER)), "role 'server' appears twice"),
    ((("server", 0, SERVER),), "count=0"),
    ((("server", 1, WorkerShape(cpu=1, accelerator="prefer")),), "accelerator='prefer'"),
    ((("server", 1, WorkerShape(cpu=-1)),), "cpu=-1"),
    ((("server", 1, WorkerShape(cpu=1, gpu_type="a100")),), "gpu_type='a100' with gpu=0"),
    ((("server", 1),), "is not (name, count, WorkerShape)"),
])
def test_malformed_roles_wait_as_unschedulable_naming_the_value(roles, words):
    job = QueuedJob("bad", "u", 0, 1, 1, WorkerShape(cpu=1), roles=roles)
    assert words in job_problem(job)
    d = decide([cpu_node("a")], [job, cpu_job("good", 1)])
    assert d.waiting["bad"].startswith("unschedulable") and words in d.waiting["bad"]
    assert [p.job_id for p in d.placements] == ["good"]


def test_fifo_places_the_roles_too():
    d = schedule_fifo(SchedulerInput((gpu_node("g1"), cpu_node("c1")), (), (ps_job(),)))
    (p,) = d.placements
    assert p.roles[0][0] == "server" and p.roles[0][2] == (("c1", 2),)


# ---------------------------------------------------------------- fit index == step-by-step placement

@st.composite
def role_case(draw):
    count = draw(st.integers(1, 8))
    nodes = tuple(NodeView(f"n{i}", draw(st.sampled_from([2, 4, 8])), (g := draw(st.sampled_from([0, 0, 2, 4]))),
                           draw(st.sampled_from([8, 16])), gpu_type="a100" if g else None,
                           labels=(("zone", draw(st.sampled_from("ab"))),)) for i in range(count))
    cluster = Cluster(nodes)
    avail = cluster.total * np.array([[draw(st.sampled_from([0.0, 0.5, 1.0])) for _ in range(3)] for _ in range(count)])
    avail = np.floor(avail)
    roles = tuple((f"r{k}", draw(st.integers(1, 3)),
                   WorkerShape(cpu=draw(st.sampled_from([0.5, 1, 2])), memory=draw(st.sampled_from([0, 2])),
                               gpu=(g := draw(st.sampled_from([0, 0, 1]))), accelerator="required" if g else "none"))
                  for k in range(draw(st.integers(1, 2))))
    workers = draw(st.integers(1, 4))
    per_node = workers // 2 if workers % 2 == 0 and draw(st.booleans()) else None
    job = QueuedJob("j", "u", 0, 1, workers,
                    WorkerShape(cpu=draw(st.sampled_from([0.5, 1])), gpu=draw(st.sampled_from([0, 1])),
                                accelerator=draw(st.sampled_from(["none", "prefer"]))),
                    workers_per_node=per_node, nodes=2 if per_node else None,
                    labels=draw(st.sampled_from([(), (("zone", "a"),)])), roles=roles)
    override = {0: [float(x) for x in cluster.total[0] * 0.5]} if draw(st.booleans()) else None
    return cluster, avail, job, override


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(role_case())
def test_fit_index_agrees_with_the_placement_for_jobs_with_roles(case):
    cluster, avail, job, override = case
    ready = np.ones(len(cluster), dtype=bool)
    tiers = alternatives(job, cluster)
    index = FitIndex(cluster, avail, ready)
    view = avail.copy()
    for node, row in (override or {}).items():
        view[node] = row
    choice = place_best(cluster, tiers, job, view, ready, index, override)
    assert index.fits(tiers, job, override) is (choice is not None)
    # the same answer and the same placement without the index (as preemption and backfill ask)
    assert feasible(cluster, tiers, job, view, ready) is (choice is not None)
    assert place_best(cluster, tiers, job, view, ready) == choice
    if choice is not None:  # all roles placed, none over-committing the view
        assert [name for name, _, _ in choice.roles] == [name for name, _, _ in job.roles]
        for (_, count, _), (_, _, where) in zip(job.roles, choice.roles):
            assert sum(n for _, n in where) == count
        nodes, use = use_of(choice)
        assert len(set(nodes.tolist())) == len(nodes)
        assert (view[nodes] - use >= -1e-6).all()
