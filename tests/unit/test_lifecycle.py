"""The job lifecycle as a table: job and launch views in, a JobDecision out. No database, no processes."""
import pytest

from torchrelay.server import lifecycle
from torchrelay.server.failures import FailureAction
from torchrelay.server.lifecycle import NOTHING, Transition
from torchrelay.server.views import JobView, LaunchView, Stop, StopKind
from torchrelay.spec import JobState, LaunchState
from torchrelay.wire import FailureInfo

S, L = JobState, LaunchState
OK = [{"rank": 0, "exit_code": 0, "returned": True}]
CODE_3 = [{"rank": 0, "exit_code": 3, "last_lines": ["boom"]}]


def job(state=S.RUNNING, **kw):
    return JobView(id="job-1", state=state, attempt=kw.pop("attempt", 1), **kw)


def launch(state=L.RUNNING, node_rank=0, **kw):
    return LaunchView(id=f"job-1-a1-n{node_rank}", attempt=1, node_id=f"n{node_rank}", node_name=f"node{node_rank}",
                      node_rank=node_rank, state=state, **kw)


def exited(ok=True, node_rank=0, ranks=None, **kw):
    ranks = ranks if ranks is not None else (OK if ok else CODE_3)
    return launch(L.EXITED, node_rank, succeeded=ok, ranks=tuple(ranks), **kw)


def states(decision):
    return [(t.state, t.message) for t in decision.transitions]


@pytest.mark.parametrize("view, launches, expected", [
    # (job view, its attempt's launches, the transitions decided)
    (job(S.QUEUED), [launch()], []),
    (job(S.SUCCEEDED), [exited()], []),
    (job(S.SCHEDULED), [], []),
    (job(S.SCHEDULED), [launch(L.PENDING)], []),
    (job(S.SCHEDULED), [launch(L.PREPARING)], []),
    (job(S.SCHEDULED), [launch(L.RUNNING)], [(S.RUNNING, "attempt 1 running")]),
    (job(S.RESTARTING, attempt=2), [launch(L.RUNNING)], [(S.RUNNING, "attempt 2 running")]),
    (job(S.RUNNING), [launch(L.RUNNING)], []),
    (job(S.RUNNING), [exited()], [(S.SUCCEEDED, "every rank finished")]),
    (job(S.SCHEDULED), [exited()], [(S.RUNNING, "started"), (S.SUCCEEDED, "every rank finished")]),
    (job(S.RESTARTING), [exited()], [(S.SUCCEEDED, "every rank finished")]),
    (job(S.RUNNING), [exited(), launch(node_rank=1)], []),  # one node done, the other still runs
    (job(S.CANCELLING), [exited(False)], [(S.CANCELLED, "all workers stopped")]),
    (job(S.CANCELLING), [exited(), launch(node_rank=1)], []),
    (job(S.RUNNING, requeue=True), [exited(False, stopped=True)], [(S.QUEUED, "requeued after preemption")]),
    (job(S.RUNNING, requeue=True), [launch(desired="stop")], []),
    (job(S.SCHEDULED, requeue=True), [launch()], [(S.RUNNING, "attempt 1 running")]),
])
def test_transitions(view, launches, expected):
    assert states(lifecycle.decide(view, launches)) == expected


def test_nothing_to_decide_is_the_shared_empty_decision():
    assert lifecycle.decide(job(S.QUEUED), [launch()]) is NOTHING
    assert lifecycle.decide(job(S.RUNNING), []) is NOTHING


def test_success_clears_an_earlier_failure():
    decision = lifecycle.decide(job(), [exited()])
    assert decision.clears_failure and decision.failure is None and decision.stop is None


def test_requeue_done_only_once_every_launch_exited():
    assert lifecycle.decide(job(requeue=True), [exited(False), launch(node_rank=1)]).requeued is False
    assert lifecycle.decide(job(requeue=True), [exited(False), exited(False, node_rank=1)]).requeued is True


def test_a_failed_launch_stops_its_peers_and_records_the_blamed_rank():
    decision = lifecycle.decide(job(max_restarts=1), [exited(False), launch(node_rank=1)])
    assert decision.transitions == ()
    assert decision.stop == Stop(kind=StopKind.ATTEMPT_FAILED, reason="attempt 1 failed: rank 0 exited with code 3")
    assert decision.failure.rank == 0 and decision.failure.node == "node0" and decision.restart is None


@pytest.mark.parametrize("restarts, max_restarts, infra, expected_state, counted, message", [
    (0, 2, False, S.RESTARTING, True, "restart 1 of 2: rank 0 exited with code 3"),
    (1, 2, False, S.RESTARTING, True, "restart 2 of 2: rank 0 exited with code 3"),
    (2, 2, False, S.FAILED, None, "rank 0 exited with code 3"),
    (0, 0, False, S.FAILED, None, "rank 0 exited with code 3"),
    (0, 0, True, S.RESTARTING, False,
     "rank 0 exited with code 3; restarting elsewhere (not counted against max_restarts)"),
    (5, 5, True, S.RESTARTING, False,
     "rank 0 exited with code 3; restarting elsewhere (not counted against max_restarts)"),
])
def test_once_all_exited_a_failure_restarts_or_fails(restarts, max_restarts, infra, expected_state, counted, message):
    decision = lifecycle.decide(job(restarts=restarts, max_restarts=max_restarts), [exited(False, infra=infra)])
    assert states(decision) == [(expected_state, message)]
    assert decision.stop is None  # nothing runs any more
    assert decision.failure.reason == "rank 0 exited with code 3"
    if counted is None:
        assert decision.restart is None
    else:
        assert decision.restart.action == FailureAction.RESTART and decision.restart.counted is counted


