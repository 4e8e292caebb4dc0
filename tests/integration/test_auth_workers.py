"""A real job's workers talk to the server with their own token (RELAY_TOKEN, set by the agent):
their own job's artifacts yes, another job's or a submission no; the token dies with the attempt."""
from pathlib import Path

import httpx
import pytest

from torchrelay.client.sdk import RelayClient
from torchrelay.spec import JobState

pytestmark = pytest.mark.timeout(180)
JOBS = Path(__file__).resolve().parents[1] / "jobs" / "worker_token"


def test_a_workers_token_reaches_its_own_job_only(cluster_factory):
    cluster = cluster_factory(1)
    with RelayClient(cluster.address) as c:
        other = c.submit({"name": "other", "entrypoint": "python -c pass"}, upload=False)
        c.wait(other.id, timeout=60, poll_s=0.5)
        job = c.submit({"name": "talks", "entrypoint": f"python worker.py {other.id}"}, base_dir=JOBS)
        final = c.wait(job.id, timeout=120, poll_s=0.5)
        lines = [line.text for line in c.iter_logs(job.id)]
        assert final.state == JobState.SUCCEEDED, (final.failure, lines)
        token = next(line.split()[1] for line in lines if line.startswith("token "))
        assert token.startswith(f"rlw_{job.id}.1.") and f"own job {job.id}" in lines
        assert {"other artifacts refused Forbidden", "other logs refused Forbidden",
                "other submit refused Forbidden"} <= set(lines), lines
        assert c.artifact_bytes(job.id, "from-worker.txt") == b"written by my worker"
        # the attempt is over: the worker's token is refused now
        r = httpx.get(f"{cluster.address}/api/v1/jobs/{job.id}", headers={"authorization": f"Bearer {token}"})
        assert r.status_code == 401 and "ended with its attempt" in r.json()["detail"]
