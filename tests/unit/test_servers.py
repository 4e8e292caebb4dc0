"""A cluster's server list (torchrelay/servers.py): parsing RELAY_ADDRESS and following the leader."""
import pytest

from torchrelay.servers import ClusterMismatch, ServerList, parse_addresses


@pytest.mark.parametrize("value, expected", [
    ("http://a:8470", ("http://a:8470",)),
    ("http://a:8470/, http://b:8470", ("http://a:8470", "http://b:8470")),
    ("https://a,", ("https://a",)),
])
def test_parse_addresses(value, expected):
    assert parse_addresses(value) == expected


@pytest.mark.parametrize("value, named", [("a:8470", "'a:8470'"), ("http://a,ftp://b", "'ftp://b'"), (" , ", "' , '")])
def test_a_bad_address_is_named(value, named):
    with pytest.raises(ValueError, match=named):
        parse_addresses(value)


def test_no_answer_moves_round_the_list_and_a_follower_sends_to_the_leader():
    servers = ServerList(("http://a", "http://b", "http://c"))
    assert servers.moved("http://a") == "http://b"
    assert servers.moved("http://a") == "http://b"  # another thread moved on already: unchanged
    assert servers.moved("http://b") == "http://c"
    assert servers.moved("http://c") == "http://a"
    assert servers.moved("http://a", leader="http://c/") == "http://c"
    assert ServerList(("http://a",)).moved("http://a") == "http://a"  # nowhere else to go


def test_servers_of_two_clusters_are_refused_naming_both():
    servers = ServerList(("http://a", "http://b"))
    servers.seen("http://a", None)  # a server that does not say: nothing to compare
    servers.seen("http://a", "c1")
    servers.seen("http://b", "c1")
    with pytest.raises(ClusterMismatch, match=r"http://b serves cluster c2 but http://a serves cluster c1"):
        servers.seen("http://b", "c2")
