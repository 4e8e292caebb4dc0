"""The fit index (``scheduler.fitindex``) against the plain numpy scan it replaces, case by case and
over random clusters; and the cycle's shortcuts (jobs alike share one outcome) against the
definition they shortcut."""
from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from torchrelay.scheduler import NodeView, QueuedJob, Quota, SchedulerInput, WorkerShape, schedule
from torchrelay.scheduler.cluster import Cluster, alternatives
from torchrelay.scheduler.fitindex import FitIndex, node_capacity
from torchrelay.scheduler.placement import capacity, feasible, place_best

pytestmark = pytest.mark.timeout(60)

GiB = 1 << 30


def _cluster():
    return Cluster((
        NodeView("a", 4, 0, 16 * GiB, labels=(("zone", "a"),)),
        NodeView("b", 8, 0, 16 * GiB, labels=(("zone", "b"),)),
        NodeView("c", 32, 4, 64 * GiB, gpu_type="a100", labels=(("zone", "a"),)),
        NodeView("d", 32, 8, 64 * GiB, gpu_type="h100"),
    ))


def _job(workers, shape, **kw):
    return QueuedJob("j", "u", 0, 1, workers, shape, **kw)


@pytest.mark.parametrize("workers, shape, kw, fits", [
    (44, WorkerShape(cpu=1), {}, True),                         # all cpus of a, b, c (cpu jobs may use gpu nodes)
    (77, WorkerShape(cpu=1), {}, False),                        # one more than the cluster's 76 cpus
    (2, WorkerShape(cpu=1, memory=16 * GiB), {"workers_per_node": 1, "nodes": 2}, True),
    (5, WorkerShape(cpu=1, memory=16 * GiB), {"workers_per_node": 1, "nodes": 5}, False),  # 4 nodes
    (8, WorkerShape(cpu=1, gpu=1, gpu_type="h100"), {}, True),
    (9, WorkerShape(cpu=1, gpu=1, gpu_type="h100"), {}, False),  # no spreading onto the a100 node
    (9, WorkerShape(cpu=1, accelerator="required"), {}, False),  # a gang never mixes gpu types
    (36, WorkerShape(cpu=1), {"labels": (("zone", "a"),)}, True),
    (37, WorkerShape(cpu=1), {"labels": (("zone", "a"),)}, False),
    (3, WorkerShape(cpu=0), {}, True),                          # needs nothing: unbounded capacity
])
def test_fits_matches_the_scan(workers, shape, kw, fits):
    cluster = _cluster()
    job = _job(workers, shape, **kw)
    tiers = alternatives(job, cluster)
    everywhere = np.ones(len(cluster), dtype=bool)
    index = FitIndex(cluster, cluster.total.copy(), everywhere)
    assert index.fits(tiers, job) is fits
    assert feasible(cluster, tiers, job, cluster.total, everywhere) is fits


def test_touch_brings_the_index_up_to_date_and_override_changes_a_few_nodes():
    cluster = _cluster()
    avail = cluster.total.copy()
    ready = np.ones(len(cluster), dtype=bool)
    index = FitIndex(cluster, avail, ready)
    job = _job(8, WorkerShape(cpu=4), workers_per_node=4, nodes=2)
    tiers = alternatives(job, cluster)
    assert index.fits(tiers, job)                # c and d take 4 × 4 cpus each
    avail[cluster.index["c"]] = [15, 4, 64 * GiB]
    index.touch([cluster.index["c"]])
    assert not index.fits(tiers, job)            # c now takes 3: only d is left
    assert index.fits(tiers, job, {cluster.index["c"]: [16.0, 4.0, 64.0 * GiB]})
    alt = tiers[0][0]
    assert index.caps(alt, ()).tolist() == capacity(avail, alt.need, ready).tolist()
    assert index.caps(alt, ())[cluster.index["c"]] == 3


@pytest.mark.parametrize("row, need, expected", [
    ([4.0, 0.0, 8.0], (1.0, 0.0, 2.0), 4),
    ([0.3, 0.0, 0.0], (0.1, 0.0, 0.0), 3),       # 0.3 / 0.1 is 2.999…: the tolerance keeps 3
    ([-1.0, 0.0, 0.0], (1.0, 0.0, 0.0), 0),      # over-committed by a running job: no room
    ([0.0, 0.0, 0.0], (0.0, 0.0, 0.0), 1 << 40),  # a worker that needs nothing
])
def test_node_capacity_equals_the_numpy_formula(row, need, expected):
    assert node_capacity(row, need) == expected
    assert capacity(np.array([row]), need, np.array([True]))[0] == expected


