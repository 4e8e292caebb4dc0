"""Launch and node states: their tables beside JobState's, and the server's decision modules stay pure."""
import ast
from pathlib import Path

import pytest

from torchrelay.errors import Conflict
from torchrelay.spec import (LAUNCH_TRANSITIONS, NODE_TRANSITIONS, LaunchState, NodeState, can_launch_transition,
                             can_node_transition, check_launch_transition, check_node_transition)

L, N = LaunchState, NodeState
LAUNCH = (can_launch_transition, check_launch_transition, "launch job-7-a1-n0")
NODE = (can_node_transition, check_node_transition, "node node-9")
# (which table, from, to, legal)
CASES = [(LAUNCH, a, b, True) for a, b in [
    (L.PENDING, L.PREPARING), (L.PENDING, L.RUNNING), (L.PENDING, L.EXITED), (L.PREPARING, L.RUNNING),
    (L.PREPARING, L.EXITED), (L.RUNNING, L.EXITED)]]
CASES += [(LAUNCH, a, b, False) for a, b in [
    (L.RUNNING, L.PREPARING), (L.RUNNING, L.PENDING), (L.EXITED, L.RUNNING), (L.EXITED, L.PENDING),
    (L.PREPARING, L.PENDING), (L.RUNNING, L.RUNNING)]]
CASES += [(NODE, a, b, True) for a, b in [
    (N.READY, N.LOST), (N.LOST, N.READY), (N.READY, N.DRAINING), (N.DRAINING, N.READY), (N.DRAINING, N.LOST)]]
CASES += [(NODE, a, b, False) for a, b in [(N.LOST, N.DRAINING), (N.READY, N.READY), (N.LOST, N.LOST)]]


@pytest.mark.parametrize("table, a, b, legal", CASES)
def test_transitions_are_refused_naming_the_record_and_both_states(table, a, b, legal):
    can, check, what = table
    assert can(a, b) is legal
    if legal:
        check(what.split()[1], a, b)
    else:
        with pytest.raises(Conflict) as err:
            check(what.split()[1], a, b)
        assert what in str(err.value) and a.value in str(err.value) and b.value in str(err.value)


def test_an_exited_launch_has_no_exit():
    assert not LAUNCH_TRANSITIONS[L.EXITED]
    with pytest.raises(Conflict, match="none \\(terminal\\)"):
        check_launch_transition("x", L.EXITED, L.RUNNING)


def test_every_state_has_a_row_and_the_values_are_the_wire_strings():
    assert set(LAUNCH_TRANSITIONS) == set(L) and set(NODE_TRANSITIONS) == set(N)
    assert [s.value for s in L] == ["pending", "preparing", "running", "exited"]
    assert [s.value for s in N] == ["READY", "LOST", "DRAINING"]


SERVER = Path(__file__).resolve().parents[2] / "torchrelay" / "server"
PURE = ["lifecycle", "failures", "watchdogs", "views", "scheduling", "assignment", "executors/slurm_batch",
        "executors/slurm_status"]
IMPURE = ("sqlalchemy", "fastapi", "starlette", "uvicorn", "time", "subprocess", "torchrelay.server.rows",
          "torchrelay.server.store", "torchrelay.server.control", "torchrelay.server.service")


@pytest.mark.parametrize("module", PURE)
def test_decision_modules_import_no_database_web_or_clock(module):
    tree = ast.parse((SERVER / f"{module}.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    bad = [m for m in imported if any(m == x or m.startswith(x + ".") for x in IMPURE)]
    assert not bad, f"torchrelay.server.{module} imports {bad}"
