"""A job whose store and dataset live on a real CephFS mount (ceph-mds + ceph-fuse on the test Ceph).

The common HPC case: a POSIX folder mounted at the same path on every host. The server's store
is a folder on the mount, the dataset is packed into another; a 2-rank DDP job streams it,
checkpoints there (DCP files, fsync'd, committed by a manifest linked into place), its rank 1 is
SIGKILLed mid-way through the second epoch, and the restarted attempt resumes from the
checkpoint on the mount: every sample trained on exactly once per epoch, the model downloaded.
Root only (FUSE); skipped with the reason elsewhere.
"""
from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch
import yaml

from samples import assert_each_sample_once_per_epoch, kill_rank_1_mid_second_epoch, resumed_from, stream_job
from torchrelay.client.sdk import RelayClient
from torchrelay.shards import pack
from torchrelay.spec import JobState
from torchrelay.storage import ArtifactStore
from torchrelay.train.checkpoint import CheckpointStore

pytestmark = pytest.mark.timeout(300)
JOBS = Path(__file__).resolve().parents[1] / "jobs"


@pytest.fixture
def cephfs(ceph):
    reason = ceph.cephfs_unavailable()
    if reason:
        pytest.skip(reason)
    return ceph.mount_cephfs()


@pytest.mark.slow  # a second cluster job with a kill (~60 s): make test-all
def test_a_job_trains_checkpoints_and_restarts_on_cephfs(cephfs, cluster_factory, tmp_path):
    base = cephfs / uuid.uuid4().hex[:12]
    samples = 240
    pack({"x": torch.randn(samples, 8), "id": torch.arange(samples)}, str(base / "data"), shard_size=24 * 40)
    config = tmp_path / "server.yaml"
    config.write_text(yaml.safe_dump({"store": str(base / "store")}))
    records = tmp_path / "records"
    records.mkdir()
    cluster = cluster_factory(1, server_config=config)
    store = ArtifactStore(str(base / "store"))
    with RelayClient(cluster.address) as c:
        job = c.submit(stream_job(str(base / "data"), records), base_dir=JOBS / "storage")
        kill_rank_1_mid_second_epoch(c, job.id, CheckpointStore(store, job.id), records)
        final = c.wait(job.id, timeout=180)
        assert final.state == JobState.SUCCEEDED, final
        assert final.restarts == 1
        assert_each_sample_once_per_epoch(records, resumed_from(c, job.id), samples, epochs=2)
        c.download(job.id, tmp_path / "out")
    assert set(torch.load(tmp_path / "out" / "model.pt", weights_only=True)) == {"weight", "bias"}
    folders = CheckpointStore(store, job.id).folders()
    assert len(folders) == 2 and all(folders.values()), folders
    # the files are on the CephFS mount itself, not in a local cache
    assert (base / "store" / "jobs" / job.id / "checkpoints" / "latest").is_file()
    assert store.capabilities().put_if_absent.value == "atomic"
