"""The store's pure rules, as tables: keys, options, capabilities, the fence's decision, error causes."""
from __future__ import annotations

import errno

import botocore.exceptions
import pytest

from torchrelay.errors import InvalidPath, StorageError
from torchrelay.storage import keys
from torchrelay.storage.conditional import (CHECK_THEN_WRITE_ONLY, Capabilities, EtagForm, FenceStep, Guarantee,
                                            S3ProbeOutcome, etag_for_if_match, fence_step, parse_attempt,
                                            s3_capabilities)
from torchrelay.storage.failures import (describe_os_error, is_precondition_failed, redact, s3_reason)
from torchrelay.storage.options import missing_package, refuse_credentials_in_url, s3fs_kwargs, secrets_of

A, C = Guarantee.ATOMIC, Guarantee.CHECK_THEN_WRITE


# ------------------------------------------------------------ keys

@pytest.mark.parametrize("path, expected", [
    ("model.pt", "model.pt"), ("a/b/c.txt", "a/b/c.txt"),
    # refused, never repaired (the whole table is tests/unit/test_paths.py)
    ("a/b/../c.txt", None), ("./x", None), ("a\\b", None),
    ("/abs", None), ("..", None), ("../x", None), ("a/../../x", None), ("", None), (".", None),
])
def test_relative_paths(path, expected):
    if expected is None:
        with pytest.raises(InvalidPath, match="is refused"):
            keys.validate_relative_path(path)
        with pytest.raises(InvalidPath, match="is refused"):
            keys.artifact_key("job-1", path)
    else:
        assert keys.validate_relative_path(path) == expected
        assert keys.artifact_key("job-1", path) == f"jobs/job-1/artifacts/{expected}"


@pytest.mark.parametrize("job_id", ["..", "a/b", "", "job-1/../job-2", "%2e%2e"])
def test_job_ids_are_one_plain_name(job_id):
    with pytest.raises(InvalidPath, match="job id"):
        keys.job_prefix(job_id)


@pytest.mark.parametrize("digest, ok", [("a" * 64, True), ("A" * 64, False), ("a" * 63, False), ("", False),
                                        ("g" * 64, False)])
def test_bundle_keys(digest, ok):
    if ok:
        assert keys.bundle_key(digest) == f"bundles/{digest}.tar.gz"
    else:
        with pytest.raises(InvalidPath, match="sha256"):
            keys.bundle_key(digest)


@pytest.mark.parametrize("base, path, expected", [
    ("/s/jobs/j/artifacts", "/s/jobs/j/artifacts/a/b", "a/b"),
    ("bucket/p/jobs", "bucket/p/jobs/j1/x", "j1/x"),
    ("/s/jobs", "s/jobs/j/x", "j/x"),  # a listing without the leading slash
])
def test_listed_paths_relative_to_their_prefix(base, path, expected):
    assert keys.relative_to(base, path) == expected


def test_the_layout():
    assert keys.artifact_key("j", "m/x.pt") == "jobs/j/artifacts/m/x.pt"
    assert keys.attempt_key("j") == "jobs/j/ATTEMPT"
    assert keys.checkpoint_prefix("j") == "jobs/j/checkpoints"


# ------------------------------------------------------------ options

@pytest.mark.parametrize("protocol, installed, expected", [
    ("s3", set(), "s3fs (pip install 'torchrelay[s3]')"),
    ("s3", {"s3fs"}, None),
    ("s3a", set(), "s3fs (pip install 'torchrelay[s3]')"),
    ("hdfs", set(), "hdfs-native (no Java; pip install 'torchrelay[hdfs]') or pyarrow (with Java's libhdfs)"),
    ("hdfs", {"hdfs_native"}, None),
    ("hdfs", {"pyarrow"}, None),
    ("gs", set(), "gcsfs"),
    ("file", set(), None),
    ("memory", set(), None),
    ("unknown", set(), None),  # fsspec itself says it knows no such scheme
])
def test_the_package_a_scheme_needs(protocol, installed, expected):
    assert missing_package(protocol, installed.__contains__) == expected


@pytest.mark.parametrize("url, refused", [
    ("s3://AKIA:hunter2@bucket/p", True), ("s3://bucket/p", False), ("hdfs://user@nn:8020/p", False),
    ("/local/folder", False), ("file:///srv/store", False), ("webhdfs://u:pw@nn:9870/x", True),
])
def test_a_url_holds_no_password(url, refused):
    if refused:
        with pytest.raises(StorageError, match="holds a credential") as caught:
            refuse_credentials_in_url(url)
        assert "hunter2" not in str(caught.value) and "pw" not in str(caught.value).split()
    else:
        refuse_credentials_in_url(url)


