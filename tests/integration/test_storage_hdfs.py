"""The store and rt.stream on HDFS through WebHDFS: against ``WebHdfsDouble`` (a protocol double
written for these tests, tests/services/webhdfs_double.py: not HDFS), or a real namenode.

``RELAY_TEST_HDFS`` may name a real HDFS folder the tests may write below, as a
``webhdfs://namenode:9870/tmp/relay-tests`` or ``hdfs://namenode:8020/tmp/relay-tests`` URL: the
same table of store operations (tests/integration/test_storage_s3.py's) and the same stream
then run against it instead of the double.
"""
from __future__ import annotations

import os
import uuid

import pytest
import torch

import torchrelay.train as rt
from services.webhdfs_double import WebHdfsDouble
from test_storage_s3 import CASES, run_case
from torchrelay.shards import pack
from torchrelay.storage import ArtifactStore, Guarantee

pytestmark = pytest.mark.timeout(120)
REAL = os.environ.get("RELAY_TEST_HDFS")


@pytest.fixture(scope="module")
def hdfs_root():
    """The root URL of an HDFS to write below: ``RELAY_TEST_HDFS``, else the protocol double."""
    if REAL:
        yield REAL.rstrip("/")
        return
    double = WebHdfsDouble()
    try:
        yield f"{double.url}/relay"
    finally:
        double.stop()


@pytest.fixture
def store(hdfs_root):
    return ArtifactStore(f"{hdfs_root}/{uuid.uuid4().hex[:12]}")


@pytest.mark.parametrize("operation, expected", CASES, ids=[op.__name__ for op, _ in CASES])
def test_store_operation(store, operation, expected, tmp_path):
    assert run_case(store, operation, tmp_path) == expected


def test_what_webhdfs_guarantees(store):
    if store.protocol not in ("webhdfs", "swebhdfs"):
        pytest.skip(f"{store.protocol}:// uses the generic backend")
    assert store.capabilities().put_if_absent is Guarantee.ATOMIC  # a rename that never replaces
    assert store.capabilities().compare_and_swap is Guarantee.CHECK_THEN_WRITE
    store.check()


def test_a_dataset_streams_from_hdfs(hdfs_root, tmp_path):
    url = f"{hdfs_root}/{uuid.uuid4().hex[:12]}/ids"
    index = pack({"id": torch.arange(90), "x": torch.randn(90, 3)}, url, shard_size=16 * 20)
    assert len(index.shards) == 6
    seen = []
    for rank in range(2):
        loader = rt.stream(url, batch_size=8, shuffle_buffer=20, rank=rank, world_size=2,
                           cache_dir=str(tmp_path / "cache"))
        seen += [i for batch in loader for i in batch["id"].tolist()]
    assert sorted(seen) == list(range(90))
    assert len(list((tmp_path / "cache").iterdir())) == 6  # a remote store: every shard fetched once, cached


def test_the_double_answers_as_hdfs_does():
    """What the backend relies on, asked of the double directly (a real namenode answers the same)."""
    import requests

    double = WebHdfsDouble()
    try:
        base = f"http://127.0.0.1:{double.port}/webhdfs/v1"
        for name in ("a", "b"):
            put = requests.put(f"{base}/d/{name}?op=CREATE&overwrite=false", allow_redirects=False)
            assert put.status_code == 307
            assert requests.put(put.headers["Location"], data=name.encode()).status_code == 201
        again = requests.put(f"{base}/d/a?op=CREATE&overwrite=false", allow_redirects=False)
        assert (again.status_code, again.json()["RemoteException"]["exception"]) == (403, "FileAlreadyExistsException")
        assert requests.put(f"{base}/d/a?op=RENAME&destination=/d/b").json() == {"boolean": False}
        assert requests.get(f"{base}/d/b?op=OPEN").content == b"b"
        missing = requests.get(f"{base}/d/none?op=GETFILESTATUS")
        assert (missing.status_code, missing.json()["RemoteException"]["exception"]) == (404, "FileNotFoundException")
    finally:
        double.stop()
