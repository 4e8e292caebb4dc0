"""What the API makes of ids and positions a request gives (found by tests/integration/test_api_fuzz.py):
each either names a row or is refused as the request's fault, never a server error."""
from __future__ import annotations

import pytest

from torchrelay.errors import InvalidPath, InvalidSpec
from torchrelay.server.streams import MAX_ROW_ID, start_id
from torchrelay.server.views import job_seq_of
from torchrelay.storage.keys import bundle_key, validate_relative_path


@pytest.mark.parametrize("job_id, seq", [
    ("job-12", 12), ("12", 12), ("job-0", 0), ("job-999999999999999999", 999999999999999999),
    ("job-9999999999999999999", None),  # past the state store's 64-bit keys
    ("job-²", None), ("job-١٢", None),  # digits, but not ASCII ones: int() refuses or misreads them
    ("job-", None), ("job-1a", None), ("job--1", None), ("", None),
])
def test_job_seq_of(job_id, seq):
    assert job_seq_of(job_id) == seq


@pytest.mark.parametrize("header, after, expected", [
    (None, 0, 0), (None, 7, 7), ("", 7, 7), ("12", 7, 12), (str(MAX_ROW_ID), 0, MAX_ROW_ID),
    (None, MAX_ROW_ID + 1, InvalidSpec), (str(MAX_ROW_ID + 1), 0, InvalidSpec), ("-1", 0, InvalidSpec),
    ("abc", 0, InvalidSpec),
])
def test_start_id(header, after, expected):
    if expected is InvalidSpec:
        with pytest.raises(InvalidSpec, match="is not a row id"):
            start_id(header, after)
    else:
        assert start_id(header, after) == expected


@pytest.mark.parametrize("call, value", [(bundle_key, "0"), (bundle_key, "ZZ" * 32), (validate_relative_path, "../x"),
                                         (validate_relative_path, "/etc/passwd")])
def test_a_bad_path_or_digest_is_the_requests_fault(call, value):
    with pytest.raises(InvalidPath) as refused:
        call(value)
    assert refused.value.http_status == 400
    assert repr(value) in str(refused.value)


@pytest.mark.parametrize("change, field", [
    ({"memory": -1}, "memory"), ({"memory": 1 << 64}, "memory"), ({"cpus": -3.7e46}, "cpus"),
    ({"gpus": -1}, "gpus"), ({"probe_port": 319380262584844311767891853972577714176}, "probe_port"),
    ({"probe_port": 0}, "probe_port"), ({"address": "a\x00b"}, "address"), ({"address": "h/x"}, "address"),
({"name": "x\ny"}, "name"), ({"name": ""}, "name"),
])
def test_a_registration_no_node_could_send_is_refused_by_its_model(change, field):
    from pydantic import ValidationError

    from torchrelay.wire import NodeRegistration
    good = {"name": "agent-0", "address": "10.0.0.2", "cpus": 2, "memory": 1 << 34, "probe_port": 4000}
    NodeRegistration(**good)
    with pytest.raises(ValidationError) as refused:
        NodeRegistration(**{**good, **change})
    assert refused.value.errors()[0]["loc"] == (field,)
