"""Which network interface holds an address, and which address of this host routes to a peer.

Workers must talk over the interface of the address their agent advertises: gloo, TensorPipe
and NCCL otherwise take the address the host name resolves to, often loopback, and a job across
hosts fails with "connectFullMesh failed … remote=[127.0.0.1]" (docs/design.md, gloo and host
addresses). ``interface_env(address)`` is the environment that pins them; ``transport_env`` is what a
launch gets (that, an operator's interface from a node label or the agent's own environment,
and ``RELAY_PS_HOST``); ``check_advertised`` refuses an address no interface here holds.

The addresses come from psutil (``getifaddrs``: every address of an interface, secondary ones
too, which the ``SIOCGIFADDR`` ioctl does not give). IPv4 only, which is what the agents
advertise.
"""
from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

import psutil

__all__ = ["interface_addresses", "interface_of", "interface_env", "route_address", "check_advertised",
           "transport_env", "SOCKET_IFNAME_VARS", "IFNAME_LABEL"]

# the variables through which each transport is told its interface
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")

# the node label that names the interface workers use, over the one that holds the address
IFNAME_LABEL = "socket_ifname"

Addresses = dict[str, tuple[str, ...]]  # interface name -> its IPv4 addresses


def interface_addresses() -> Addresses:
    """``{interface name: (IPv4 address, ...)}`` for every interface of this host that has one."""
    out = {}
    for name, entries in psutil.net_if_addrs().items():
        found = tuple(e.address for e in entries if e.family == socket.AF_INET)
        if found:
            out[name] = found
    return out


def interface_of(address: str, addresses: Addresses | None = None) -> str | None:
    """The interface holding ``address`` (``addresses``: as ``interface_addresses`` returns), or None.

    A name that is not an IP literal is resolved first. Pure when ``addresses`` is given and
    ``address`` is a literal.
    """
    try:
        ip = str(ipaddress.ip_address(address))
    except ValueError:
        try:
            ip = socket.gethostbyname(address)
        except OSError:
            return None
    table = interface_addresses() if addresses is None else addresses
    return next((name for name, held in table.items() if ip in held), None)


def interface_env(address: str, addresses: Addresses | None = None) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` and its TensorPipe and NCCL twins for the interface of ``address``.

    Empty when ``address`` is on loopback (every transport finds loopback by itself on one
    host) or held by no interface here (nothing to pin; the agent reports that elsewhere).
    """
    table = interface_addresses() if addresses is None else addresses
    name = interface_of(address, table)
    if name is None or name == _loopback(table):
        return {}
    return {var: name for var in SOCKET_IFNAME_VARS}


def route_address(server_url: str) -> str:
    """The address of this host that the route to ``server_url`` leaves from.

    Connects a UDP socket (no packet is sent) and reads its local end. Raises ``OSError``
    when no route reaches the server's host.
    """
    parts = urlsplit(server_url if "//" in server_url else f"//{server_url}")
    host = parts.hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((socket.gethostbyname(host), parts.port or 80))
        return sock.getsockname()[0]


def _loopback(table: Addresses) -> str | None:
    return next((name for name, held in table.items() if any(ipaddress.ip_address(a).is_loopback for a in held)),
                None)


def check_advertised(address: str, addresses: Addresses | None = None) -> str:
    """The interface that holds ``address``, the one an agent advertises. Raises ``ValueError``
    naming the address and the interfaces this host has when none holds it (its workers could
    not listen there, and peers would wait on an address nobody answers). Pure when
    ``addresses`` is given and ``address`` is a literal."""
    table = interface_addresses() if addresses is None else addresses
    name = interface_of(address, table)
    if name is None:
        held = ", ".join(f"{n} {' '.join(a)}" for n, a in sorted(table.items())) or "none with an IPv4 address"
        raise ValueError(f"--host {address!r} is on none of this host's interfaces ({held}); give one of "
                         "these addresses, or leave --host out to advertise the one that routes to the server")
    return name


def transport_env(address: str, *, labels: dict[str, str], agent_env: dict[str, str],
                  addresses: Addresses | None = None) -> dict[str, str]:
    """What every launch of an agent advertising ``address`` gets for its transports. Pure when
    ``addresses`` is given.

    The socket interface variables name, first found: the node label ``socket_ifname``; what
    the agent's own environment already sets (an operator's choice, left as it is, so not
    repeated here); the interface holding ``address`` (none on loopback). ``RELAY_PS_HOST`` is
    ``address``: parameter servers listen and publish there. A job's ``env`` wins over all of
    these (it is applied after them, ``commands.build_worker_env``).
    """
    env = {"RELAY_PS_HOST": address}
    label = labels.get(IFNAME_LABEL)
    if label:
        env.update({var: label for var in SOCKET_IFNAME_VARS})
        return env
    env.update({var: name for var, name in interface_env(address, addresses).items() if var not in agent_env})
    return env
