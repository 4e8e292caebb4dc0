"""Free TCP ports for services that take a port number rather than 0 (PostgreSQL, RabbitMQ,
Ceph, Slurm).

``free_ports(count)`` returns ``count`` distinct ports on 127.0.0.1 that nothing listens on now,
picked below the kernel's ephemeral range (``net.ipv4.ip_local_port_range``). Why not
``bind(0)``: that hands out an ephemeral port, which between the pick and the service's own
bind any outgoing connection on the machine may take as its source port — including the
test's own "is it up yet?" polls, which on loopback can connect a socket to itself when its
source port equals the destination (TCP simultaneous open) — and the service then fails with
EADDRINUSE. Ports below the range are never handed out as source ports.
"""
from __future__ import annotations

import random
import socket

_LOWEST = 10_000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def free_ports(count: int = 1) -> list[int]:
    """``count`` distinct free ports below the ephemeral range; raises RuntimeError if none is found."""
    high = _ephemeral_low()
    found: list[int] = []
    rng = random.Random()
    for _ in range(2_000):
        port = rng.randrange(_LOWEST, high) if high > _LOWEST + count else rng.randrange(1_024, 65_536)
        if port in found:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        found.append(port)
        if len(found) == count:
            return found
    raise RuntimeError(f"no {count} free TCP port(s) found on 127.0.0.1 in {_LOWEST}..{high}")


def free_port() -> int:
    """One free port below the ephemeral range (see ``free_ports``)."""
    return free_ports(1)[0]
