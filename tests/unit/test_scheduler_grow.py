"""Growing elastic jobs in the scheduling policy, case by case: a running elastic job below the
workers it asks for (``Allocation.max_workers``) takes free room back (``Decisions.grows``) once
the queue had its turn, unless a queued job of its priority or higher waits for resources. Then
the pure parts of carrying that out: the joiners' launches, what their workers are told, and
what the server tells the policy of a grown job."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from torchrelay.agent.commands import build_torchrun_command
from torchrelay.scheduler import Allocation, Grow, NodeView, QueuedJob, SchedulerInput, WorkerShape, schedule
from torchrelay.server.assignment import grow_launches, is_joiner, launch_assignment
from torchrelay.server.scheduling import all_running, allocation, grow_event, workers_finished
from torchrelay.spec import JobSpec

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


# ---------------------------------------------------------------- the server's side (pure parts)

ELASTIC = {"kind": "ddp", "elastic": {"min_workers": 2, "max_workers": 4}}


def launch_row(node_rank, node, nproc, offset, world=3, released=None):
    return SimpleNamespace(id=f"job-3-a1-n{node_rank}", job_seq=3, attempt=1, node_rank=node_rank, node_id=node,
                           nnodes=1, nproc=nproc, rank_offset=offset, world_size=world, desired="run",
                           stop_reason=None, stop_grace_s=None, bundle=None, cpu=1.0, gpu=0, memory=0,
                           released=released)


@pytest.mark.parametrize("launches, add, want", [
    # started with 3, rank 2 released, one worker back: rank 3 (never 2 again), node rank 1, world 3
    ([launch_row(0, "a", 3, 0, released=[2])], [("a", 1)], [("job-3-a1-n1", "a", 1, 1, 3, 3, 2)]),
    # started at its min (a world of 2) on two nodes, then two more on b and c
    ([launch_row(0, "a", 1, 0, world=2), launch_row(1, "b", 1, 1, world=2)], [("b", 1), ("c", 1)],
     [("job-3-a1-n2", "b", 2, 1, 2, 2, 4), ("job-3-a1-n3", "c", 3, 1, 3, 2, 4)]),
    # a second grow: after the first one's ranks and node rank
    ([launch_row(0, "a", 2, 0, world=2), launch_row(1, "a", 1, 2, world=2)], [("b", 2)],
     [("job-3-a1-n2", "b", 2, 2, 3, 2, 3)]),
])
def test_a_grow_adds_launches_of_joiners_after_every_rank_the_attempt_used(launches, add, want):
    plans = grow_launches("job-3", 1, launches, add, CPU)
    assert [(p.id, p.node_id, p.node_rank, p.nproc, p.rank_offset, p.world_size, p.nnodes) for p in plans] == want
    assert all(is_joiner(p) for p in plans) and not any(is_joiner(x) for x in launches[:1])


def test_a_grow_of_nothing_is_refused():
    with pytest.raises(ValueError, match=r"cannot grow by \[\]"):
        grow_launches("job-3", 1, [launch_row(0, "a", 2, 0)], [], CPU)


def test_the_workers_of_a_joiners_launch_are_told_to_join_and_torchrun_refuses_them():
    joiner = launch_assignment(launch_row(1, "a", 1, 3), job_id="job-3", argv=["python", "x.py"], env={"A": "1"},
                               spec_stop_grace_s=5.0, master=("h", 4100), store_url="/store")
    member = launch_assignment(launch_row(0, "a", 3, 0), job_id="job-3", argv=["python", "x.py"], env={"A": "1"},
                               spec_stop_grace_s=5.0, master=("h", 4100), store_url="/store")
    assert joiner.env == {"A": "1", "RELAY_ELASTIC_JOIN": "1"} and member.env == {"A": "1"}
    with pytest.raises(ValueError, match="RELAY_ELASTIC_JOIN=1.*need the warm launch"):
        build_torchrun_command(joiner, master_addr="h", master_port=4100, log_dir="l")


def test_the_policy_is_told_how_far_a_running_elastic_job_may_grow_and_where():
    job_spec = JobSpec.parse({"name": "t", "entrypoint": "python train.py", "workers": 3, "strategy": ELASTIC,
                              "labels": {"zone": "x"}})
    # node 0 with rank 2 released, a joiner's launch on the same node: one entry per node, node 0 first
    live = [launch_row(0, "a", 3, 0, released=[2]), launch_row(1, "b", 1, 3), launch_row(2, "a", 1, 4)]
    alloc = allocation(seq=3, spec=job_spec, live=live, started_at=0.0, preempting=False)
    assert (alloc.placement, alloc.min_workers, alloc.max_workers, alloc.labels) == \
        ((("a", 3), ("b", 1)), 2, 3, (("zone", "x"),))
    pending = allocation(seq=3, spec=job_spec, live=live, started_at=0.0, preempting=False, running=False)
    assert (pending.min_workers, pending.max_workers) == (None, None)


def test_a_grow_says_which_ranks_join():
    event = grow_event(Grow("job-3", (("n1", 1),), CPU), [3], 2, {"n1": "a"})
    assert event == "growing: rank(s) 3 join (a×1) and receive the members' state; elastic: 2 → 3 workers"


def ended(offset, nproc, succeeded=True, released=None, state="exited"):
    return SimpleNamespace(state=state, succeeded=succeeded, rank_offset=offset, nproc=nproc, released=released)


@pytest.mark.parametrize("launches, finished", [
    ([ended(0, 3, state="running")], False),
    ([ended(0, 2, state="running"), ended(2, 1)], True),  # a launch whose workers returned: the job is ending
    ([ended(0, 2, state="running"), ended(2, 1, released=[2])], False),  # its only rank was released (a shrink)
    ([ended(0, 2, state="running"), ended(2, 2, released=[3])], True),  # rank 2 returned
    ([ended(0, 2, state="running"), ended(2, 1, succeeded=False)], False),  # failed: the lifecycle's business
])
def test_a_job_some_of_whose_workers_finished_is_not_grown(launches, finished):
    assert workers_finished(launches) is finished


def test_a_job_whose_launches_are_starting_is_neither_shrunk_nor_grown():
    assert all_running([ended(0, 2, state="running"), ended(2, 1, state="running")])
    assert not all_running([ended(0, 2, state="running"), ended(2, 1, state="pending")])
