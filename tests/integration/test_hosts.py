"""Test hosts (tests/hosts.py) are real hosts to the network: own addresses, partitions, gloo.

The gloo cases reproduce the trap a job across hosts meets (docs/design.md, gloo and host
addresses): the host name resolves to loopback, so gloo without an interface to use
advertises 127.0.0.1 to its peer; with ``GLOO_SOCKET_IFNAME`` naming the interface that
holds the host's address, the same all-reduce goes through.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.hosts import TestHosts

pytestmark = pytest.mark.skipif(TestHosts.unavailable() is not None, reason=TestHosts.unavailable() or "")

RANK = r"""
import sys, datetime, torch, torch.distributed as dist
rank, head, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
store = dist.TCPStore(head, port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=20),
                     wait_for_workers=False)
if rank == 0:
    print("PORT", store.port, flush=True)
    store.wait(["peer"], datetime.timedelta(seconds=120))  # the peer's start (import torch) is not timed
else:
    store.set("peer", "here")
# the short timeout is gloo's (and the exchange of its addresses): the plain case fails fast
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=6))
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print("SUM", t.item(), flush=True)
"""

ECHO_SERVER = r"""
import socket, sys
s = socket.create_server((sys.argv[1], 0)); print(s.getsockname()[1], flush=True)
while True:
    c, _ = s.accept(); c.sendall(b"hello from " + sys.argv[1].encode()); c.close()
"""

CONNECT = r"""
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2) as c:
        print(c.recv(100).decode())
except OSError as exc:
    print("unreachable:", exc); sys.exit(3)
"""


@pytest.fixture
def hosts():
    with TestHosts(2) as made:
        yield made


def test_hosts_reach_each_other_and_a_cut_partitions_them(hosts):
    a, b = hosts.hosts
    server = hosts.popen(b, [sys.executable, "-c", ECHO_SERVER, b.address], stdout=subprocess.PIPE, text=True)
    port = server.stdout.readline().strip()
    reach = [sys.executable, "-c", CONNECT, b.address, port]
    assert subprocess.run(["ip", "netns", "exec", a.name, *reach], capture_output=True, text=True,
                          timeout=30).stdout.strip() == f"hello from {b.address}"
    hosts.cut(b)
    cut = subprocess.run(["ip", "netns", "exec", a.name, *reach], capture_output=True, text=True, timeout=30)
    assert cut.returncode == 3, cut.stdout + cut.stderr
    hosts.restore(b)
    assert "hello" in subprocess.run(["ip", "netns", "exec", a.name, *reach], capture_output=True, text=True,
                                     timeout=30).stdout


def _all_reduce(hosts, env_of) -> tuple[str, str]:
    a, b = hosts.hosts
    head = hosts.popen(a, [sys.executable, "-c", RANK, "0", a.address, "0"], env=env_of(a),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = head.stdout.readline()
    while first and not first.startswith("PORT"):  # c10d's warnings come first
        first = head.stdout.readline()
    assert first.startswith("PORT"), head.stdout.read()
    peer = hosts.popen(b, [sys.executable, "-c", RANK, "1", a.address, first.split()[1]], env=env_of(b),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while head.poll() is None and peer.poll() is None:
        assert time.monotonic() < deadline, "neither rank ended in 120 s"
        time.sleep(0.1)
    first_ended = head if head.returncode is not None else peer
    if first_ended.returncode != 0:
        # one rank failed: the other would wait out gloo's own 30 s connect timeout (the group's 6 s is not it)
        for rank in (head, peer):
            try:
                rank.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(rank.pid, signal.SIGKILL)
    out_head, out_peer = (rank.communicate(timeout=120)[0] for rank in (head, peer))
    return out_head, out_peer


def test_gloo_across_hosts_needs_the_interface_of_the_advertised_address(hosts):
    plain = lambda host: {**os.environ, "OMP_NUM_THREADS": "1"}  # noqa: E731
    out_head, out_peer = _all_reduce(hosts, plain)
    assert "SUM 3.0" not in out_head + out_peer
    assert "127.0.0.1" in out_head + out_peer, out_head + out_peer

    pinned = lambda host: {**plain(host), "GLOO_SOCKET_IFNAME": host.ifname}  # noqa: E731
    out_head, out_peer = _all_reduce(hosts, pinned)
    assert "SUM 3.0" in out_head and "SUM 3.0" in out_peer, out_head + out_peer


NETIF = r"""
import sys
from torchrelay.agent.netif import interface_addresses, interface_env, route_address
print(interface_addresses()["eth0"][0], route_address(f"http://{sys.argv[1]}:9"), interface_env(sys.argv[2]).get("GLOO_SOCKET_IFNAME"))
"""


def test_an_agent_host_finds_its_interface_and_the_address_that_routes_to_the_server(hosts):
    server_host, agent_host = hosts.hosts
    out = subprocess.run(["ip", "netns", "exec", agent_host.name, sys.executable, "-c", NETIF,
                          server_host.address, agent_host.address], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == [agent_host.address, agent_host.address, "eth0"], out.stdout + out.stderr
