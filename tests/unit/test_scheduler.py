"""The scheduling policy, case by case: packing, gangs, heterogeneous requests, priorities, fair
share, quotas, backfill, preemption and the waiting reasons."""
from __future__ import annotations

import pytest

from torchrelay.errors import InvalidSpec
from torchrelay.scheduler import (Allocation, NodeView, QueuedJob, Quota, SchedulerInput, WorkerShape,
                                  fits_ever, job_problem, schedule)
from torchrelay.scheduler.fifo import schedule_fifo

pytestmark = pytest.mark.timeout(60)

GiB = 1 << 30
CPU = WorkerShape(cpu=1)


def cpu_node(name, cpus, **kw):
    return NodeView(name, cpus, 0, 64 * GiB, **kw)


def gpu_node(name, gpus, gpu_type, cpus=32, **kw):
    return NodeView(name, cpus, gpus, 256 * GiB, gpu_type=gpu_type, **kw)


_seq = iter(range(1, 10**9))


def job(job_id, workers=1, shape=CPU, user="alice", priority=0, **kw):
    return QueuedJob(job_id, user, priority, kw.pop("seq", next(_seq)), workers, shape, **kw)


def running(job_id, placement, shape=CPU, user="bob", priority=0, **kw):
    return Allocation(job_id, user, priority, shape, tuple(placement), **kw)


def decide(nodes, queue, run=(), now=0.0, quotas=()):
    return schedule(SchedulerInput(tuple(nodes), tuple(run), tuple(queue), now=now, quotas=tuple(quotas)))


def placed(decisions):
    return {p.job_id: p.placement for p in decisions.placements}


def reason(decisions, job_id):
    return decisions.waiting[job_id].split(":", 1)[0]


# ---------------------------------------------------------------- packing

@pytest.mark.parametrize("workers, expected", [
    (4, (("b", 4),)),                   # one node, the tightest fit (b is left with nothing)
    (6, (("c", 6),)),                   # only c holds six on one node
    (10, (("c", 8), ("a", 2))),         # two nodes: the largest, then the best fit for the rest
    (14, (("c", 8), ("b", 4), ("a", 2))),
])
def test_gang_goes_on_the_fewest_nodes_then_the_tightest_fit(workers, expected):
    nodes = [cpu_node("a", 2), cpu_node("b", 4), cpu_node("c", 8)]
    assert placed(decide(nodes, [job("j", workers)]))["j"] == expected


def test_workers_per_node_picks_exactly_that_many_nodes_tightest_first():
    nodes = [cpu_node("a", 16), cpu_node("b", 4), cpu_node("c", 5), cpu_node("d", 3)]
    d = decide(nodes, [job("j", 8, nodes=2, workers_per_node=4)])
    assert placed(d)["j"] == (("b", 4), ("c", 4))


def test_cpu_workers_stay_off_gpu_nodes_when_it_costs_no_extra_node():
    nodes = [gpu_node("g", 4, "a100", cpus=64), cpu_node("c", 16)]
    assert placed(decide(nodes, [job("j", 8)]))["j"] == (("c", 8),)
    # ... but a gang too big for the CPU node goes to the GPU node rather than waiting
    assert placed(decide(nodes, [job("k", 20)]))["k"] == (("g", 20),)


def test_gang_is_all_or_nothing_and_waits_with_reason_gang():
    nodes = [cpu_node("a", 4), cpu_node("b", 4)]
    run = [running("r", [("a", 2)])]
    d = decide(nodes, [job("j", 8)], run)
    assert d.placements == ()
    assert reason(d, "j") == "gang"


def test_no_room_for_a_single_worker_is_reason_resources():
    d = decide([cpu_node("a", 2)], [job("j", 2)], [running("r", [("a", 2)])])
    assert reason(d, "j") == "resources"


def test_memory_counts_as_a_resource():
    nodes = [NodeView("a", 64, 0, 8 * GiB)]
    d = decide(nodes, [job("j", 3, WorkerShape(cpu=1, memory=3 * GiB))])
    assert reason(d, "j") == "unschedulable"
    d = decide(nodes, [job("j", 2, WorkerShape(cpu=1, memory=3 * GiB))])
    assert placed(d)["j"] == (("a", 2),)


