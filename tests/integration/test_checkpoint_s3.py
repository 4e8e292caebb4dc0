"""Checkpoints on a real Ceph (S3 through radosgw): a writer killed mid-upload leaves the previous one.

A child process commits a small checkpoint at step 5, then starts one of 96 MiB at step 10
(a multipart upload); the test SIGKILLs it while the upload is open (seen in the bucket's list of
multipart uploads, not guessed by time). The checkpoint that loads is step 5, ``latest`` names
it, and the abandoned step's folder holds no manifest.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch

import chaos
from conftest import kill_group
from torchrelay.storage import ArtifactStore
from torchrelay.train.checkpoint import CheckpointStore, decode_files

pytestmark = pytest.mark.timeout(180)

CHILD = textwrap.dedent("""
    import json, os, sys
    import torch
    from torchrelay.storage import ArtifactStore
    from torchrelay.train.checkpoint import CheckpointStore
    store = ArtifactStore(sys.argv[1], json.loads(os.environ["STORE_OPTIONS"]))
    checkpoints = CheckpointStore(store, "killed", keep=3)
    checkpoints.save({"w": torch.arange(10.0)}, 5)
    print("saved 5", flush=True)
    checkpoints.save({"w": torch.ones(24 << 20)}, 10)   # 96 MiB: a multipart upload
    print("saved 10", flush=True)
""")


def test_a_checkpoint_writer_killed_mid_upload_leaves_the_previous_one(ceph, tmp_path):
    url = f"s3://{ceph.bucket}/{uuid.uuid4().hex[:12]}"
    options = {"endpoint_url": ceph.endpoint_url, "region": ceph.region, "access_key_id": ceph.access_key,
               "secret_access_key": ceph.secret_key}
    prefix = url.split("/", 3)[3]
    s3 = ceph.client()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, url], env={**os.environ, "STORE_OPTIONS": json.dumps(options),
                                                                    "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "saved 5"

        def uploading() -> bool:
            found = s3.list_multipart_uploads(Bucket=ceph.bucket, Prefix=f"{prefix}/")
            return any("step-0000000010" in u["Key"] for u in found.get("Uploads", []))

        chaos.wait_until(uploading, 60, "the upload of step 10 to begin", interval=0.02)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        rest = proc.stdout.read()
    finally:
        kill_group(proc.pid, grace_s=0)
    assert "saved 10" not in rest, rest

    checkpoints = CheckpointStore(ArtifactStore(url, options), "killed", keep=3)
    assert checkpoints.folders().get(10) in (None, False)  # never committed
    assert checkpoints.latest_name() == "step-0000000005"
    loaded = checkpoints.load(decode=decode_files)
    assert loaded is not None and loaded.step == 5
    torch.testing.assert_close(loaded.state["w"], torch.arange(10.0))
