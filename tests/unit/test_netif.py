"""Pinning the workers' transports to the interface of the advertised address (agent/netif.py)."""
import pytest

from torchrelay.agent.netif import SOCKET_IFNAME_VARS, interface_addresses, interface_env, interface_of, route_address

TABLE = {"lo": "127.0.0.1", "eth0": "10.1.2.3", "eth1": "192.168.5.9"}


@pytest.mark.parametrize("address, interface, pinned", [
    ("10.1.2.3", "eth0", True),
    ("192.168.5.9", "eth1", True),
    ("127.0.0.1", "lo", False),       # one host: every transport finds loopback by itself
    ("10.9.9.9", None, False),        # held by no interface here: nothing to pin
])
def test_interface_of_an_address(address, interface, pinned):
    assert interface_of(address, TABLE) == interface
    env = interface_env(address, TABLE)
    assert env == ({var: interface for var in SOCKET_IFNAME_VARS} if pinned else {})


def test_this_hosts_loopback_is_found():
    assert interface_addresses().get("lo") == "127.0.0.1"


def test_the_route_to_a_local_server_leaves_from_loopback():
    assert route_address("http://127.0.0.1:8123") == "127.0.0.1"