DEFAULTS = {"use_listings_cache": False, "skip_instance_cache": True}


@pytest.mark.parametrize("options, env, expected", [
    ({}, {}, {**DEFAULTS, "client_kwargs": {}, "config_kwargs": {"connect_timeout": 10}}),
    ({"endpoint_url": "http://rgw:7480", "region": "eu-1", "access_key_id": "K", "secret_access_key": "S",
      "session_token": "T", "profile": "ceph"}, {},
     {**DEFAULTS, "endpoint_url": "http://rgw:7480", "key": "K", "secret": "S", "token": "T", "profile": "ceph",
      "client_kwargs": {"region_name": "eu-1"},
      "config_kwargs": {"connect_timeout": 10, "s3": {"addressing_style": "path"}}}),
    # an endpoint from the environment: path-style too, unless told otherwise
    ({}, {"AWS_ENDPOINT_URL": "http://minio:9000"},
     {**DEFAULTS, "client_kwargs": {}, "config_kwargs": {"connect_timeout": 10, "s3": {"addressing_style": "path"}}}),
    ({"addressing_style": "virtual"}, {"AWS_ENDPOINT_URL_S3": "http://minio:9000"},
     {**DEFAULTS, "client_kwargs": {}, "config_kwargs": {"connect_timeout": 10, "s3": {"addressing_style": "virtual"}}}),
    # AWS_REGION as the AWS CLI reads it; AWS_DEFAULT_REGION is botocore's own
    ({}, {"AWS_REGION": "eu-2"}, {**DEFAULTS, "client_kwargs": {"region_name": "eu-2"},
                                  "config_kwargs": {"connect_timeout": 10}}),
    ({}, {"AWS_REGION": "eu-2", "AWS_DEFAULT_REGION": "eu-3"},
     {**DEFAULTS, "client_kwargs": {}, "config_kwargs": {"connect_timeout": 10}}),
    # s3fs's own arguments pass through, and may overrule the defaults
    ({"use_listings_cache": True, "config_kwargs": {"connect_timeout": 3}, "requester_pays": True}, {},
     {"use_listings_cache": True, "skip_instance_cache": True, "requester_pays": True, "client_kwargs": {},
      "config_kwargs": {"connect_timeout": 3}}),
])
def test_store_options_to_s3fs(options, env, expected):
    assert s3fs_kwargs(options, env) == expected


def test_the_secrets_a_store_keeps_out_of_messages():
    found = secrets_of({"secret_access_key": "S1", "access_key_id": "K", "session_token": "T1"},
                       {"AWS_SECRET_ACCESS_KEY": "S2", "AWS_ACCESS_KEY_ID": "K2"})
    assert sorted(found) == ["S1", "S2", "T1"]


# ------------------------------------------------------------ capabilities and the fence

def outcome(create, wrong, quoted, bare):
    return S3ProbeOutcome(second_create_refused=create, wrong_etag_refused=wrong, quoted_etag_accepted=quoted,
                          bare_etag_accepted=bare)


@pytest.mark.parametrize("seen, expected", [
    (outcome(True, True, True, False), Capabilities(put_if_absent=A, compare_and_swap=A, etag_form=EtagForm.QUOTED)),
    # Ceph RGW 16.2: 412 to the quoted ETag it handed out, accepts it bare
    (outcome(True, True, False, True), Capabilities(put_if_absent=A, compare_and_swap=A, etag_form=EtagForm.BARE)),
    # If-Match ignored: every form "works", so none counts
    (outcome(True, False, True, True), Capabilities(put_if_absent=A, compare_and_swap=C)),
    # If-Match refuses everything
    (outcome(True, True, False, False), Capabilities(put_if_absent=A, compare_and_swap=C)),
    # If-None-Match ignored: a swap of a missing key cannot be made atomic either
    (outcome(False, True, True, False), Capabilities(put_if_absent=C, compare_and_swap=C, etag_form=EtagForm.QUOTED)),
    (outcome(False, False, True, True), CHECK_THEN_WRITE_ONLY),
])
def test_what_an_s3_probe_shows(seen, expected):
    assert s3_capabilities(seen) == expected


