"""Elastic jobs in the scheduling policy, case by case: a queued one starts with as many workers
as fit (down to ``min_workers``), and a running one gives workers back (``Decisions.shrinks``)
to a higher-priority job instead of being preempted whole, when that is enough."""
from __future__ import annotations

import pytest

from torchrelay.scheduler import (Allocation, NodeView, QueuedJob, SchedulerInput, Shrink, WorkerShape, fits_ever,
                                  job_problem, schedule)

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
