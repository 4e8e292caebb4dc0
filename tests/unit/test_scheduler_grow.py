"""Growing elastic jobs in the scheduling policy, case by case: a running elastic job below the
workers it asks for (``Allocation.max_workers``) takes free room back (``Decisions.grows``) once
the queue had its turn, unless a queued job of its priority or higher waits for resources."""
from __future__ import annotations

import pytest

from torchrelay.scheduler import Allocation, Grow, NodeView, QueuedJob, SchedulerInput, WorkerShape, schedule

pytestmark = pytest.mark.timeout(60)

CPU = WorkerShape(cpu=1)


def node(name, cpus, **labels):
    return NodeView(name, cpus, 0, 0, labels=tuple(sorted(labels.items())))


def job(job_id, workers, priority=0, **kw):
    return QueuedJob(job_id, job_id, priority, 1, workers, CPU, **kw)


def elastic(job_id, placement, min_workers, max_workers, priority=0, started_at=0.0, **kw):
    return Allocation(job_id, job_id, priority, CPU, tuple(placement), started_at=started_at,
                      min_workers=min_workers, max_workers=max_workers, **kw)


def grown(nodes, run, queue=()):
    d = schedule(SchedulerInput(tuple(nodes), tuple(run), tuple(queue)))
    return [(g.job_id, g.add) for g in d.grows], d


@pytest.mark.parametrize("nodes, run, queue, want", [
    # room for its missing worker: grown by one
    ([node("a", 3)], [elastic("e", [("a", 2)], 2, 3)], [], [("e", (("a", 1),))]),
    # room for 1 of the 2 it misses: grown by one
    ([node("a", 3)], [elastic("e", [("a", 2)], 2, 4)], [], [("e", (("a", 1),))]),
    # over several nodes
    ([node("a", 2), node("b", 2)], [elastic("e", [("a", 1)], 1, 4)], [], [("e", (("a", 1), ("b", 2)))]),
    # already at its workers, or no room: nothing
    ([node("a", 3)], [elastic("e", [("a", 3)], 2, 3)], [], []),
    ([node("a", 2)], [elastic("e", [("a", 2)], 2, 3)], [], []),
    # not elastic for the scheduler (not running yet: no range), or being preempted: nothing
    ([node("a", 3)], [elastic("e", [("a", 2)], None, 3)], [], []),
    ([node("a", 3)], [elastic("e", [("a", 2)], 2, 3, preempting=True)], [], []),
    # its labels say where new workers go: not onto b
    ([node("a", 2, zone="x"), node("b", 2)], [elastic("e", [("a", 2)], 2, 3, labels=(("zone", "x"),))], [], []),
    ([node("a", 2, zone="x"), node("b", 2), node("c", 1, zone="x")],
     [elastic("e", [("a", 2)], 2, 3, labels=(("zone", "x"),))], [], [("e", (("c", 1),))]),
    # a queued job that fits goes first; the elastic job gets what is left
    ([node("a", 4)], [elastic("e", [("a", 2)], 2, 4, priority=5)], [job("q", 1)], [("e", (("a", 1),))]),
    # a queued job of higher or equal priority waits for resources: no growing
    ([node("a", 3)], [elastic("e", [("a", 2)], 2, 3)], [job("q", 2, priority=5)], []),
    ([node("a", 3)], [elastic("e", [("a", 2)], 2, 3, priority=5)], [job("q", 2, priority=5)], []),
    # ...of lower priority: it grows (the queued job could not start in that room anyway)
    ([node("a", 3)], [elastic("e", [("a", 2)], 2, 3, priority=5)], [job("q", 2)], [("e", (("a", 1),))]),
    # one that can never run does not hold growing back
    ([node("a", 3)], [elastic("e", [("a", 2)], 2, 3)], [job("q", 9, priority=5)], [("e", (("a", 1),))]),
    # as a backfilled job without a runtime limit: not into room kept for the first job in line
    # (q is reserved b, where x ends first) ...
    ([node("a", 2), node("b", 2)],
     [elastic("e", [("a", 2)], 2, 4, priority=5), Allocation("x", "x", 9, CPU, (("b", 1),), max_runtime_s=10)],
     [job("q", 2)], []),
    # ... but beside it (q reserved a, where e's workers end, and b's room is not needed)
    ([node("a", 2), node("b", 2)],
     [elastic("e", [("a", 2)], 2, 4, priority=5), Allocation("x", "x", 9, CPU, (("b", 1),))],
     [job("q", 2)], [("e", (("b", 1),))]),
    # two jobs below their workers, room for one worker: the higher priority first, then the earlier started
    ([node("a", 3)], [elastic("e0", [("a", 1)], 1, 2), elastic("e1", [("a", 1)], 1, 2, priority=1)], [],
     [("e1", (("a", 1),))]),
    ([node("a", 3)], [elastic("e0", [("a", 1)], 1, 2, started_at=2.0), elastic("e1", [("a", 1)], 1, 2, started_at=1.0)],
     [], [("e1", (("a", 1),))]),
])
def test_a_running_elastic_job_below_its_workers_takes_free_room_back(nodes, run, queue, want):
    grows, d = grown(nodes, run, queue)
    assert grows == want, d.waiting
    assert all(g.shape == CPU for g in d.grows)


def test_a_grown_job_takes_room_another_grow_cannot_use():
    grows, _ = grown([node("a", 4)], [elastic("e0", [("a", 1)], 1, 3, priority=1), elastic("e1", [("a", 1)], 1, 3)])
    assert grows == [("e0", (("a", 2),))]


def test_grow_names_its_workers():
    assert Grow("e", (("a", 1), ("b", 2)), CPU).workers == 3
