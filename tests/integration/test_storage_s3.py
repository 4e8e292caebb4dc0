"""ArtifactStore against a real Ceph (mon + memstore OSD + radosgw, tests/services/ceph.py) and a local folder.

Every operation runs from one table against both kinds of store (``file`` and ``s3``); then
what only an object store has: the probe of its conditional writes, credentials and buckets
checked at ``check()``, configuration from the environment and ``~/.aws``, and killed uploads.
The s3 cases are skipped, with the reason, where no Ceph can run.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from torchrelay.errors import NotFound, StaleAttempt, StorageError
from torchrelay.storage import ArtifactStore, EtagForm, Guarantee

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for services
from services.ceph import CephCluster  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def s3_options(cluster: CephCluster, **changes) -> dict:
    return {"endpoint_url": cluster.endpoint_url, "region": cluster.region, "access_key_id": cluster.access_key,
            "secret_access_key": cluster.secret_key, **changes}


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
    """An empty store of each kind: a local folder, or a fresh prefix of the Ceph bucket."""
    if request.param == "file":
        return ArtifactStore(f"file://{tmp_path / 'store'}")
    cluster = request.getfixturevalue("ceph")
    return ArtifactStore(f"s3://{cluster.bucket}/{uuid.uuid4().hex[:12]}", s3_options(cluster))


# ------------------------------------------------------------ one table, both stores

def bytes_round_trip(s):
    s.put_bytes("d/f.bin", b"\x00data\xff")
    return s.get_bytes("d/f.bin")


def overwrite(s):
    s.put_bytes("f", b"old")
    s.put_bytes("f", b"new")
    return s.get_bytes("f")


def empty_file(s):
    s.put_bytes("empty", b"")
    return s.get_bytes("empty"), s.size("empty")


def exists_and_size(s):
    before = s.exists("jobs/j/artifacts/m.pt")
    s.put_bytes("jobs/j/artifacts/m.pt", b"12345")
    return before, s.exists("jobs/j/artifacts/m.pt"), s.exists("jobs/j"), s.size("jobs/j/artifacts/m.pt")


def listing(s):
    for key in ("jobs/j1/artifacts/b/c.txt", "jobs/j1/artifacts/a.txt", "jobs/j10/artifacts/x", "jobs/j1/ATTEMPT"):
        s.put_bytes(key, key.encode())
    return list(s.list("jobs/j1/artifacts")), [k for k, _ in s.list("jobs")], list(s.list("jobs/none"))


def listing_skips_unfinished_writes(s):
    s.put_bytes("d/kept", b"1")
    with pytest.raises(RuntimeError), s.open_write("d/dropped") as fh:
        fh.write(b"half")
        raise RuntimeError("the writer fails")
    return list(s.list("d"))


def delete_prefix_leaves_siblings(s):
    for key in ("jobs/j1/a", "jobs/j1/b/c", "jobs/j10/a", "jobs/j2/a"):
        s.put_bytes(key, b"x")
    s.delete_prefix("jobs/j1")
    s.delete_prefix("jobs/never-written")
    return [k for k, _ in s.list("jobs")]


def missing_keys(s):
    raised = []
    for call in (lambda: s.get_bytes("nope"), lambda: s.size("nope")):
        with pytest.raises(NotFound, match=f"no artifact at {s.url}/nope"):
            call()
        raised.append("NotFound")
    return raised


def files_round_trip(s, tmp_path):
    source, back = tmp_path / "source.bin", tmp_path / "back.bin"
    source.write_bytes(os.urandom(3 << 20) + b"end")
    s.put_file("files/blob", source)
    s.get_file("files/blob", back)
    return back.read_bytes() == source.read_bytes(), s.size("files/blob"), sorted(p.name for p in tmp_path.iterdir())


def streamed_write(s):
    with s.open_write("stream/out") as fh:
        for i in range(3):
            fh.write(f"line {i}\n".encode())
    return s.get_bytes("stream/out")


def failed_streamed_write_keeps_the_old_file(s):
    s.put_bytes("stream/out", b"previous")
    with pytest.raises(RuntimeError, match="mid-write"), s.open_write("stream/out") as fh:
        fh.write(b"x" * (6 << 20))
        raise RuntimeError("mid-write")
    return s.get_bytes("stream/out")


def put_if_absent_twice(s):
    return s.put_if_absent("claims/a", b"first"), s.put_if_absent("claims/a", b"second"), s.get_bytes("claims/a")


def put_if_absent_over_a_plain_write(s):
    s.put_bytes("claims/b", b"plain")
    return s.put_if_absent("claims/b", b"mine"), s.get_bytes("claims/b")


def fence_moves_forward(s):
    seen = [s.read_fence("j")]
    for attempt in (0, 2, 2, 5):
        s.advance_fence("j", attempt)
        seen.append(s.read_fence("j"))
    return seen, s.get_bytes(ArtifactStore.attempt_key("j"))


def fence_refuses_an_older_attempt(s):
    s.advance_fence("j", 4)
    with pytest.raises(StaleAttempt, match="the fence of j holds attempt 4: attempt 3 is stale"):
        s.advance_fence("j", 3)
    return s.read_fence("j")


def fence_over_the_servers_plain_write(s):
    s.put_bytes(ArtifactStore.attempt_key("j"), b"2")  # what the server writes today
    s.advance_fence("j", 3)
    return s.read_fence("j")


def ranged_reads(s):
    s.put_bytes("r", b"0123456789")
    with pytest.raises(ValueError, match="must have 0 <= start < end"):
        s.get_range("r", 5, 5)
    with pytest.raises(NotFound, match=f"no artifact at {s.url}/nope"):
        s.get_range("nope", 0, 4)
    return s.get_range("r", 0, 4), s.get_range("r", 7, 10), s.get_range("r", 8, 20)


def url_of_a_key(s):
    return s.url_of("jobs/j/artifacts/m.pt").removeprefix(s.url)


CASES = [
    (bytes_round_trip, b"\x00data\xff"),
    (overwrite, b"new"),
    (empty_file, (b"", 0)),
    (exists_and_size, (False, True, True, 5)),
    (listing, ([("a.txt", 23), ("b/c.txt", 25)], ["j1/ATTEMPT", "j1/artifacts/a.txt", "j1/artifacts/b/c.txt",
                                                   "j10/artifacts/x"], [])),
    (listing_skips_unfinished_writes, [("kept", 1)]),
    (delete_prefix_leaves_siblings, ["j10/a", "j2/a"]),
    (missing_keys, ["NotFound", "NotFound"]),
    (files_round_trip, (True, (3 << 20) + 3, ["back.bin", "source.bin"])),
    (streamed_write, b"line 0\nline 1\nline 2\n"),
    (failed_streamed_write_keeps_the_old_file, b"previous"),
    (put_if_absent_twice, (True, False, b"first")),
    (put_if_absent_over_a_plain_write, (False, b"plain")),
    (fence_moves_forward, ([None, 0, 2, 2, 5], b"5")),
    (fence_refuses_an_older_attempt, 4),
    (fence_over_the_servers_plain_write, 3),
    (ranged_reads, (b"0123", b"789", b"89")),
    (url_of_a_key, "/jobs/j/artifacts/m.pt"),
]


def run_case(store, operation, tmp_path):
    """``operation(store)``, or ``operation(store, a scratch folder)`` for those that take one."""
    files = tmp_path / "files"
    files.mkdir()
    return operation(*((store, files) if operation.__code__.co_argcount == 2 else (store,)))


@pytest.mark.parametrize("operation, expected", CASES, ids=[op.__name__ for op, _ in CASES])
def test_store_operation(store, operation, expected, tmp_path):
    assert run_case(store, operation, tmp_path) == expected


def test_conditional_writes_are_atomic_on_both(store):
    assert store.capabilities().put_if_absent is Guarantee.ATOMIC
    assert store.capabilities().compare_and_swap is Guarantee.ATOMIC


WRITER = textwrap.dedent("""
    import sys, time
    from torchrelay.storage import ArtifactStore
    store = ArtifactStore(sys.argv[1], {options})
    with store.open_write("stream/out") as fh:
        fh.write(b"y" * (60 << 20))
        fh.flush()  # on S3: the first part of a multipart upload goes out
        print("part written", flush=True)
        time.sleep(120)
