"""The server's reach check of an agent (server/reachability.py) against a real probe (agent/reach.py)."""
import socket

from torchrelay import wire
from torchrelay.agent.reach import ReachProbe
from torchrelay.server.reachability import problem_of


def registration(**fields) -> wire.NodeRegistration:
    return wire.NodeRegistration(name="n", address="127.0.0.1", cpus=1, memory=1, **fields)


def test_an_agent_whose_probe_answers_is_reachable():
    probe = ReachProbe("127.0.0.1")
    try:
        assert problem_of(registration(probe_port=probe.port, probe_token=probe.token)) is None
        # and again: the probe answers every connection
        assert problem_of(registration(probe_port=probe.port, probe_token=probe.token)) is None
    finally:
        probe.close()


def test_an_agent_without_a_probe_is_not_checked():
    assert problem_of(registration()) is None


def test_nobody_listening_is_reported_with_the_address_and_the_reason():
    with socket.socket() as sock:  # a port that was free a moment ago: nobody listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    problem = problem_of(registration(probe_port=port, probe_token="t"))
    assert problem.startswith("unreachable") and f"127.0.0.1:{port}" in problem and "refused" in problem.lower()


def test_another_listener_on_that_address_is_not_taken_for_the_agent():
    probe = ReachProbe("127.0.0.1")  # some other agent's: another token
    try:
        problem = problem_of(registration(probe_port=probe.port, probe_token="not-" + probe.token))
        assert problem is not None and "something other than this agent" in problem
    finally:
        probe.close()
