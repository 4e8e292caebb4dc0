"""Where `relay up` listens and what "no server answers" says (torchrelay/client/address.py)."""
from __future__ import annotations

import errno

import pytest

from torchrelay.client.address import (AddressSource, ListenPlan, ServerAddress, listen_plan, parse_address,
                                       unreachable_message)
from torchrelay.errors import Conflict, InvalidSpec


@pytest.mark.parametrize("url, expected", [
    ("http://127.0.0.1:8470", ServerAddress("http", "127.0.0.1", 8470)),
    ("http://localhost:9000/", ServerAddress("http", "localhost", 9000)),
    ("http://[::1]:8470", ServerAddress("http", "::1", 8470)),
    ("http://10.0.0.5", ServerAddress("http", "10.0.0.5", 80)),
    ("https://relay.example", ServerAddress("https", "relay.example", 443)),
])
def test_parse_address(url, expected):
    assert parse_address(url) == expected


@pytest.mark.parametrize("url", ["127.0.0.1:8470", "ftp://host:1", "http://:8470", "http://h:99999", "http://h:1/x"])
def test_parse_address_refuses_what_is_not_a_server_url(url):
    with pytest.raises(InvalidSpec, match="RELAY_ADDRESS="):
        parse_address(url)


def test_url_brackets_ipv6():
    assert ServerAddress("http", "::1", 8470).url == "http://[::1]:8470"
    assert ServerAddress("http", "10.0.0.5", 80).url == "http://10.0.0.5:80"


@pytest.mark.parametrize("relay_address, port, expected", [
    (None, None, ListenPlan(host="127.0.0.1", port=0, source=None)),
    (None, 0, ListenPlan(host="127.0.0.1", port=0, source=None)),
    ("", 8470, ListenPlan(host="127.0.0.1", port=8470, source="--port 8470")),
    ("http://127.0.0.1:9000", None, ListenPlan(host="127.0.0.1", port=9000, source="RELAY_ADDRESS=http://127.0.0.1:9000")),
    ("http://localhost:9000", 9000, ListenPlan(host="localhost", port=9000, source="RELAY_ADDRESS=http://localhost:9000")),
    ("http://[::1]:9000", None, ListenPlan(host="::1", port=9000, source="RELAY_ADDRESS=http://[::1]:9000")),
    ("http://10.0.0.5:9000", None, ListenPlan(host="10.0.0.5", port=9000, source="RELAY_ADDRESS=http://10.0.0.5:9000")),
])
def test_listen_plan(relay_address, port, expected):
    assert listen_plan(relay_address, port) == expected


@pytest.mark.parametrize("relay_address, port, needle", [
    ("http://127.0.0.1:9000", 9001, "--port 9001 and RELAY_ADDRESS=http://127.0.0.1:9000 (port 9000) disagree"),
    ("http://127.0.0.1:9000", 0, "disagree"),
    ("https://127.0.0.1:9000", None, "plain http"),
])
def test_listen_plan_refuses_naming_relay_address(relay_address, port, needle):
    with pytest.raises(Conflict, match="RELAY_ADDRESS") as err:
        listen_plan(relay_address, port)
    assert needle in str(err.value)


@pytest.mark.parametrize("plan, error_number, needles", [
    (ListenPlan(port=9000, source="RELAY_ADDRESS=http://127.0.0.1:9000"), errno.EADDRINUSE,
     ["where RELAY_ADDRESS=http://127.0.0.1:9000 says", "port 9000 is in use", "unset RELAY_ADDRESS"]),
    (ListenPlan(host="192.0.2.1", port=9000, source="RELAY_ADDRESS=http://192.0.2.1:9000"), errno.EADDRNOTAVAIL,
     ["192.0.2.1 is not an address of this machine", "unset RELAY_ADDRESS"]),
    (ListenPlan(host="nohost.invalid", port=9000, source="RELAY_ADDRESS=http://nohost.invalid:9000"), None,
     ["nohost.invalid does not resolve (detail)"]),
    (ListenPlan(port=80, source="--port 80"), errno.EACCES, ["where --port 80 says", "detail", "leave --port out"]),
    (ListenPlan(port=80), errno.EACCES, ["cannot listen on 127.0.0.1:80: detail"]),
])
def test_refusal_names_who_asked(plan, error_number, needles):
    text = plan.refusal(error_number, "detail")
    assert all(n in text for n in needles), text


HOME = "/home/u/.torchrelay"


@pytest.mark.parametrize("source, recorded, needles, absent", [
    (AddressSource.ENVIRONMENT, "http://127.0.0.1:2", ["at http://127.0.0.1:1", "RELAY_ADDRESS names",
     f"RELAY_HOME ({HOME}) is at http://127.0.0.1:2", "Unset RELAY_ADDRESS"], []),
    (AddressSource.ENVIRONMENT, None, ["RELAY_ADDRESS names", "`relay up` (it listens where RELAY_ADDRESS says)"],
     ["RELAY_HOME"]),
    (AddressSource.ENVIRONMENT, "http://127.0.0.1:1/", ["RELAY_ADDRESS names"], ["is at"]),  # they agree
    (AddressSource.HOME, "http://127.0.0.1:1", [f"recorded in RELAY_HOME ({HOME})", "relay up"], []),
    (AddressSource.ARGUMENT, "http://127.0.0.1:2", ["at http://127.0.0.1:1 (ConnectError)", "relay up"],
     ["RELAY_HOME"]),
])
def test_unreachable_message(source, recorded, needles, absent):
    text = unreachable_message("http://127.0.0.1:1", source, "ConnectError", home=HOME, recorded=recorded)
    assert all(n in text for n in needles) and not any(a in text for a in absent), text
