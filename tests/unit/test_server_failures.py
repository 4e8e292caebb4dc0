"""Whom a failed attempt blames and whether it restarts, as tables. No database, no processes."""
import signal

import pytest

from torchrelay.server.failures import FailureAction, blame, decide_failure, outside_the_job
from torchrelay.server.views import LaunchView
from torchrelay.spec import LaunchState
from torchrelay.wire import FailureInfo


def failed(node_rank, ranks, stopped=False, message="", node_name=None, infra=False):
    name = node_name if node_name is not None else f"node{node_rank}"
    return LaunchView(id=f"job-1-a2-n{node_rank}", attempt=2, node_id=f"n{node_rank}", node_name=name,
                      node_rank=node_rank, state=LaunchState.EXITED, succeeded=False, stopped=stopped,
                      message=message, ranks=tuple(ranks), infra=infra)


LOST = dict(infra=True, message="node node0 lost (no heartbeat for 3 s)")


@pytest.mark.parametrize("launches, reason, rank, node", [
    # one launch: its first failed rank is the root cause, those after it were torn down for it
    ([failed(0, [{"rank": 1, "exit_code": 5}, {"rank": 0, "signal": 15}])], "rank 1 exited with code 5", 1, "node0"),
    # a rank that returned is not blamed, whatever happened in teardown
    ([failed(0, [{"rank": 0, "signal": 6, "returned": True}, {"rank": 1, "exit_code": 2}])],
     "rank 1 exited with code 2", 1, "node0"),
    # a launch the server stopped (a peer failed) explains nothing while another does
    ([failed(0, [{"rank": 0, "signal": 15}], stopped=True), failed(1, [{"rank": 2, "exit_code": 3}])],
     "rank 2 exited with code 3", 2, "node1"),
    # ...but it does when nothing else does
    ([failed(1, [{"rank": 2, "signal": int(signal.SIGKILL)}], stopped=True)], "rank 2 was killed by SIGKILL", 2,
     "node1"),
    # two launches' root causes: the lower node_rank
    ([failed(1, [{"rank": 2, "exit_code": 4}]), failed(0, [{"rank": 0, "exit_code": 3}])],
     "rank 0 exited with code 3", 0, "node0"),
    # a root cause beats a torn-down rank of a lower node
    ([failed(0, [{"rank": 0, "exit_code": 1}, {"rank": 1, "exit_code": 1}]), failed(1, [{"rank": 2, "exit_code": 9}])],
     "rank 0 exited with code 1", 0, "node0"),
    # mpirun tore node 0's ranks down because rank 3 exited on node 1, whose launch the server had
    # already stopped when its report arrived: the rank that failed by itself is still blamed
    ([failed(0, [{"rank": 1, "signal": 15}, {"rank": 0, "signal": 15}]),
      failed(1, [{"rank": 3, "exit_code": 3}, {"rank": 2, "signal": 15}], stopped=True)],
     "rank 3 exited with code 3", 3, "node1"),
    # ...and when node 0's mpirun reported one rank torn down and one with no exit record at all
    ([failed(0, [{"rank": 0, "signal": 15}, {"rank": 1}]),
      failed(1, [{"rank": 3, "exit_code": 3}, {"rank": 2, "signal": 15}], stopped=True)],
     "rank 3 exited with code 3", 3, "node1"),
    # a fault (SIGSEGV) is a failure of its own, not a teardown
    ([failed(0, [{"rank": 0, "signal": 15}]), failed(1, [{"rank": 2, "signal": 11}])],
     "rank 2 was killed by SIGSEGV", 2, "node1"),
    ([failed(0, [{"rank": 0, "signal": 200}])], "rank 0 was killed by signal 200", 0, "node0"),
    # a rank that never ran: the launch's message says why
    ([failed(0, [{"rank": 0}], message="torchrun exited with 1: RendezvousTimeoutError")],
     "rank 0 did not run: torchrun exited with 1: RendezvousTimeoutError", 0, "node0"),
    ([failed(0, [{"rank": 0}])], "rank 0 did not run: no exit status", 0, "node0"),
    # no rank at all: the launch's message, else where it ran
    ([failed(0, [], message="the agent no longer runs this launch")], "the agent no longer runs this launch", None,
     "node0"),
    ([failed(0, [])], "launch on node node0 failed", None, "node0"),
    # a node was lost and its peer stopped for it: the loss explains the attempt
    ([failed(0, [], **LOST), failed(1, [{"rank": 1}], stopped=True, message="stopped: rank 1: no exit record")],
     "node node0 lost (no heartbeat for 3 s)", None, "node0"),
    # ...but a rank that failed by itself still does
    ([failed(0, [], **LOST), failed(1, [{"rank": 1, "exit_code": 3}])], "rank 1 exited with code 3", 1, "node1"),
])
def test_blame(launches, reason, rank, node):
    info = blame(launches, attempt=2)
    assert (info.reason, info.rank, info.node, info.attempt) == (reason, rank, node, 2)


@pytest.mark.parametrize("launches, outside", [
    ([failed(0, [], **LOST)], True),
    # a lost node's peers, stopped by the server because of it: still no fault of the job
    ([failed(0, [], **LOST), failed(1, [{"rank": 1, "signal": 15}], stopped=True)], True),
    # a peer that failed by itself is the job's own failure
    ([failed(0, [], **LOST), failed(1, [{"rank": 1, "exit_code": 3}])], False),
    # stopped launches without any lost node: the job's (a peer failed)
    ([failed(1, [{"rank": 1, "signal": 15}], stopped=True)], False),
    ([failed(0, [{"rank": 0, "exit_code": 1}])], False),
])
def test_outside_the_job(launches, outside):
    assert outside_the_job(launches) is outside


def test_blame_carries_the_ranks_exit_and_last_lines():
    info = blame([failed(0, [{"rank": 0, "exit_code": 3, "last_lines": ["boom"]}])], attempt=1)
    assert (info.exit_code, info.signal, info.last_lines) == (3, None, ["boom"])


@pytest.mark.parametrize("infra_only, restarts, max_restarts, action, counted, message", [
    (False, 0, 1, FailureAction.RESTART, True, "restart 1 of 1: why"),
    (False, 1, 1, FailureAction.FAIL, False, "why"),
    (False, 0, 0, FailureAction.FAIL, False, "why"),
    (False, 3, 7, FailureAction.RESTART, True, "restart 4 of 7: why"),
    (True, 0, 0, FailureAction.RESTART, False, "why; restarting elsewhere (not counted against max_restarts)"),
    (True, 9, 1, FailureAction.RESTART, False, "why; restarting elsewhere (not counted against max_restarts)"),
])
def test_decide_failure(infra_only, restarts, max_restarts, action, counted, message):
    failure = FailureInfo(reason="why", rank=3)
    decision = decide_failure(failure, infra_only=infra_only, restarts=restarts, max_restarts=max_restarts)
    assert (decision.action, decision.counted, decision.message) == (action, counted, message)
    assert decision.failure is failure and decision.blamed_rank == 3
