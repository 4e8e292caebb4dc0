"""The embedded cluster with its artifact store on a real Ceph (S3 through radosgw, tests/services/ceph.py).

The server is configured by a config file (the store's URL, endpoint, region and *its*
credentials); the agents hold a second key of their own in their environment, which their
workers use. Checked end to end: the bundle stored and fetched through S3, training data
streamed from the bucket, DCP checkpoints written by both ranks (async), a worker killed
mid-epoch and the job restarted from its S3 checkpoint with every sample trained once per epoch,
``relay download``, the newest checkpoint damaged and the previous one loaded instead, the
server's secret in no worker's environment, job log or server log; a server that cannot use
its store refuses to start, naming why; and the store going away mid-job: the save fails
naming the URL, the job goes on, ``relay status`` shows the failed save.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import yaml

import chaos
from samples import assert_each_sample_once_per_epoch, kill_rank_1_mid_second_epoch, resumed_from, stream_job
from conftest import kill_group
from torchrelay.client.sdk import RelayClient
from torchrelay.errors import StorageError
from torchrelay.server.main import serve
from torchrelay.shards import pack
from torchrelay.spec import JobSpec, JobState
from torchrelay.storage import ArtifactStore
from torchrelay.train.checkpoint import CheckpointStore, decode_files

pytestmark = pytest.mark.timeout(300)
JOBS = Path(__file__).resolve().parents[1] / "jobs"
CLI = [sys.executable, "-m", "torchrelay.client.cli.main"]
AWS_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                 "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_PROFILE")


@pytest.fixture
def s3_setup(ceph, tmp_path, monkeypatch):
    """(store URL, server config file, the agents' environment, a store the test reads with)."""
    for name in AWS_VARIABLES:  # the server must find its credentials in its config file alone
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    url = f"s3://{ceph.bucket}/{uuid.uuid4().hex[:12]}"
    options = {"endpoint_url": ceph.endpoint_url, "region": ceph.region, "access_key_id": ceph.access_key,
               "secret_access_key": ceph.secret_key}
    config = tmp_path / "server.yaml"
    config.write_text(yaml.safe_dump({"store": {"url": url, "options": options}}))
    agent_access, agent_secret = ceph.add_key()
    agent_env = {"AWS_ACCESS_KEY_ID": agent_access, "AWS_SECRET_ACCESS_KEY": agent_secret}
    return url, config, agent_env, ArtifactStore(url, options)


def run_cli(*args: str, address: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], env={**os.environ, "RELAY_ADDRESS": address}, capture_output=True,
                          text=True, timeout=60)


def describe(c: RelayClient, job_id: str) -> str:
    info = c.job(job_id)
    lines = "\n".join(f"  {line.rank}: {line.text}" for line in list(c.iter_logs(job_id))[-30:])
    return f"{info.id} {info.state.value} failure={info.failure}\n{lines}"


