"""The control loop's deadlines as tables: views and a time in, decisions out. No database, no processes."""
import math

import pytest

from torchrelay.server import watchdogs
from torchrelay.server.views import NodeLiveness, ProgressView, RuntimeView, StopKind
from torchrelay.spec import LaunchState, NodeState


@pytest.mark.parametrize("now, last, interval, due", [
    (100.0, -math.inf, 0.25, True), (100.0, 100.0, 0.25, False), (100.2, 100.0, 0.25, False),
    (100.25, 100.0, 0.25, True), (99.0, 100.0, 0.25, True),  # a clock set back: run
])
def test_checks_due(now, last, interval, due):
    assert watchdogs.checks_due(now, last, interval) is due


def node(id, last_seen, state=NodeState.READY):
    return NodeLiveness(id=id, name=f"name-{id}", state=state, last_seen=last_seen)


@pytest.mark.parametrize("nodes, now, lost", [
    ([node("a", 90.0)], 100.0, []),  # exactly at the timeout: not yet
    ([node("a", 89.9)], 100.0, ["a"]),
    ([node("a", 50.0, NodeState.LOST), node("b", 95.0), node("c", 80.0)], 100.0, ["c"]),
    ([node("a", 50.0, NodeState.DRAINING)], 100.0, []),
    ([], 100.0, []),
])
def test_lost_nodes(nodes, now, lost):
    found = watchdogs.lost_nodes(nodes, now=now, timeout_s=10)
    assert [x.node_id for x in found] == lost
    assert all(x.message == f"node name-{x.node_id} lost (no heartbeat for 10 s)" for x in found)


def progress(seq, last, timeout=30.0, attempt=1):
    return ProgressView(seq=seq, attempt=attempt, last_progress_at=last, hang_timeout_s=timeout)


@pytest.mark.parametrize("jobs, now, hung", [
    ([progress(1, 70.0)], 100.0, []),  # 30 s: not past the timeout
    ([progress(1, 69.0)], 100.0, [1]),
    ([progress(1, None)], 1e9, []),  # no metric yet: never hung
    ([progress(1, 0.0, timeout=0)], 1e9, []),  # 0: never
    ([progress(1, 0.0), progress(2, 99.0), progress(3, 10.0, timeout=100)], 100.0, [1]),
])
def test_hung_jobs(jobs, now, hung):
    assert [h.seq for h in watchdogs.hung_jobs(jobs, now=now)] == hung


def test_a_hang_stops_and_explains_the_attempt():
    (hang,) = watchdogs.hung_jobs([progress(4, 0.0, timeout=30, attempt=2)], now=100.0)
    assert hang.stop.kind == StopKind.HANG and hang.stop.reason == "no progress for 30 s (hung worker?)"
    assert hang.failure.reason == hang.stop.reason and hang.failure.attempt == 2
    assert hang.event == "no metric for 30 s: stopping attempt 2"


def runtime(seq, placed_at, limit=30.0, requeue=False, stoppable=True, attempt=1):
    return RuntimeView(seq=seq, attempt=attempt, max_runtime_s=limit, placed_at=placed_at, requeue=requeue,
                       stoppable=stoppable)


@pytest.mark.parametrize("jobs, now, over", [
    ([runtime(1, 70.0)], 100.0, []),  # exactly its limit: not over
    ([runtime(1, 69.0)], 100.0, [1]),
    ([runtime(1, None)], 1e9, []),  # never placed
    ([runtime(1, 0.0, requeue=True)], 100.0, []),  # being preempted: its own stop ends it
    ([runtime(1, 0.0, stoppable=False)], 100.0, []),  # already told to stop: no second event
    ([runtime(1, 0.0), runtime(2, 90.0), runtime(3, 0.0, limit=1000)], 100.0, [1]),
])
def test_overruns(jobs, now, over):
    assert [seq for seq, _ in watchdogs.overruns(jobs, now=now)] == over


def test_an_overrun_says_its_limit_and_how_long_the_attempt_ran():
    ((seq, stop),) = watchdogs.overruns([runtime(7, 10.0, limit=30, attempt=3)], now=41.4)
    assert seq == 7 and stop.kind == StopKind.RUNTIME
    assert stop.reason == "ran past max_runtime_s=30 s (attempt 3 ran 31 s)"


@pytest.mark.parametrize("live, reported, forgotten", [
    ([("a", LaunchState.RUNNING)], {"a"}, []),
    ([("a", LaunchState.RUNNING)], set(), ["a"]),
    ([("a", LaunchState.PREPARING), ("b", LaunchState.PENDING)], set(), ["a"]),  # b: not acknowledged yet
    ([("a", LaunchState.PENDING)], set(), []),
])
def test_forgotten_launches(live, reported, forgotten):
    assert watchdogs.forgotten_launches(live, reported) == forgotten