""")


def test_a_writer_killed_mid_upload_leaves_the_previous_file(store, request):
    store.put_bytes("stream/out", b"previous")
    options = s3_options(request.getfixturevalue("ceph")) if store.protocol == "s3" else {}
    proc = subprocess.Popen([sys.executable, "-c", WRITER.format(options=repr(options)), store.url],
                            stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)},
                            start_new_session=True)
    try:
        assert proc.stdout.readline() == b"part written\n", "the writer did not get to its first part"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert store.get_bytes("stream/out") == b"previous"
    assert list(store.list("stream")) == [("out", 8)]
    if store.protocol == "s3":  # the unfinished upload stays (invisible) until a lifecycle rule clears it
        cluster = request.getfixturevalue("ceph")
        bucket, _, prefix = store.root.partition("/")
        uploads = cluster.client().list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
        assert [u["Key"] for u in uploads] == [f"{prefix}/stream/out"]
        for upload in uploads:
            cluster.client().abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])


def test_a_failed_upload_is_aborted(ceph):
    store = ArtifactStore(f"s3://{ceph.bucket}/{uuid.uuid4().hex[:12]}", s3_options(ceph))
    with pytest.raises(RuntimeError), store.open_write("big") as fh:
        fh.write(b"z" * (60 << 20))
        fh.flush()
        raise RuntimeError("the writer fails after its first part")
    bucket, _, prefix = store.root.partition("/")
    assert ceph.client().list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []) == []
    assert not store.exists("big")


def test_racing_fence_advances_on_s3(ceph):
    from concurrent.futures import ThreadPoolExecutor

    store = ArtifactStore(f"s3://{ceph.bucket}/{uuid.uuid4().hex[:12]}", s3_options(ceph))
    attempts = [4, 12, 1, 9, 7, 11, 2, 10]

    def advance(attempt):
        try:
            store.advance_fence("j", attempt)
            return None
        except StaleAttempt as exc:
            return exc

    with ThreadPoolExecutor(len(attempts)) as pool:
        results = list(pool.map(advance, attempts))
    assert store.read_fence("j") == 12
    assert results[attempts.index(12)] is None


# ------------------------------------------------------------ what only the object store has

def test_rgw_wants_a_bare_etag(ceph):
    store = ArtifactStore(f"s3://{ceph.bucket}/probe", s3_options(ceph))
    found = store.capabilities()
    assert found.etag_form is EtagForm.BARE  # Ceph 16.2: a quoted If-Match is wrongly refused
    assert not store.exists(".relay-probe") and list(store.list("")) == []


@pytest.mark.parametrize("change, reason", [
    ({"secret_access_key": "not-the-secret-at-all"}, "the secret key does not match the access key"),
    ({"access_key_id": "NOSUCHACCESSKEY"}, "the access key is not known to the store"),
])
def test_bad_credentials_fail_at_check(ceph, change, reason):
    store = ArtifactStore(f"s3://{ceph.bucket}/x", s3_options(ceph, **change))  # nothing sent yet
    with pytest.raises(StorageError, match=f"the store s3://{ceph.bucket}/x is not usable: {reason}") as caught:
        store.check()
    assert "not-the-secret-at-all" not in str(caught.value) and ceph.secret_key not in str(caught.value)


def test_a_missing_bucket_fails_at_check(ceph):
    store = ArtifactStore("s3://no-such-bucket/x", s3_options(ceph))
    with pytest.raises(StorageError, match=r"the store s3://no-such-bucket/x is not usable: the bucket does not "
                                           r"exist \(NoSuchBucket\)"):
        store.check()
    with pytest.raises(StorageError, match="cannot read s3://no-such-bucket/x/k: the bucket does not exist"):
        store.get_bytes("k")  # not taken for a missing key


@pytest.fixture
def clean_aws_env(monkeypatch, tmp_path):
    """No AWS_* variable, and a home whose ~/.aws is empty."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_configured_by_the_environment(ceph, clean_aws_env, monkeypatch):
    for name, value in ceph.env().items():
        monkeypatch.setenv(name, value)
    store = ArtifactStore(f"s3://{ceph.bucket}/from-env")
    store.check()
    store.put_bytes("k", b"v")
    assert store.get_bytes("k") == b"v"


