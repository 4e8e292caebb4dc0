"""Can peers reach a node? The server connects to the agent's reach probe before it places work.

An agent that holds its address may still be out of its peers' reach; a job placed there would
end in a gloo time-out naming no cause. At registration the server connects to the probe the
agent opened on its advertised address (``torchrelay.agent.reach``) and reads its greeting:
``problem_of(registration)`` is None when that worked (or the agent has no probe: an older
agent, a test's fake), else the reason, worded for ``relay nodes``. The node then stays READY
but gets no work (``rows.node_facts``) until it registers again and the probe answers.

Blocks up to ``timeout_s`` (a connection that is silently dropped); call it outside the store's
writer lock. The server is one peer among the hosts: what it cannot reach, workers on other
hosts most likely cannot either, and a node it can reach is not proven reachable from every
host (docs/deployment.md lists the ports to open).
"""
from __future__ import annotations

import socket

from torchrelay.wire import NodeRegistration, reach_greeting

__all__ = ["problem_of"]


def problem_of(reg: NodeRegistration, timeout_s: float = 3.0) -> str | None:
    """None when the agent's probe at ``reg.address``:``reg.probe_port`` answered with its
    token; else why not (see the module docstring)."""
    if reg.probe_port is None or reg.probe_token is None:
        return None
    where = f"{reg.address}:{reg.probe_port}"
    expected = reach_greeting(reg.probe_token)
    try:
        with socket.create_connection((reg.address, reg.probe_port), timeout=timeout_s) as conn:
            got = b""
            while len(got) < len(expected):
                chunk = conn.recv(len(expected) - len(got))
                if not chunk:
                    break
                got += chunk
    except (OSError, ValueError, UnicodeError) as exc:  # ValueError/UnicodeError: a name no resolver takes
        reason = getattr(exc, "strerror", None) or f"{type(exc).__name__}: {exc}"
        return (f"unreachable: the server cannot connect to {where} ({reason}); other hosts must reach "
                f"{reg.address} for this node's workers to join a job: check the agent's --host and the "
                "firewall, then restart the agent")
    if got != expected:
        return (f"unreachable: {where} answered as something other than this agent (another host or "
                f"process holds {reg.address} there, e.g. loopback); give the agent an address other hosts "
                "reach it at (--host)")
    return None