def test_a_hung_attempt_keeps_the_hang_as_its_failure():
    hang = FailureInfo(reason="no progress for 30 s (hung worker?)", attempt=1)
    decision = lifecycle.decide(job(max_restarts=1, hung_failure=hang), [exited(False, stopped=True,
                                                                              ranks=[{"rank": 0, "signal": 9}])])
    assert decision.failure == hang
    assert states(decision) == [(S.RESTARTING, "restart 1 of 1: no progress for 30 s (hung worker?)")]


def test_a_runtime_stop_ends_failed_whatever_the_exit_codes():
    reason = "ran past max_runtime_s=30 s (attempt 1 ran 31 s)"
    stopping = launch(desired="stop", stop_kind=StopKind.RUNTIME, stop_reason=reason)
    assert states(lifecycle.decide(job(max_restarts=3), [stopping])) == []
    done = exited(True, desired="stop", stop_kind=StopKind.RUNTIME, stop_reason=reason, stopped=True)
    decision = lifecycle.decide(job(max_restarts=3), [done])
    assert states(decision) == [(S.FAILED, reason)] and decision.failure == FailureInfo(reason=reason, attempt=1)
    assert decision.restart is None


def test_only_the_stop_kind_marks_a_runtime_stop_not_the_wording():
    look_alike = exited(False, desired="stop", stop_kind=StopKind.CANCEL, stop_reason="ran past max_runtime_s=1 s")
    assert states(lifecycle.decide(job(), [look_alike]))[0][0] == S.FAILED
    assert lifecycle.decide(job(), [look_alike]).failure.reason == "rank 0 exited with code 3"


@pytest.mark.parametrize("state, live, checkpoint, expected, stop, kill_at_once", [
    (S.QUEUED, False, True, [(S.CANCELLED, "cancelled by user")], None, False),
    (S.RESTARTING, False, True, [(S.CANCELLING, "cancelled by user"), (S.CANCELLED, "no process was running")],
     None, False),
    (S.RESTARTING, True, True, [(S.CANCELLING, "cancel requested")], "job cancelled", False),
    (S.SCHEDULED, True, True, [(S.CANCELLING, "cancel requested")], "job cancelled", False),
    (S.RUNNING, True, False, [(S.CANCELLING, "cancel requested (no checkpoint: workers killed at once)")],
     "job cancelled", True),
    (S.CANCELLING, True, True, [], None, False),
    (S.SUCCEEDED, False, True, [], None, False),
    (S.CANCELLED, False, False, [], None, False),
])
def test_cancel(state, live, checkpoint, expected, stop, kill_at_once):
    decision = lifecycle.cancel(state, has_live_launches=live, checkpoint=checkpoint)
    assert [(t.state, t.message) for t in decision.transitions] == expected
    assert (decision.stop.reason if decision.stop else None) == stop
    assert decision.stop is None or decision.stop.kind == StopKind.CANCEL
    assert decision.kill_at_once is kill_at_once


@pytest.mark.parametrize("state, stops", [(S.QUEUED, False), (S.SCHEDULED, True), (S.RUNNING, True),
                                          (S.RESTARTING, True), (S.CANCELLING, False), (S.FAILED, False)])
def test_preemption(state, stops):
    stop = lifecycle.preemption(state)
    assert (stop is not None) is stops
    assert stop is None or stop == Stop(kind=StopKind.PREEMPT, reason="preempted by a higher-priority job")


@pytest.mark.parametrize("current, reported, expected", [
    (L.PENDING, L.PREPARING, L.PREPARING),
    (L.PENDING, L.RUNNING, L.RUNNING),
    (L.PENDING, L.EXITED, L.EXITED),
    (L.PREPARING, L.RUNNING, L.RUNNING),
    (L.PREPARING, L.PREPARING, None),  # a resend
    (L.RUNNING, L.PREPARING, None),  # a late resend never moves it back
    (L.RUNNING, L.RUNNING, None),
    (L.RUNNING, L.EXITED, L.EXITED),
    (L.EXITED, L.RUNNING, None),
    (L.EXITED, L.EXITED, None),  # a resent exit changes nothing
])
def test_launch_update(current, reported, expected):
    assert lifecycle.launch_update(current, reported) == expected


@pytest.mark.parametrize("reported, desired, succeeded, expected", [
    (True, "run", False, True), (False, "stop", False, True), (False, "stop", True, False),
    (False, "run", False, False), (True, "stop", True, True),
])
def test_stopped_by_server(reported, desired, succeeded, expected):
    assert lifecycle.stopped_by_server(reported_stopped=reported, desired=desired, succeeded=succeeded) is expected


def test_a_decision_is_idempotent_once_carried_out():
    """Carrying out a decision on the views and asking again decides nothing new."""
    view, launches = job(S.SCHEDULED), [exited()]
    first = lifecycle.decide(view, launches)
    after = JobView(id=view.id, state=first.transitions[-1].state, attempt=view.attempt)
    assert first.transitions[-1] == Transition(S.SUCCEEDED, "every rank finished")
    assert lifecycle.decide(after, launches) is NOTHING