@pytest.mark.parametrize("profile", ["default", "ceph"])
def test_configured_by_aws_config_files(ceph, clean_aws_env, profile):
    aws = clean_aws_env / ".aws"
    aws.mkdir()
    section = "default" if profile == "default" else f"profile {profile}"
    (aws / "config").write_text(f"[{section}]\nregion = {ceph.region}\nendpoint_url = {ceph.endpoint_url}\n"
                                "s3 =\n    addressing_style = path\n")
    (aws / "credentials").write_text(f"[{profile}]\naws_access_key_id = {ceph.access_key}\n"
                                     f"aws_secret_access_key = {ceph.secret_key}\n")
    options = {} if profile == "default" else {"profile": profile}
    store = ArtifactStore(f"s3://{ceph.bucket}/from-config-{profile}", options)
    store.check()
    assert store.put_if_absent("k", b"v") and store.get_bytes("k") == b"v"


def test_the_cluster_stops_everything_it_started():
    reason = CephCluster.unavailable()
    if reason:
        pytest.skip(reason)
    cluster = CephCluster(bucket="stop-test")
    pids = [proc.pid for proc in cluster._daemons]
    assert len(pids) == 3 and cluster.memory_bytes() > 0
    cluster.stop()
    cluster.stop()
    assert not cluster.root.exists()
    assert [pid for pid in pids if Path(f"/proc/{pid}").exists()] == []
