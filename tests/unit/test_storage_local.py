"""ArtifactStore on local folders and a generic fsspec store: opening URLs, conditional writes under races.

The same operations against a real Ceph (and the same table for a local folder) are in
tests/integration/test_storage_s3.py.
"""
from __future__ import annotations

import threading

import pytest

from torchrelay.errors import StaleAttempt, StorageError
from torchrelay.storage import ArtifactStore, connect
from torchrelay.storage.conditional import CHECK_THEN_WRITE_ONLY, LOCAL_FILES

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("url, missing, message", [
    ("s3://bucket/prefix", {"s3fs"}, r"the store s3://bucket/prefix needs s3fs \(pip install 'torchrelay\[s3\]'\)"),
    ("hdfs://namenode:8020/relay", {"pyarrow", "hdfs_native"},
     r"needs hdfs-native \(no Java; pip install 'torchrelay\[hdfs\]'\) or pyarrow \(with Java's libhdfs\): "
     r"no fsspec implementation of hdfs://"),
    ("gs://bucket/x", {"gcsfs"}, "needs gcsfs"),
    ("nosuchscheme://x/y", set(), "has a scheme no fsspec implementation knows"),
])
def test_a_scheme_without_its_package_fails_at_construction(monkeypatch, url, missing, message):
    real = connect._installed
    monkeypatch.setattr(connect, "_installed", lambda module: module not in missing and real(module))
    with pytest.raises(StorageError, match=message):
        ArtifactStore(url)


def test_a_url_with_a_password_is_refused_without_repeating_it():
    with pytest.raises(StorageError, match="holds a credential") as caught:
        ArtifactStore("s3://AKIAEXAMPLE:wJalrXUtnFEMIexample@bucket/prefix")
    assert "wJalrXUtnFEMIexample" not in str(caught.value)


def test_making_an_s3_store_sends_nothing():
    store = ArtifactStore("s3://no-such-bucket-anywhere/p", {"endpoint_url": "http://127.0.0.1:9"})
    assert (store.protocol, store.root, repr(store)) == ("s3", "no-such-bucket-anywhere/p",
                                                         "ArtifactStore('s3://no-such-bucket-anywhere/p')")


def test_a_local_folder_is_checked_and_left_clean(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    store.check()
    assert store.capabilities() == LOCAL_FILES
    assert list((tmp_path / "store").iterdir()) == []


def test_a_store_that_cannot_be_written_fails_its_check(tmp_path):
    store = ArtifactStore(str(tmp_path / "store"))
    (tmp_path / "store").rmdir()
    (tmp_path / "store").write_text("a file where the folder was")
    with pytest.raises(StorageError, match=f"the store {tmp_path / 'store'} is not usable"):
        store.check()


def race(count: int, work) -> list:
    """Run ``work(i)`` for i in range(count) in as many threads started together; their results or errors."""
    results: list = [None] * count
    start = threading.Barrier(count)

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = work(i)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_put_if_absent_has_one_winner_among_racing_writers(tmp_path):
    store = ArtifactStore(str(tmp_path))
    results = race(8, lambda i: store.put_if_absent("jobs/j/claim", f"writer {i}".encode()))
    assert results.count(True) == 1 and results.count(False) == 7
    assert store.get_bytes("jobs/j/claim") == f"writer {results.index(True)}".encode()
    assert [key for key, _ in store.list("jobs/j")] == ["claim"]


def test_racing_fence_advances_never_move_it_back(tmp_path):
    store = ArtifactStore(str(tmp_path))
    attempts = [3, 9, 1, 7, 5, 8, 2, 6]
    results = race(len(attempts), lambda i: store.advance_fence("j", attempts[i]))
    assert store.read_fence("j") == 9
    assert all(r is None or isinstance(r, StaleAttempt) for r in results)
    assert results[attempts.index(9)] is None  # the newest attempt always gets through
    assert [key for key, _ in store.list("jobs/j")] == ["ATTEMPT"]  # the lock file is a temp file


def test_a_generic_fsspec_store_checks_then_writes(tmp_path):
    store = ArtifactStore(f"memory://relay-test-{tmp_path.name}")
    store.check()
    assert store.capabilities() == CHECK_THEN_WRITE_ONLY
    assert (store.put_if_absent("k", b"1"), store.put_if_absent("k", b"2"), store.get_bytes("k")) == (True, False, b"1")
    store.advance_fence("j", 2)
    with pytest.raises(StaleAttempt, match="holds attempt 2: attempt 1 is stale"):
        store.advance_fence("j", 1)
    store.advance_fence("j", 4)
    assert store.read_fence("j") == 4
    store.delete_prefix("")


def test_a_link_planted_in_a_local_store_is_not_followed_on_read(tmp_path):
    from torchrelay.errors import NotFound

    secret = tmp_path / "admin.token"
    secret.write_text("rlu_secret")
    store = ArtifactStore(str(tmp_path / "store"))
    store.put_bytes("jobs/job-1/artifacts/own.txt", b"mine")
    store.put_bytes("jobs/job-2/artifacts/theirs.txt", b"theirs")
    folder = tmp_path / "store" / "jobs" / "job-1" / "artifacts"
    (folder / "link").symlink_to(secret)  # what a job's code can do in its own folder
    (folder / "peer").symlink_to(tmp_path / "store" / "jobs" / "job-2" / "artifacts")
    for key in ("jobs/job-1/artifacts/link", "jobs/job-1/artifacts/peer/theirs.txt"):
        for read in (store.get_bytes, store.size, lambda k: store.open_read(k).__enter__(),
                     lambda k: store.get_file(k, tmp_path / "copy")):
            with pytest.raises(NotFound, match="symbolic link"):
                read(key)
    assert store.get_bytes("jobs/job-1/artifacts/own.txt") == b"mine"
    assert not (tmp_path / "copy").exists()