@st.composite
def _scene(draw):
    nodes = tuple(NodeView(f"n{i}", draw(st.sampled_from([0, 2, 4, 8])), draw(st.sampled_from([0, 0, 2, 4])),
                           draw(st.sampled_from([0, 8, 16])), gpu_type=draw(st.sampled_from(["a100", "h100"])),
                           labels=(("zone", draw(st.sampled_from("ab"))),), ready=draw(st.booleans() | st.just(True)))
                  for i in range(draw(st.integers(1, 7))))
    nodes = tuple(n if n.gpus else NodeView(n.id, n.cpus, 0, n.memory, labels=n.labels, ready=n.ready) for n in nodes)
    accel = draw(st.sampled_from(["none", "required", "prefer"]))
    shape = WorkerShape(cpu=draw(st.sampled_from([0, 0.5, 1, 3])), gpu=draw(st.sampled_from([0, 1, 2])),
                        memory=draw(st.sampled_from([0, 1, 4])), accelerator=accel,
                        gpu_type=draw(st.sampled_from([None, "a100"])))
    workers = draw(st.integers(1, 12))
    per_node = draw(st.sampled_from([None, 1, 2, 3]))
    nodes_n = None
    if per_node:
        nodes_n = draw(st.integers(1, 4))
        workers = per_node * nodes_n
    job = QueuedJob("j", "u", 0, 1, workers, shape, workers_per_node=per_node, nodes=nodes_n,
                    labels=draw(st.sampled_from([(), (("zone", "a"),)])))
    changes = draw(st.lists(st.tuples(st.integers(0, 6), st.sampled_from([0.5, 1.0, 4.0]), st.integers(0, 2)),
                            max_size=8))
    return nodes, job, changes


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_scene())
def test_index_agrees_with_the_scan_as_resources_are_taken(scene):
    nodes, job, changes = scene
    cluster = Cluster(nodes)
    avail = cluster.total.copy()
    index = FitIndex(cluster, avail, cluster.ready)
    tiers = alternatives(job, cluster)
    for node, amount, dim in [(None, 0.0, 0), *changes]:
        if node is not None:
            node %= len(cluster)
            avail[node, dim] -= amount
            index.touch([node])
        assert index.fits(tiers, job) == feasible(cluster, tiers, job, avail, cluster.ready)
        assert place_best(cluster, tiers, job, avail, cluster.ready, index) == \
            place_best(cluster, tiers, job, avail, cluster.ready)
        # a view that departs from ``avail`` on one node (as the backfill view does)
        row = (avail[0] * 0.5).tolist()
        view = avail.copy()
        view[0] = row
        assert index.fits(tiers, job, {0: row}) == feasible(cluster, tiers, job, view, cluster.ready)


def _long_queue(users_with_quota=()):
    """Many jobs, few distinct ones: the shortcuts of a long queue are what this exercises."""
    rng = random.Random(7)
    nodes = tuple(NodeView(f"n{i}", 8, 0, 32 * GiB) for i in range(6))
    shapes = [WorkerShape(cpu=1, memory=GiB), WorkerShape(cpu=2, memory=4 * GiB), WorkerShape(cpu=8)]
    queue = tuple(QueuedJob(f"j{i:04d}", f"u{rng.randrange(4)}", rng.choice([0, 0, 2]), i, rng.choice([1, 2, 4, 8]),
                            rng.choice(shapes), max_runtime_s=rng.choice([None, 60.0, 600.0]))
                  for i in range(600))
    quotas = tuple((u, Quota(cpus=12, jobs=4)) for u in users_with_quota)
    return SchedulerInput(nodes, (), queue, now=0.0, quotas=quotas)


@pytest.mark.parametrize("quota_users", [(), ("u1",), ("u0", "u1", "u2", "u3")])
def test_jobs_alike_get_the_same_reason_whatever_their_place_in_the_queue(quota_users):
    inp = _long_queue(quota_users)
    d = schedule(inp)
    assert len(d.placements) + len(d.waiting) == len(inp.queue)
    # every job of the same shape, gang, runtime, priority and (quota-free) user class that waits
    # after the first of its kind got a lasting reason has that same reason
    seen: dict[tuple, str] = {}
    jobs = {j.job_id: j for j in inp.queue}
    for job_id in d.order:
        reason = d.waiting.get(job_id)
        job = jobs[job_id]
        if (reason is None or job.user in quota_users or not reason.startswith(("priority", "resources"))
                or "first in line" in reason):
            continue
        key = (job.shape, job.workers, job.max_runtime_s, job.priority)
        assert seen.setdefault(key, reason) == reason
    # and the cycle is deterministic
    assert schedule(inp) == d


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("valid", [True, False])
def test_a_cycle_leaves_the_garbage_collector_as_it_found_it(enabled, valid):
    import gc

    from torchrelay.errors import InvalidSpec

    node = NodeView("n", 4, 0, GiB)
    inp = SchedulerInput((node,) if valid else (node, node), (), (QueuedJob("j", "u", 0, 1, 1, WorkerShape()),))
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        if valid:
            assert schedule(inp).placements[0].placement == (("n", 1),)
        else:
            with pytest.raises(InvalidSpec, match="appears twice"):
                schedule(inp)
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
