"""What the agent does with a heartbeat reply (``plan_reconcile``), case by case."""
from __future__ import annotations

import pytest

from torchrelay import wire
from torchrelay.agent.reconcile import LaunchState, plan_reconcile

pytestmark = pytest.mark.timeout(30)

P, R, X = LaunchState.PREPARING, LaunchState.RUNNING, LaunchState.EXITED


def a(launch_id, desired="run"):
    return wire.LaunchAssignment(launch_id=launch_id, job_id="J", attempt=0, desired=desired, node_rank=0, nnodes=1,
                                 nproc_per_node=1, world_size=1, rank_offset=0, entrypoint=["python", "x.py"],
                                 bundle=None, store_url="/s", job_store_prefix="jobs/J")


@pytest.mark.parametrize("held, done, wanted, owed, start, update, stop, never_ran, forget", [
    ({}, set(), [], set(), [], [], [], [], []),
    ({}, set(), [a("L")], set(), ["L"], [], [], [], []),                          # new: started
    ({"L": R}, set(), [a("L")], set(), [], ["L"], [], [], []),                    # held: the newer assignment
    ({}, {"L"}, [a("L")], set(), [], [], [], [], []),                             # let go of: not again
    ({"L": R}, set(), [a("L", "stop")], set(), [], ["L"], ["L"], [], []),        # stop, with its grace
    ({"L": R}, set(), [], set(), [], [], ["L"], [], []),                         # no longer listed: stopped
    ({}, set(), [a("L", "stop")], set(), [], [], [], ["L"], []),                 # never had it: say so
    ({}, {"L"}, [a("L", "stop")], set(), [], [], [], [], []),                    # ...once
    ({"L": X}, set(), [], set(), [], [], ["L"], [], ["L"]),                      # exited, all delivered: forgotten
    ({"L": X}, set(), [], {"L"}, [], [], ["L"], [], []),                         # its lines still owed: kept
    ({"L": X}, set(), [a("L")], set(), [], ["L"], [], [], []),                   # the server still wants it
    ({"L": X}, set(), [a("L", "stop")], set(), [], ["L"], ["L"], [], ["L"]),
    ({"L": P, "M": R}, set(), [a("M"), a("N")], set(), ["N"], ["M"], ["L"], [], []),
])
def test_plan_reconcile(held, done, wanted, owed, start, update, stop, never_ran, forget):
    plan = plan_reconcile(held=held, done=done, wanted=wanted, owed=owed)
    assert [x.launch_id for x in plan.start] == start
    assert [x.launch_id for x in plan.update] == update
    assert (plan.stop, plan.never_ran, plan.forget) == (stop, never_ran, forget)