def test_a_job_on_s3_streams_checkpoints_restarts_downloads_and_keeps_secrets(s3_setup, cluster_factory, tmp_path):
    """A 2-rank DDP job streams its data from the bucket and checkpoints there (async); rank 1 is
    killed mid-epoch; the restarted attempt resumes from the S3 checkpoint with the stream's
    position: over the run every sample is trained on exactly once per epoch (counted)."""
    url, config, agent_env, store = s3_setup
    samples = 240
    pack({"x": torch.randn(samples, 8), "id": torch.arange(samples)}, f"{url}/data/ids", shard_size=24 * 40,
         storage_options=store_options_of(config))
    records = tmp_path / "records"
    records.mkdir()
    cluster = cluster_factory(1, server_config=config, agent_env=agent_env)
    with RelayClient(cluster.address) as c:
        job = c.submit(stream_job(f"{url}/data/ids", records), base_dir=JOBS / "storage")
        environments = kill_rank_1_mid_second_epoch(c, job.id, CheckpointStore(store, job.id), records)
        final = c.wait(job.id, timeout=180)
        assert final.state == JobState.SUCCEEDED, describe(c, job.id)
        assert final.restarts == 1
        # restarted from the S3 checkpoint mid-epoch, and no sample was repeated or skipped
        assert_each_sample_once_per_epoch(records, resumed_from(c, job.id), samples, epochs=2)

        # workers reach the store with the agent's key; the server's secret is nowhere it should not be
        for env in environments.values():
            assert env["RELAY_STORE_URL"] == url
            assert json.loads(env["RELAY_STORE_OPTIONS"]) == {"endpoint_url": store.public_options["endpoint_url"],
                                                              "region": store.public_options["region"]}
            assert env["AWS_SECRET_ACCESS_KEY"] == agent_env["AWS_SECRET_ACCESS_KEY"]
            assert store_secret(config) not in "\n".join(env.values())
        logs = "\n".join(line.text for line in c.iter_logs(job.id))
        assert store_secret(config) not in logs
        assert store_secret(config) not in (cluster.home / "logs" / "server.log").read_text()

        # the bundle, both ranks' shares of every checkpoint and the model are objects in the bucket
        keys = [key for key, _size in store.list("")]
        assert any(key.startswith("bundles/") for key in keys), keys
        checkpoints = CheckpointStore(store, job.id, keep=2)
        folders = checkpoints.folders()
        assert len(folders) == 2 and all(folders.values()), folders
        newest = max(folders)
        files = {key.rsplit("/", 1)[1] for key in keys if f"/checkpoints/step-{newest:010d}/" in key}
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "MANIFEST.json"} <= files, files

        done = run_cli("download", job.id, str(tmp_path / "out"), address=cluster.address)
        assert done.returncode == 0, done.stderr
        model = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
        assert set(model) == {"weight", "bias"}

    # damage the newest checkpoint: loading verifies it, skips it, and falls back to the one before
    damaged = f"{checkpoints.prefix}/step-{newest:010d}/__1_0.distcp"
    data = bytearray(store.get_bytes(damaged))
    data[len(data) // 2] ^= 0xFF
    store.put_bytes(damaged, bytes(data))
    loaded = checkpoints.load(decode=lambda cps, name, group: decode_files(cps, name, group, rank=0, world_size=2))
    assert loaded is not None and loaded.step == min(folders)
    assert loaded.skipped[0][0] == f"step-{newest:010d}" and "__1_0.distcp" in loaded.skipped[0][1]


def store_options_of(config: Path) -> dict:
    return yaml.safe_load(config.read_text())["store"]["options"]


def store_secret(config: Path) -> str:
    return yaml.safe_load(config.read_text())["store"]["options"]["secret_access_key"]


@pytest.mark.slow  # the gateway stopped and started again, a job (~40 s): make test-all
def test_the_store_going_away_fails_a_save_and_the_job_goes_on(ceph, s3_setup, cluster_factory, tmp_path):
    url, config, agent_env, store = s3_setup
    cluster = cluster_factory(1, server_config=config, agent_env=agent_env)
    gates = tmp_path / "gates"
    gates.mkdir()
    spec = JobSpec.parse({"name": "outage", "entrypoint": f"python outage.py {gates}", "workers": 1,
                          "resources": {"cpu": 1}})
    with RelayClient(cluster.address) as c:
        job = c.submit(spec, base_dir=JOBS / "storage")
        chaos.wait_until(lambda: (gates / "saved-2").exists(), 120, "the save of step 2")
        ceph.stop_gateway()
        try:
            (gates / "go-4").touch()
            chaos.wait_until(lambda: (gates / "after-4").exists(), 120, "the failed save of step 4")
        finally:
            ceph.start_gateway()
        (gates / "go-6").touch()
        final = c.wait(job.id, timeout=120)
        assert final.state == JobState.SUCCEEDED, describe(c, job.id)
        logs = "\n".join(line.text for line in c.iter_logs(job.id))
        assert "step 4: checkpoint FAILED" in logs and "step 6: checkpoint s3://" in logs, logs
        assert f"{url}/jobs/{job.id}/checkpoints/step-0000000004" in logs, logs  # the error names the URL
        assert sorted(CheckpointStore(store, job.id).folders()) == [2, 6]

        shown = run_cli("status", job.id, address=cluster.address)
        assert shown.returncode == 0, shown.stderr
        assert "checkpoints: 1 save(s) failed, the last at step 4" in shown.stdout, shown.stdout


def test_a_server_that_cannot_use_its_store_refuses_to_start(ceph, s3_setup, tmp_path):
    """`relay server` with a wrong secret exits 1 before it listens, with the store's reason."""
    _url, config, _agent_env, _store = s3_setup
    data = yaml.safe_load(config.read_text())
    data["store"]["options"]["secret_access_key"] = "not-the-secret-x9"
    config.write_text(yaml.safe_dump(data))
    proc = subprocess.Popen([*CLI, "server", "--port", "0", "--config", str(config)],
                            env={**os.environ, "RELAY_HOME": str(tmp_path / "home")}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=60)
    finally:
        kill_group(proc.pid)
    assert proc.returncode == 1, output
    assert "SignatureDoesNotMatch" in output and "s3://" in output, output
    assert "not-the-secret-x9" not in output and ceph.secret_key not in output
    assert not (tmp_path / "home" / "server.json").exists()


@pytest.mark.parametrize("store_url, reason", [
    ("s3://no-such-bucket/p", "the bucket does not exist (NoSuchBucket)"),
    ("gs://bucket/prefix", "needs gcsfs"),
])
def test_a_missing_bucket_or_package_stops_the_server_before_it_listens(ceph, s3_setup, tmp_path, store_url, reason):
    _url, config, _agent_env, _store = s3_setup
    with pytest.raises(StorageError, match=re.escape(reason)):
        serve(store_url=store_url, config_file=config, home=tmp_path)
    assert not (tmp_path / "server.json").exists()
