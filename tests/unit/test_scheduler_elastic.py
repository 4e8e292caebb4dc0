"""Elastic jobs in the scheduling policy, case by case: a queued one starts with as many workers
as fit (down to ``min_workers``), and a running one gives workers back (``Decisions.shrinks``)
to a higher-priority job instead of being preempted whole, when that is enough. Then the pure
parts of carrying that out: what the server tells the policy, which ranks leave, the world of
a job started smaller, and when the agent calls a shrunk launch successful."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from torchrelay import wire
from torchrelay.agent.launcher import elastic_survived
from torchrelay.layout import RankLayout
from torchrelay.scheduler import (Allocation, NodeView, Placement, QueuedJob, SchedulerInput, Shrink, WorkerShape,
                                  fits_ever, job_problem, schedule)
from torchrelay.server.assignment import placed_layout, plan_launches, ranks_to_release
from torchrelay.server.scheduling import allocation, elastic_min, placement_summary, queued_job, shrink_event
from torchrelay.spec import JobSpec

pytestmark = pytest.mark.timeout(60)

CPU = WorkerShape(cpu=1)


def node(name, cpus, **labels):
    return NodeView(name, cpus, 0, 0, labels=tuple(sorted(labels.items())))


def job(job_id, workers, min_workers=None, priority=0, seq=1, **kw):
    return QueuedJob(job_id, kw.pop("user", job_id), priority, seq, workers, CPU, min_workers=min_workers, **kw)


def running(job_id, placement, min_workers=None, priority=0, started_at=0.0, **kw):
    return Allocation(job_id, job_id, priority, CPU, tuple(placement), started_at=started_at,
                      min_workers=min_workers, **kw)


def decide(nodes, queue, run=()):
    return schedule(SchedulerInput(tuple(nodes), tuple(run), tuple(queue)))


def placed(decisions):
    return {p.job_id: p.placement for p in decisions.placements}


# ---------------------------------------------------------------- starting with fewer workers

@pytest.mark.parametrize("nodes, run, queue, want, reason", [
    # room for all of it: placed whole, as any job
    ([node("a", 4)], [], [job("e", 3, 2)], {"e": (("a", 3),)}, None),
    # room for 2 of 3: starts with 2
    ([node("a", 2)], [], [job("e", 3, 2)], {"e": (("a", 2),)}, None),
    # 1 cpu here and 1 there: a spread gang of 2 of its 4
    ([node("a", 2), node("b", 2)], [running("x", [("a", 1)], priority=9), running("y", [("b", 1)], priority=9)],
     [job("e", 4, 2)], {"e": (("a", 1), ("b", 1))}, None),
    # as many as fit, not the minimum: 3 of 5 (min 1)
    ([node("a", 3)], [], [job("e", 5, 1)], {"e": (("a", 3),)}, None),
    # fewer than min_workers fit: it waits, nothing placed
    ([node("a", 3)], [running("x", [("a", 2)], priority=9)], [job("e", 3, 2)], {}, "gang"),
    # the cluster could never hold all 4, but holds its min 2: placed with 2, not unschedulable
    ([node("a", 2)], [], [job("e", 4, 2)], {"e": (("a", 2),)}, None),
    # not even its min fits the empty cluster: unschedulable, saying so
    ([node("a", 2)], [], [job("e", 4, 3)], {}, "unschedulable: 4 workers (elastic: at least 3)"),
    # a job without a range waits for all its workers
    ([node("a", 2)], [running("x", [("a", 1)], priority=9)], [job("f", 2)], {}, "gang"),
])
def test_an_elastic_job_starts_with_as_many_workers_as_fit_down_to_its_min(nodes, run, queue, want, reason):
    d = decide(nodes, queue, run)
    assert placed(d) == want
    assert not d.preemptions and not d.shrinks
    for q in queue:
        if q.job_id not in want:
            assert d.waiting[q.job_id].startswith(reason), d.waiting[q.job_id]


def test_a_job_ahead_in_the_order_takes_its_room_first_and_the_elastic_job_takes_what_is_left():
    # priority 5 first (3 of 4 cpus), then the elastic job gets 1 worker (its min 1), not 3
    d = decide([node("a", 4)], [job("e", 3, 1, seq=1), job("big", 3, priority=5, seq=2)])
    assert placed(d) == {"big": (("a", 3),), "e": (("a", 1),)}


@pytest.mark.parametrize("bad, says", [
    (job("e", 3, 4), "min_workers=4; an elastic job's min_workers lies in [1, workers=3]"),
    (job("e", 3, 0), "min_workers=0"),
    (job("e", 4, 2, workers_per_node=2, nodes=2), "min_workers=2 with workers_per_node"),
])
def test_a_malformed_elastic_range_is_named(bad, says):
    assert says in job_problem(bad)
    assert decide([node("a", 8)], [bad]).waiting["e"].startswith("unschedulable: " + says)


def test_fits_ever_asks_for_the_min_of_an_elastic_job():
    assert fits_ever(job("e", 4, 2), (node("a", 2),))
    assert not fits_ever(job("e", 4, 3), (node("a", 2),))


# ---------------------------------------------------------------- shrinking instead of preempting

HIGH = dict(priority=5, seq=2)


@pytest.mark.parametrize("nodes, run, queue, shrinks, preempted, reason", [
    # a full node, an elastic job of 3 (min 2) on it: one of its workers makes room
    ([node("a", 3)], [running("e", [("a", 3)], 2)], [job("h", 1, **HIGH)],
     [Shrink("e", (("a", 1),), "h")], [], "resources: shrinking lower-priority elastic job(s) e (1 worker)"),
    # it already runs at its min: preempted whole, as before
    ([node("a", 3)], [running("e", [("a", 3)], 3)], [job("h", 1, **HIGH)], [], ["e"], "resources: preempting"),
    # the job needs more than it may give back (2 > 3 - 2): preempted whole
    ([node("a", 3)], [running("e", [("a", 3)], 2)], [job("h", 2, **HIGH)], [], ["e"], "resources: preempting"),
    # not preemptible: neither shrunk nor preempted
    ([node("a", 3)], [running("e", [("a", 3)], 2, preemptible=False)], [job("h", 1, **HIGH)], [], [], "resources"),
    # the same priority: neither
    ([node("a", 3)], [running("e", [("a", 3)], 2, priority=5)], [job("h", 1, **HIGH)], [], [], "resources"),
    # its node 0 (a) keeps a worker: the job that needs a's only cpu preempts it whole
    ([node("a", 1, zone="x"), node("b", 2)], [running("e", [("a", 1), ("b", 2)], 1)],
     [job("h", 1, labels=(("zone", "x"),), **HIGH)], [], ["e"], "resources: preempting"),
    # ...while a job that may run anywhere takes one of b's
    ([node("a", 1), node("b", 2)], [running("e", [("a", 1), ("b", 2)], 1)], [job("h", 1, **HIGH)],
     [Shrink("e", (("b", 1),), "h")], [], "resources: shrinking"),
    # two elastic jobs: the lower-priority one gives back first
    ([node("a", 2), node("b", 2)], [running("e1", [("a", 2)], 1, priority=1), running("e0", [("b", 2)], 1)],
     [job("h", 1, **HIGH)], [Shrink("e0", (("b", 1),), "h")], [], "resources: shrinking"),
    # two elastic jobs on one node, one spare worker each: both give one back
    ([node("a", 4)], [running("e1", [("a", 2)], 1, priority=1), running("e0", [("a", 2)], 1)],
     [job("h", 2, **HIGH)], [Shrink("e0", (("a", 1),), "h"), Shrink("e1", (("a", 1),), "h")], [],
     "resources: shrinking lower-priority elastic job(s) e0 (1 worker), e1 (1 worker)"),
    # an elastic preemptor asks for its min: 1 of e's spare workers is enough for h's min 1
    ([node("a", 2)], [running("e", [("a", 2)], 1)], [job("h", 2, 1, **HIGH)],
     [Shrink("e", (("a", 1),), "h")], [], "resources: shrinking"),
])
def test_a_running_elastic_job_gives_workers_back_instead_of_being_preempted(nodes, run, queue, shrinks, preempted,
                                                                             reason):
    d = decide(nodes, queue, run)
    assert list(d.shrinks) == shrinks
    assert list(d.preemptions) == preempted
    assert not d.placements
    assert d.waiting["h"].startswith(reason), d.waiting["h"]


def test_a_job_shrunk_in_a_cycle_is_not_also_preempted_in_it():
    # h1 takes one of e's 4 workers; h2 (3 cpus) would need e whole, which goes on smaller: h2 waits
    d = decide([node("a", 4)], [job("h1", 1, priority=5, seq=2), job("h2", 3, priority=4, seq=3)],
               [running("e", [("a", 4)], 3)])
    assert list(d.shrinks) == [Shrink("e", (("a", 1),), "h1")]
    assert not d.preemptions and not d.placements
    assert d.waiting["h2"].startswith("resources"), d.waiting["h2"]


def test_once_the_released_workers_left_the_job_starts_beside_the_smaller_elastic_job():
    # the next cycle: the server reports e with the 2 workers it kept
    d = decide([node("a", 3)], [job("h", 1, **HIGH)], [running("e", [("a", 2)], 2)])
    assert placed(d) == {"h": (("a", 1),)} and not d.shrinks and not d.preemptions


# ---------------------------------------------------------------- the server's side (pure parts)

ELASTIC = {"kind": "ddp", "elastic": {"min_workers": 2, "max_workers": 4}}


def spec(**kw):
    return JobSpec.parse({"name": "t", "entrypoint": "python train.py", **kw})


def live(node, nproc, offset, released=None):
    return SimpleNamespace(node_id=node, nproc=nproc, rank_offset=offset, cpu=1.0, gpu=0, memory=0, released=released)


@pytest.mark.parametrize("job_spec, expected", [
    (spec(workers=3, strategy=ELASTIC), 2),
    (spec(workers=3), None),  # not elastic
    (spec(workers=4, nodes=2, workers_per_node=2, strategy=ELASTIC), None),  # a node gang runs whole
])
def test_the_policy_is_told_an_elastic_jobs_min_workers(job_spec, expected):
    assert elastic_min(job_spec) == expected
    assert queued_job(1, job_spec).min_workers == expected


@pytest.mark.parametrize("launches, expected", [
    # nothing released: every process holds a worker
    ([live("a", 3, 0)], (("a", 3),)),
    # rank 2 asked to leave: given back at once
    ([live("a", 3, 0, [2])], (("a", 2),)),
    # a node whose ranks all left drops out; node 0 stays first
    ([live("a", 2, 0), live("b", 1, 2, [2])], (("a", 2),)),
    ([live("a", 2, 0, [1]), live("b", 2, 2)], (("a", 1), ("b", 2))),
])
def test_a_shrunk_job_holds_the_workers_it_kept(launches, expected):
    alloc = allocation(seq=3, spec=spec(workers=4, strategy=ELASTIC), live=launches, started_at=0.0, preempting=False)
    assert (alloc.placement, alloc.min_workers) == (expected, 2)


@pytest.mark.parametrize("nproc, offset, released, count, expected", [
    (3, 0, None, 1, [2]),  # the highest rank first
    (3, 0, [2], 1, [1]),  # then the next one not released yet
    (2, 2, None, 2, [2, 3]),  # a whole launch on another node
])
def test_a_shrink_releases_a_launchs_highest_ranks(nproc, offset, released, count, expected):
    assert ranks_to_release(rank_offset=offset, nproc=nproc, released=released, count=count) == expected


def test_a_shrink_cannot_release_more_ranks_than_a_launch_has_left():
    with pytest.raises(ValueError, match="cannot release 2 ranks of ranks 0..1: only 1 are left"):
        ranks_to_release(rank_offset=0, nproc=2, released=[1], count=2)


def test_a_job_placed_with_fewer_workers_gets_a_world_of_those_placed():
    layout = RankLayout(workers=4)
    small = Placement("job-3", (("a", 2), ("b", 1)), CPU)
    assert placed_layout(layout, small, 2) == RankLayout(workers=3)
    plans = plan_launches("job-3", 1, small, placed_layout(layout, small, 2))
    assert [(p.rank_offset, p.nproc, p.world_size) for p in plans] == [(0, 2, 3), (2, 1, 3)]
    assert placed_layout(layout, Placement("job-3", (("a", 4),), CPU), 2) is layout
    with pytest.raises(ValueError, match=r"placed with 1 workers, outside its elastic range \[2, 4\]"):
        placed_layout(layout, Placement("job-3", (("a", 1),), CPU), 2)


def test_the_placement_and_the_shrink_say_what_happened():
    text = placement_summary(Placement("job-3", (("n1", 2),), CPU), spec(workers=3, strategy=ELASTIC), {"n1": "a"}, {})
    assert text == "a×2 (elastic: 2 of 3 workers, all the cluster had room for)"
    event = shrink_event(Shrink("job-3", (("n1", 1),), "job-9"), [2], 3, {"n1": "a"})
    assert event == "shrinking for higher-priority job job-9: rank(s) 2 leave (a×1); elastic: 3 → 2 workers"


def rank(r, returned):
    return wire.RankExit(rank=r, returned=returned, signal=None if returned else 15)


@pytest.mark.parametrize("ranks, min_workers, released, expected", [
    ([rank(0, True), rank(1, True), rank(2, False)], 2, frozenset(), True),  # enough returned
    ([rank(0, True), rank(1, False)], 2, frozenset(), False),
    # a launch on another node whose only rank was released: it kept nothing and failed nothing
    ([rank(2, False)], 2, frozenset({2}), True),
    ([rank(2, False), rank(3, False)], 2, frozenset({2}), False),  # rank 3 failed on its own
    ([rank(0, True), rank(1, False)], None, frozenset({1}), False),  # not elastic: never
])
def test_an_elastic_launch_whose_released_ranks_left_succeeds(ranks, min_workers, released, expected):
    assert elastic_survived(ranks, min_workers, released) is expected


# ---------------------------------------------------------------- over random clusters

@st.composite
def two_cycles(draw):
    """Random nodes; a first queue (elastic or not, priorities 0-2) placed on the empty cluster;
    then a second queue of jobs of priorities 0-5 arriving while the first runs."""
    nodes = [NodeView(f"n{i}", draw(st.sampled_from([1, 2, 3, 4])), 0, 0) for i in range(draw(st.integers(1, 4)))]

    def queue(prefix, count, priorities, seq):
        jobs = []
        for i in range(count):
            workers = draw(st.integers(1, 6))
            low = draw(st.none() | st.integers(1, workers))
            jobs.append(job(f"{prefix}{i}", workers, low, priority=draw(priorities), seq=seq + i,
                            preemptible=draw(st.booleans() | st.just(True))))
        return jobs

    first = queue("r", draw(st.integers(1, 5)), st.integers(0, 2), 1)
    second = queue("q", draw(st.integers(1, 4)), st.integers(0, 5), 100)
    return nodes, first, second


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(two_cycles())
def test_elastic_decisions_keep_their_bounds(case):
    nodes, first, second = case
    d1 = decide(nodes, first)
    asked = {q.job_id: q for q in first}
    used: dict[str, float] = {}
    for p in d1.placements:  # started with min_workers..workers, never over-committing a node
        q, count = asked[p.job_id], sum(k for _, k in p.placement)
        assert (q.min_workers or q.workers) <= count <= q.workers
        for node_id, k in p.placement:
            used[node_id] = used.get(node_id, 0) + k
    assert all(used.get(n.id, 0) <= n.cpus for n in nodes)
    run = [running(p.job_id, p.placement, asked[p.job_id].min_workers, asked[p.job_id].priority,
                   preemptible=asked[p.job_id].preemptible) for p in d1.placements]
    d2 = decide(nodes, second, run)
    held = {a.job_id: a for a in run}
    priority = {q.job_id: q.priority for q in second}
    given_back: dict[str, dict[str, int]] = {}
    for s in d2.shrinks:
        a = held[s.job_id]
        assert a.min_workers is not None and a.preemptible and a.priority < priority[s.for_job]
        for node_id, k in s.release:
            given_back.setdefault(s.job_id, {})[node_id] = given_back.get(s.job_id, {}).get(node_id, 0) + k
    for job_id, per_node in given_back.items():
        a = held[job_id]
        left = {node_id: k - per_node.get(node_id, 0) for node_id, k in a.placement}
        assert min(left.values()) >= 0 and sum(left.values()) >= a.min_workers
        assert left[a.placement[0][0]] >= 1  # node 0 keeps a worker: it hosts the store
        assert job_id not in d2.preemptions  # shrunk or preempted, not both
