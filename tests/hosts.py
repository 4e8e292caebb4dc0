"""Test hosts: network namespaces joined by one bridge, each a host with its own address.

Not a test module. ``TestHosts(n)`` makes ``n`` hosts (root only; ``TestHosts.unavailable()``
says why not, for a skip). Each host is a network namespace with one interface named
``eth0`` on a private /24 that no interface of this machine uses, plus its own loopback; the
host name still resolves to 127.0.0.1 inside them (the namespaces share ``/etc/hosts``),
which is exactly the trap real machines set for gloo (docs/design.md, gloo and host
addresses).

Contract:
- This machine is on the bridge too, at ``bridge_address`` (the last address of the /24): a
  test's own client reaches every host from where it runs, as a user's laptop would.
- ``popen(host, argv, ...)`` starts ``argv`` inside ``host`` in a new session; the process
  group is owned and ended by ``close``.
- ``cut(host)`` / ``restore(host)`` take the host's link down and up (a network partition
  between it and every other host).
- ``close()`` ends every owned process group, deletes the namespaces, the veth pairs and the
  bridge. Idempotent; also runs when a test fails (use it as a context manager or fixture).
"""
from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

__all__ = ["Host", "TestHosts"]


@dataclass(frozen=True, slots=True)
class Host:
    name: str        # the network namespace's name
    address: str     # its address on the bridge
    ifname: str      # the interface that holds it, inside the namespace
    outer: str       # the veth end on the bridge, in this machine's namespace


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip", *(("netns", "exec", netns, "ip") if netns else ()), *args]
    return subprocess.run(argv, capture_output=True, text=True, check=check)


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.x.y.0/24 that no interface here has an address in (so routes never clash)."""
    used = [ipaddress.ip_interface(word).network
            for line in _ip("-o", "-4", "addr").stdout.splitlines()
            for word in line.split()[3:4]]
    for _ in range(200):
        net = ipaddress.ip_network(f"10.{secrets.randbelow(200) + 40}.{secrets.randbelow(250) + 1}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError(f"no free 10.x.y.0/24 beside {used}")


class TestHosts:
    """``n`` test hosts on one bridge; see the module docstring."""

    __test__ = False  # not a pytest test class

    @staticmethod
    def unavailable() -> str | None:
        """Why test hosts cannot be made here (a skip reason), or None when they can."""
        if os.geteuid() != 0:
            return "test hosts are network namespaces: they need root (CI runs as root)"
        if shutil.which("ip") is None:
            return "test hosts need iproute2's `ip`"
        return None

    def __init__(self, n: int) -> None:
        reason = self.unavailable()
        if reason:
            raise RuntimeError(reason)
        token = secrets.token_hex(3)
        self.bridge = f"trb{token}"
        self.subnet = _free_subnet()
        self.hosts: list[Host] = []
        self._groups: list[subprocess.Popen] = []
        addresses = list(self.subnet.hosts())
        self.bridge_address = str(addresses[-1])
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.bridge_address}/{self.subnet.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(n):
                host = Host(name=f"tr{token}h{i}", address=str(addresses[i + 1]), ifname="eth0",
                            outer=f"trv{token}{i}")
                self.hosts.append(host)
                _ip("netns", "add", host.name)
                _ip("link", "add", host.outer, "type", "veth", "peer", "name", f"trp{token}{i}")
                _ip("link", "set", f"trp{token}{i}", "netns", host.name)
                _ip("link", "set", f"trp{token}{i}", "name", host.ifname, netns=host.name)
                _ip("addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", host.ifname, netns=host.name)
                _ip("link", "set", host.ifname, "up", netns=host.name)
                _ip("link", "set", "lo", "up", netns=host.name)
                _ip("link", "set", host.outer, "master", self.bridge)
                _ip("link", "set", host.outer, "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> TestHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def popen(self, host: Host, argv: list[str], **kwargs) -> subprocess.Popen:
        """``argv`` inside ``host``, in a session of its own that ``close`` ends."""
        proc = subprocess.Popen(["ip", "netns", "exec", host.name, *argv], start_new_session=True, **kwargs)
        self._groups.append(proc)
        return proc

    def cut(self, host: Host) -> None:
        """Partition ``host`` from every other host (its link on the bridge goes down)."""
        _ip("link", "set", host.outer, "down")

    def restore(self, host: Host) -> None:
        _ip("link", "set", host.outer, "up")

    def close(self) -> None:
        """End every owned process group, then remove namespaces, links and bridge. Idempotent."""
        for proc in self._groups:
            _end_group(proc)
        self._groups.clear()
        for host in self.hosts:
            _ip("link", "del", host.outer, check=False)  # takes its peer inside the namespace with it
            _ip("netns", "del", host.name, check=False)
        self.hosts = []
        _ip("link", "del", self.bridge, check=False)


def _end_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is not None:
            try:  # the leader has gone; anything left in its group goes now
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            break
    if proc.poll() is None:
        proc.wait(timeout=5)