def test_nodes_that_are_not_ready_get_nothing():
    nodes = [cpu_node("a", 8, ready=False), cpu_node("b", 2)]
    d = decide(nodes, [job("j", 4), job("k", 2)])
    assert placed(d) == {"k": (("b", 2),)}
    assert reason(d, "j") == "gang" and "not ready" in d.waiting["j"]


# ---------------------------------------------------------------- heterogeneous requests

GPU_NODES = [gpu_node("a1", 2, "a100"), gpu_node("a2", 2, "a100"), gpu_node("h1", 2, "h100"), cpu_node("c", 8)]


@pytest.mark.parametrize("shape, workers, expected_nodes, granted_type", [
    (WorkerShape(cpu=1, gpu=1, gpu_type="h100"), 2, {"h1"}, "h100"),
    (WorkerShape(cpu=1, gpu=1, gpu_type="a100"), 4, {"a1", "a2"}, "a100"),
    (WorkerShape(cpu=1, gpu=1), 3, {"a1", "a2"}, "a100"),                   # any type, never mixed
    (WorkerShape(cpu=1, accelerator="required"), 2, {"a1"}, "a100"),       # "any accelerator", 1 gpu
    (WorkerShape(cpu=1, accelerator="prefer"), 2, {"a1"}, "a100"),
])
def test_gpu_requests_land_on_one_suitable_gpu_type(shape, workers, expected_nodes, granted_type):
    d = decide(GPU_NODES, [job("j", workers, shape)])
    (p,) = d.placements
    assert {n for n, _ in p.placement} == expected_nodes
    assert p.shape.gpu_type == granted_type and p.shape.gpu >= 1


def test_any_accelerator_gang_larger_than_any_one_gpu_type_is_unschedulable():
    d = decide(GPU_NODES, [job("j", 5, WorkerShape(cpu=1, gpu=1))])
    assert reason(d, "j") == "unschedulable"


def test_prefer_accelerator_falls_back_to_cpu_when_gpus_are_busy():
    run = [running(f"r{n}", [(n, 2)], WorkerShape(cpu=1, gpu=1, gpu_type=t))
           for n, t in (("a1", "a100"), ("a2", "a100"), ("h1", "h100"))]
    d = decide(GPU_NODES, [job("p", 4, WorkerShape(cpu=2, accelerator="prefer")),
                           job("r", 1, WorkerShape(cpu=1, accelerator="required"))], run)
    assert placed(d)["p"] == (("c", 4),)
    (p,) = d.placements
    assert p.shape.gpu == 0 and p.shape.gpu_type is None
    assert reason(d, "r") == "resources"


def test_node_labels_are_required():
    nodes = [cpu_node("a", 8, labels=(("zone", "a"),)), cpu_node("b", 8, labels=(("zone", "b"),))]
    d = decide(nodes, [job("j", 2, labels=(("zone", "b"),)), job("k", 1, labels=(("zone", "c"),))])
    assert placed(d)["j"] == (("b", 2),)
    assert reason(d, "k") == "unschedulable"


# ---------------------------------------------------------------- order: priority, fair share

def test_higher_priority_goes_first_regardless_of_submit_order():
    d = decide([cpu_node("a", 2)], [job("low", 2, seq=1), job("high", 2, priority=5, seq=2)])
    assert set(placed(d)) == {"high"}
    assert d.order == ("high", "low")
    assert reason(d, "low") == "priority"


def test_fair_share_puts_the_user_using_less_first():
    nodes = [cpu_node("a", 8), cpu_node("b", 2)]
    run = [running("r", [("a", 8)], user="alice")]
    d = decide(nodes, [job("alice2", 2, user="alice", seq=1), job("bob1", 2, user="bob", seq=2)], run)
    assert d.order == ("bob1", "alice2")
    assert set(placed(d)) == {"bob1"}
    assert reason(d, "alice2") == "priority"


