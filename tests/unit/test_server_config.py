"""The server's config file (torchrelay.server.config) and which store options reach workers."""
import pytest

from torchrelay.errors import InvalidSpec
from torchrelay.server.config import ServerConfig, load_server_config, parse_server_config
from torchrelay.storage.options import public_options


@pytest.mark.parametrize("data, expected", [
    (None, ServerConfig()),
    ({}, ServerConfig()),
    ({"store": "s3://b/p"}, ServerConfig(store_url="s3://b/p")),
    ({"store": {"url": " s3://b/p "}}, ServerConfig(store_url="s3://b/p")),
    ({"store": {"options": {"region": "r"}}}, ServerConfig(store_options={"region": "r"})),
    ({"store": {"url": "s3://b", "options": None}}, ServerConfig(store_url="s3://b")),
])
def test_parses(data, expected):
    assert parse_server_config(data, "f.yaml") == expected


@pytest.mark.parametrize("data, message", [
    ([], "expected a mapping"),
    ({"stor": "s3://b"}, "unknown key 'stor'"),
    ({"store": {"url": "s3://b", "opts": {}}}, "store: unknown key 'opts'"),
    ({"store": 3}, "store must be a URL or a mapping"),
    ({"store": {"url": ""}}, "store.url must be a non-empty URL"),
    ({"store": {"url": "s3://b", "options": ["a"]}}, "store.options must be a mapping"),
])
def test_refuses_naming_the_file_and_key(data, message):
    with pytest.raises(InvalidSpec, match=message) as raised:
        parse_server_config(data, "server config 'f.yaml'")
    assert "f.yaml" in str(raised.value)


def test_load_names_an_unreadable_or_bad_file(tmp_path):
    with pytest.raises(InvalidSpec, match="cannot be read"):
        load_server_config(tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("store: [\n")
    with pytest.raises(InvalidSpec, match="not valid YAML"):
        load_server_config(bad)
    good = tmp_path / "good.yaml"
    good.write_text("store:\n  url: s3://b/p\n  options: {region: us-east-1}\n")
    assert load_server_config(good) == ServerConfig(store_url="s3://b/p", store_options={"region": "us-east-1"})


@pytest.mark.parametrize("options, expected", [
    ({}, {}),
    ({"endpoint_url": "http://rgw:7480", "region": "us-east-1", "addressing_style": "path"},
     {"endpoint_url": "http://rgw:7480", "region": "us-east-1", "addressing_style": "path"}),
    ({"access_key_id": "A", "secret_access_key": "S", "session_token": "T", "profile": "p", "region": "r"},
     {"region": "r"}),
    ({"client_kwargs": {"aws_secret_access_key": "S"}, "key": "A", "secret": "S", "endpoint_url": None}, {}),
])
def test_only_named_public_options_reach_workers(options, expected):
    assert public_options(options) == expected
