"""Pinning the workers' transports to the interface of the advertised address (agent/netif.py)."""
import pytest

from torchrelay.agent.netif import (IFNAME_LABEL, SOCKET_IFNAME_VARS, check_advertised, interface_addresses, interface_env,
                                   interface_of, route_address, transport_env)

TABLE = {"lo": ("127.0.0.1",), "eth0": ("10.1.2.3", "10.1.2.4"), "eth1": ("192.168.5.9",)}


@pytest.mark.parametrize("address, interface, pinned", [
    ("10.1.2.3", "eth0", True),
    ("192.168.5.9", "eth1", True),
    ("10.1.2.4", "eth0", True),       # a second address of an interface
    ("127.0.0.1", "lo", False),       # one host: every transport finds loopback by itself
    ("10.9.9.9", None, False),        # held by no interface here: nothing to pin
])
def test_interface_of_an_address(address, interface, pinned):
    assert interface_of(address, TABLE) == interface
    env = interface_env(address, TABLE)
    assert env == ({var: interface for var in SOCKET_IFNAME_VARS} if pinned else {})


def test_this_hosts_loopback_is_found():
    assert "127.0.0.1" in interface_addresses()["lo"]


def test_the_route_to_a_local_server_leaves_from_loopback():
    assert route_address("http://127.0.0.1:8123") == "127.0.0.1"


def test_an_address_on_an_interface_is_advertised_with_its_interface():
    assert check_advertised("10.1.2.3", TABLE) == "eth0"


def test_an_address_on_no_interface_is_refused_naming_it_and_the_interfaces():
    with pytest.raises(ValueError) as err:
        check_advertised("10.9.9.9", TABLE)
    message = str(err.value)
    assert "'10.9.9.9'" in message
    assert all(f"{name} {' '.join(held)}" in message for name, held in TABLE.items())


@pytest.mark.parametrize("address, labels, agent_env, expected", [
    # the interface of the address, for every transport
    ("10.1.2.3", {}, {}, {var: "eth0" for var in SOCKET_IFNAME_VARS}),
    # a node label overrides, even the agent's own environment
    ("10.1.2.3", {IFNAME_LABEL: "eth1"}, {"GLOO_SOCKET_IFNAME": "bond0"}, {var: "eth1" for var in SOCKET_IFNAME_VARS}),
    # what the operator set in the agent's environment is left to it (workers inherit it)
    ("10.1.2.3", {}, {"GLOO_SOCKET_IFNAME": "bond0"}, {"TP_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}),
    # loopback needs no pinning
    ("127.0.0.1", {}, {}, {}),
])
def test_what_a_launch_gets_for_its_transports(address, labels, agent_env, expected):
    env = transport_env(address, labels=labels, agent_env=agent_env, addresses=TABLE)
    assert env == {"RELAY_PS_HOST": address, **expected}