def test_fair_share_interleaves_users_by_dominant_share():
    # one user's GPUs and another's CPUs are compared by their dominant share
    nodes = [gpu_node("g", 4, "a100", cpus=16)]
    gpu_job = WorkerShape(cpu=1, gpu=1, gpu_type="a100")
    queue = [job(f"a{i}", 1, gpu_job, user="alice", seq=i) for i in range(4)] + \
            [job(f"b{i}", 1, WorkerShape(cpu=4), user="bob", seq=10 + i) for i in range(4)]
    d = decide(nodes, queue)
    # alice's GPU worker takes 1/4 of the GPUs, bob's worker 4/16 = 1/4 of the CPUs: they alternate
    assert d.order[:4] == ("a0", "b0", "a1", "b1")


def test_within_a_user_jobs_keep_submit_order():
    d = decide([cpu_node("a", 1)], [job("second", seq=2), job("first", seq=1)])
    assert d.order == ("first", "second")


# ---------------------------------------------------------------- quotas

@pytest.mark.parametrize("quota, workers, ok", [
    (Quota(cpus=4), 2, True),      # 2 running + 2 = 4
    (Quota(cpus=4), 3, False),     # 2 + 3 > 4
    (Quota(jobs=1), 1, False),     # already one job running
    (Quota(jobs=2), 1, True),
    (Quota(gpus=0), 1, True),      # a CPU job needs no GPU quota
])
def test_quota_makes_a_job_wait_with_reason_quota(quota, workers, ok):
    d = decide([cpu_node("a", 16)], [job("j", workers, user="carol"), job("other", 1, user="dave")],
               [running("r", [("a", 2)], user="carol")], quotas=[("carol", quota)])
    assert ("j" in placed(d)) is ok
    if not ok:
        assert reason(d, "j") == "quota" and "carol" in d.waiting["j"]
    assert "other" in placed(d)  # a job over quota blocks nobody


def test_quota_counts_jobs_placed_in_the_same_cycle():
    d = decide([cpu_node("a", 16)], [job(f"j{i}", 2, user="carol", seq=i) for i in range(4)],
               quotas=[("carol", Quota(cpus=5))])
    assert set(placed(d)) == {"j0", "j1"}
    assert reason(d, "j2") == "quota" and reason(d, "j3") == "quota"


def test_gpu_quota_sends_a_prefer_job_to_cpu():
    d = decide(GPU_NODES, [job("p", 2, WorkerShape(cpu=1, accelerator="prefer"), user="carol")],
               quotas=[("carol", Quota(gpus=1))])
    (p,) = d.placements
    assert p.shape.gpu == 0 and p.placement == (("c", 2),)


# ---------------------------------------------------------------- backfill and estimates

def backfill_case(*queue, run_runtime=100.0):
    """Node a (4 cpus) is half used until t=100; node b (2 cpus) is free. The head needs all of a."""
    nodes = [cpu_node("a", 4), cpu_node("b", 2)]
    run = [running("r", [("a", 2)], started_at=0.0, max_runtime_s=run_runtime)]
    return decide(nodes, [job("head", 4, nodes=1, workers_per_node=4, seq=0), *queue], run, now=10.0)


@pytest.mark.parametrize("candidate, starts, why", [
    (dict(workers=2, max_runtime_s=50.0), True, None),          # ends at 60, before the reserved 100
    (dict(workers=2, max_runtime_s=90.0), True, None),          # ends at exactly 100
    (dict(workers=2, max_runtime_s=200.0), True, None),         # long, but fits on b, which head won't use
    (dict(workers=2), True, None),                              # no runtime, but only b: fine
    (dict(workers=3, max_runtime_s=200.0), False, "reservation"),  # would need a: delays head
    (dict(workers=3), False, "reservation"),                    # no max runtime: never past a reservation
    (dict(workers=3, max_runtime_s=80.0), True, None),          # ends at 90 < 100: backfills on a and b
])
def test_easy_backfill_never_delays_the_reserved_job(candidate, starts, why):
    d = backfill_case(job("small", seq=1, **candidate))
    assert reason(d, "head") == "gang" or reason(d, "head") == "resources"
    assert d.estimated_start["head"] == 100.0
    assert ("small" in placed(d)) is starts
    if why:
        assert reason(d, "small") == why and "head" in d.waiting["small"]


