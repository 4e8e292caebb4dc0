"""Which network interface holds an address, and which address of this host routes to a peer.

Workers must talk over the interface of the address their agent advertises: gloo, TensorPipe
and NCCL otherwise take the address the host name resolves to, often loopback, and a job across
hosts fails with "connectFullMesh failed … remote=[127.0.0.1]" (docs/design.md, gloo and host
addresses). ``interface_env(address)`` is the environment that pins them.

Written on the standard library (``socket.if_nameindex`` and the ``SIOCGIFADDR`` ioctl, Linux)
rather than adding psutil for two lookups. IPv4 only, which is what the agents advertise.
"""
from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from urllib.parse import urlsplit

__all__ = ["interface_addresses", "interface_of", "interface_env", "route_address", "SOCKET_IFNAME_VARS"]

# the variables through which each transport is told its interface
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")

_SIOCGIFADDR = 0x8915


def interface_addresses() -> dict[str, str]:
    """``{interface name: IPv4 address}`` for every interface of this host that has one."""
    out = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            out[name] = socket.inet_ntoa(packed[20:24])
    return out


def interface_of(address: str, addresses: dict[str, str] | None = None) -> str | None:
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
    return next((name for name, held in table.items() if held == ip), None)


def interface_env(address: str, addresses: dict[str, str] | None = None) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` and its TensorPipe and NCCL twins for the interface of ``address``.

    Empty when ``address`` is on loopback (every transport finds loopback by itself on one
    host) or held by no interface here (nothing to pin; the agent reports that elsewhere).
    """
    table = interface_addresses() if addresses is None else addresses
    name = interface_of(address, table)
    if name is None or ipaddress.ip_address(table[name]).is_loopback:
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
