"""The server's config file (torchrelay.server.config) and which store options reach workers."""
import pytest

from torchrelay.errors import InvalidSpec
from torchrelay.server.config import ServerConfig, UploadLimits, load_server_config, parse_server_config
from torchrelay.storage.options import public_options


@pytest.mark.parametrize("data, expected", [
    (None, ServerConfig()),
    ({}, ServerConfig()),
    ({"store": "s3://b/p"}, ServerConfig(store_url="s3://b/p")),
    ({"store": {"url": " s3://b/p "}}, ServerConfig(store_url="s3://b/p")),
    ({"store": {"options": {"region": "r"}}}, ServerConfig(store_options={"region": "r"})),
    ({"store": {"url": "s3://b", "options": None}}, ServerConfig(store_url="s3://b")),
    ({"limits": {"bundle": "2GiB", "log_batch": 1024}},
     ServerConfig(limits=UploadLimits(bundle=2 * 2**30, log_batch=1024))),
    ({"limits": None, "store": "s3://b"}, ServerConfig(store_url="s3://b")),
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
    ({"limits": {"artifacts": "1GiB"}}, "limits: unknown key 'artifacts'; known keys: bundle, artifact, "
                                         "log_batch, metric_batch, request"),
    ({"limits": {"bundle": "lots"}}, r"limits.bundle must be a size above 0 .* got 'lots'"),
    ({"limits": {"bundle": 0}}, r"limits.bundle must be a size above 0"),
    ({"limits": {"bundle": True}}, r"limits.bundle must be a size above 0"),
    ({"limits": "1GiB"}, "limits must be a mapping with the keys bundle, artifact"),
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


@pytest.mark.parametrize("method, path, limit", [
    ("POST", "/api/v1/bundles", "bundle"), ("PUT", "/api/v1/jobs/job-1/artifacts/a/b.pt", "artifact"),
    ("POST", "/api/v1/jobs/job-1/logs", "log_batch"), ("POST", "/api/v1/jobs/job-1/metrics", "metric_batch"),
    ("GET", "/api/v1/jobs/job-1/artifacts/a", None), ("POST", "/api/v1/jobs", "request"),
    ("PUT", "/api/v1/jobs/job-1/artifacts/", "request"), ("POST", "/api/v1/jobs/job-1/logs/stream", "request"),
    ("POST", "/api/v1/nodes/register", "request"), ("HEAD", "/api/v1/bundles/x", None),
])
def test_which_limit_bounds_a_request(method, path, limit):
    from torchrelay.server.uploads import limit_for

    assert limit_for(method, path) == limit


@pytest.mark.parametrize("name, limit, size, expected", [
    ("artifact", 2**20, 2 * 2**20, "the artifact of 2 MiB is over the server's limit of 1 MiB (1048576 bytes); "
                                   "the limits.artifact setting of the server config (relay server --config FILE) "
                                   "raises it"),
    ("log_batch", 65536, None, "the log batch is over the server's limit of 64 KiB (65536 bytes); "
                               "the limits.log_batch setting"),
])
def test_the_413_message_names_the_limit_and_its_setting(name, limit, size, expected):
    from torchrelay.server.uploads import too_large_message

    assert too_large_message(name, limit, size).startswith(expected)