def test_backfilled_jobs_together_still_leave_the_reserved_room():
    d = backfill_case(job("s1", 1, max_runtime_s=500.0, seq=1), job("s2", 2, max_runtime_s=500.0, seq=2),
                      job("s3", 1, max_runtime_s=500.0, seq=3))
    # b has room for two long workers: s1, then s3; s2 (two workers) would need a, kept for head
    assert set(placed(d)) == {"s1", "s3"}
    assert reason(d, "s2") == "reservation"


def test_reservation_without_known_end_drains_the_nodes_it_needs():
    # the running job on a declares no runtime: no start time is known, yet a is kept for head
    d = backfill_case(job("long", 2, seq=1, max_runtime_s=50.0), job("tiny", 1, seq=2), run_runtime=None)
    assert "head" not in d.estimated_start
    assert "first in line" in d.waiting["head"]
    # "long" must not start on a: with no known start even a short job cannot be proven harmless,
    # so it goes to b; "tiny" then finds no room off a
    assert placed(d)["long"] == (("b", 2),)
    assert reason(d, "tiny") == "reservation"


def test_estimated_starts_follow_queue_order_and_declared_runtimes():
    nodes = [cpu_node("a", 2)]
    run = [running("r", [("a", 2)], started_at=0.0, max_runtime_s=100.0)]
    queue = [job("q1", 2, max_runtime_s=30.0, seq=1), job("q2", 1, max_runtime_s=10.0, seq=2),
             job("q3", 2, seq=3), job("q4", 1, seq=4)]
    d = decide(nodes, queue, run, now=5.0)
    assert d.estimated_start == {"q1": 100.0, "q2": 130.0, "q3": 140.0}  # q4 waits on q3, which has no end


# ---------------------------------------------------------------- preemption

def test_higher_priority_preempts_lower_priority_preemptible_jobs_cheapest_first():
    nodes = [cpu_node("a", 4)]
    run = [running("old", [("a", 2)], priority=0, started_at=0.0),
           running("new", [("a", 1)], priority=0, started_at=50.0),
           running("mid", [("a", 1)], priority=3, started_at=60.0)]
    d = decide(nodes, [job("urgent", 2, priority=5)], run, now=100.0)
    # two cpus are needed: the priority-0 jobs go before the priority-3 one; old frees both
    assert set(d.preemptions) in ({"old"},)
    assert d.placements == ()  # it starts once the victims have stopped
    assert "preempting" in d.waiting["urgent"] and "old" in d.waiting["urgent"]


def test_most_recently_started_victim_goes_first():
    nodes = [cpu_node("a", 2)]
    run = [running("early", [("a", 1)], started_at=0.0), running("late", [("a", 1)], started_at=50.0)]
    d = decide(nodes, [job("urgent", 1, priority=1)], run, now=100.0)
    assert d.preemptions == ("late",)


@pytest.mark.parametrize("victim_kw", [
    dict(priority=5),                         # equal priority
    dict(priority=9),                         # higher priority
    dict(priority=0, preemptible=False),      # not preemptible
])
def test_no_preemption_of_equal_higher_or_non_preemptible_jobs(victim_kw):
    d = decide([cpu_node("a", 2)], [job("urgent", 2, priority=5)], [running("r", [("a", 2)], **victim_kw)])
    assert d.preemptions == ()
    assert reason(d, "urgent") == "resources"


def test_jobs_already_being_preempted_are_counted_first_and_not_listed_again():
    nodes = [cpu_node("a", 2), cpu_node("b", 2)]
    run = [running("stopping", [("a", 2)], preempting=True, started_at=0.0),
           running("fresh", [("b", 2)], started_at=90.0)]
    d = decide(nodes, [job("urgent", 2, priority=1)], run, now=100.0)
    assert d.preemptions == ()
    assert "stopping" in d.waiting["urgent"]