@pytest.mark.parametrize("etag, form, expected", [
    ('"abc"', EtagForm.QUOTED, '"abc"'), ('"abc"', EtagForm.BARE, "abc"),
    ("abc", EtagForm.QUOTED, '"abc"'), ("abc", EtagForm.BARE, "abc"), (' "abc-2" ', EtagForm.BARE, "abc-2"),
])
def test_etag_forms(etag, form, expected):
    assert etag_for_if_match(etag, form) == expected


@pytest.mark.parametrize("stored, attempt, step", [
    (None, 0, FenceStep.WRITE), (None, 3, FenceStep.WRITE), (1, 2, FenceStep.WRITE), (0, 7, FenceStep.WRITE),
    (2, 2, FenceStep.UNCHANGED), (3, 2, FenceStep.REFUSE), (10, 9, FenceStep.REFUSE),
])
def test_the_fence_moves_forward_only(stored, attempt, step):
    assert fence_step(stored, attempt) is step


@pytest.mark.parametrize("text, attempt", [
    (None, None), (b"3", 3), (b" 12\n", 12), (b"", None), (b"x", None), (b"-1", None), (b"\xff", None),
])
def test_stored_attempts(text, attempt):
    assert parse_attempt(text) == attempt


def test_capabilities_as_a_dict():
    assert Capabilities(put_if_absent=A, compare_and_swap=C, etag_form=EtagForm.BARE).as_dict() == {
        "put_if_absent": "atomic", "compare_and_swap": "check-then-write", "etag_form": "bare"}


# ------------------------------------------------------------ error causes

@pytest.mark.parametrize("code, status, message, expected", [
    ("NoSuchBucket", 404, "None", "the bucket does not exist (NoSuchBucket)"),
    ("SignatureDoesNotMatch", 403, None,
     "the secret key does not match the access key (check the credentials) (SignatureDoesNotMatch)"),
    ("AccessDenied", 403, "Access Denied", "access denied (the credentials lack permission for this bucket or key) "
                                           "(AccessDenied: Access Denied)"),
    ("403", 403, "Forbidden", "access denied (wrong credentials or no permission) (Forbidden)"),
    ("QuotaExceeded", 403, "over quota", "QuotaExceeded (over quota)"),
    (None, 500, None, "HTTP 500"),
    (None, None, None, "unknown error"),
])
def test_s3_reasons(code, status, message, expected):
    assert s3_reason(code, status, message) == expected


def client_error(code, status=400, message="None"):
    return botocore.exceptions.ClientError(
        {"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


def translated(cause: BaseException, exc: OSError) -> OSError:
    exc.__cause__ = cause  # as s3fs raises them: an OSError from the ClientError
    return exc


@pytest.mark.parametrize("exc, expected", [
    (OSError(errno.ENOSPC, "No space left"), "no space left on device"),
    (PermissionError(errno.EACCES, "denied"), "permission denied (store is not writable)"),
    (OSError(errno.EROFS, "ro"), "permission denied (store is not writable)"),
    (OSError(errno.EIO, "boom"), "[Errno 5] boom"),
    (translated(client_error("NoSuchBucket", 404), FileNotFoundError()), "the bucket does not exist (NoSuchBucket)"),
    (translated(client_error("InvalidAccessKeyId", 403), PermissionError("x")),
     "the access key is not known to the store (check the credentials) (InvalidAccessKeyId)"),
])
def test_os_error_causes(exc, expected):
    assert describe_os_error(exc) == expected


@pytest.mark.parametrize("exc, refused", [
    (FileExistsError(), True),
    (translated(client_error("PreconditionFailed", 412), OSError(errno.EINVAL, "None")), True),
    (translated(client_error("ConditionalRequestConflict", 409), OSError(errno.EIO, "x")), True),
    (translated(client_error("NoSuchBucket", 404), FileNotFoundError()), False),
    (OSError(errno.EINVAL, "not a 412"), False),
])
def test_refused_conditional_writes(exc, refused):
    assert is_precondition_failed(exc) is refused


@pytest.mark.parametrize("text, secrets, expected", [
    ("key S3CR3T failed", ["S3CR3T"], "key *** failed"),
    ("a ab abc", ["ab", "abc"], "a *** ***"),  # the longer secret first
    ("nothing here", [None, ""], "nothing here"),
])
def test_redaction(text, secrets, expected):
    assert redact(text, secrets) == expected
