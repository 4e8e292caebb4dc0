"""A pipeline job on the platform: the plan is chosen on the workers and shown by `relay status`."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchrelay.client.sdk import RelayClient
from torchrelay.spec import JobSpec, JobState

pytestmark = pytest.mark.timeout(240)
CHARLM = Path(__file__).resolve().parents[2] / "examples" / "charlm"


def test_pipeline_job_runs_and_status_shows_its_plan(cluster_factory, tmp_path):
    import inspect

    text = inspect.getsource(json) * 3  # a text that ships with Python
    work = tmp_path / "charlm"
    work.mkdir()
    for name in ("data.py", "model.py", "train_pipeline.py"):
        (work / name).write_text((CHARLM / name).read_text())
    (work / "corpus.txt").write_text(text)
    cluster = cluster_factory(1)
    with RelayClient(cluster.address) as c:
        spec = JobSpec.parse({"name": "pipe", "workers": 2,
                              "entrypoint": "python train_pipeline.py --data corpus.txt --steps 20 --layers 2",
                              "strategy": {"kind": "pipeline", "microbatches": 4}})
        info = c.submit(spec, base_dir=work)
        final = c.wait(info.id, timeout=200)
        logs = "\n".join(line.text for line in c.logs(info.id).lines)
        assert final.state == JobState.SUCCEEDED, logs
        assert "final loss=" in logs
    proc = subprocess.run([sys.executable, "-m", "torchrelay.client.cli.main", "status", info.id, "-o", "json"],
                          capture_output=True, text=True, env={**os.environ, "RELAY_ADDRESS": cluster.address})
    plan = json.loads(proc.stdout)["pipeline_plan"]
    assert len(plan["stages"]) == 2 and "stage" in plan["text"]