def test_resources_kept_for_a_preempting_job_are_not_given_to_others():
    nodes = [cpu_node("a", 4)]
    run = [running("low", [("a", 4)], priority=0)]
    d = decide(nodes, [job("urgent", 2, priority=5, seq=1), job("filler", 2, priority=0, seq=2)], run)
    assert d.preemptions == ("low",)
    assert placed(d) == {}  # low still runs through its grace period: nothing may be placed on a


# ---------------------------------------------------------------- bad input, helpers

@pytest.mark.parametrize("bad, words", [
    (dict(shape=WorkerShape(cpu=1, accelerator="tpu")), "accelerator='tpu'"),
    (dict(shape=WorkerShape(cpu=-1)), "cpu=-1"),
    (dict(shape=WorkerShape(cpu=1, gpu_type="a100")), "gpu_type='a100' with gpu=0"),
    (dict(workers=0), "workers=0"),
    (dict(workers=4, nodes=2), "go together"),
    (dict(workers=5, nodes=2, workers_per_node=2), "does not equal workers=5"),
    (dict(max_runtime_s=0.0), "max_runtime_s=0.0"),
])
def test_a_malformed_job_waits_as_unschedulable_naming_the_value(bad, words):
    bad_job = job("bad", **bad)
    assert words in job_problem(bad_job)
    d = decide([cpu_node("a", 8)], [bad_job, job("good", 1)])
    assert d.waiting["bad"].startswith("unschedulable") and words in d.waiting["bad"]
    assert "good" in placed(d)
    assert not fits_ever(bad_job, (cpu_node("a", 8),))


@pytest.mark.parametrize("inp, words", [
    (SchedulerInput((cpu_node("a", 1), cpu_node("a", 2)), (), ()), "node id 'a' appears twice"),
    (SchedulerInput((NodeView("a", -1, 0, 0),), (), ()), "negative resources"),
    (SchedulerInput((cpu_node("a", 1),), (running("x", [("a", 1)]),), (job("x"),)), "job id 'x' appears twice"),
    (SchedulerInput((), (), (), estimate_limit=-1), "estimate_limit=-1"),
])
def test_unusable_input_raises_invalid_spec(inp, words):
    with pytest.raises(InvalidSpec, match=words):
        schedule(inp)


@pytest.mark.parametrize("the_job, ok", [
    (job("j", 16), True),
    (job("j", 17), False),
    (job("j", 2, WorkerShape(cpu=1, gpu=1)), True),
    (job("j", 2, WorkerShape(cpu=1, gpu=2)), False),
    (job("j", 2, WorkerShape(cpu=1, gpu=2, gpu_type="h100")), False),
    (job("j", 2, nodes=2, workers_per_node=1, labels=(("zone", "a"),)), False),
])
def test_fits_ever_ignores_what_runs_and_what_is_ready(the_job, ok):
    nodes = (cpu_node("a", 8, ready=False), gpu_node("g", 2, "a100", cpus=8, labels=(("zone", "a"),)))
    assert fits_ever(the_job, nodes) is ok


def test_unschedulable_jobs_block_nobody_and_order_lists_every_job():
    d = decide([cpu_node("a", 4)], [job("huge", 9, seq=1), job("ok", 4, seq=2)])
    assert reason(d, "huge") == "unschedulable" and "ok" in placed(d)
    assert sorted(d.order) == ["huge", "ok"]


def test_fifo_baseline_blocks_behind_the_head():
    queue = [job("big", 4, seq=1), job("small", 1, seq=2, max_runtime_s=10.0)]
    run = [running("r", [("a", 2)], max_runtime_s=100.0)]
    assert schedule_fifo(SchedulerInput((cpu_node("a", 4),), tuple(run), tuple(queue))).placements == ()
    assert set(placed(decide([cpu_node("a", 4)], queue, run))) == {"small"}  # ours backfills
