"""fsdp as a job setting on the platform: a training state too large for `memory:` fails as ddp with the figures
and trains as fsdp on the same workers; `relay status` shows the mesh; `relay submit --dry-run --profile`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from torchrelay.client.sdk import RelayClient
from torchrelay.spec import JobSpec, JobState

pytestmark = pytest.mark.timeout(300)

# 8 × Linear(2048, 2048) with Adam: 128 MiB of parameters. prepare's pre-flight check counts what the worker process
# holds besides training (its interpreter with torch and gloo: about 320 MiB) plus the training state: one ddp worker
# of 2 needs about 320 + 640 MiB (parameters, gradients, DDP's buckets, Adam's two moments), one fsdp worker about
# 320 + 288 MiB (half of each, plus one layer gathered). 780 MiB per worker lies between, about 170 MiB from either.
# The agents run without cgroups here: the test is about the pre-flight figures, and a torchrun launch's cgroup also
# holds torchrun itself (about 300 MiB more than memory × workers allows for; see the report of issue 17).
TRAIN = textwrap.dedent("""
    import torch
    import torchrelay.train as rt

    ctx = rt.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)])
    model, opt = rt.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    for step in range(1, 4):
        loss = model(torch.randn(8, 2048)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        rt.report(step, loss=loss.item())
    print("trained", flush=True)
    rt.shutdown()
""")
MEMORY = "780MiB"


def _spec(kind: str) -> JobSpec:
    return JobSpec.parse({"name": f"big-{kind}", "workers": 2, "entrypoint": f"{sys.executable} train.py",
                          "resources": {"memory": MEMORY}, "strategy": {"kind": kind}})


def _relay(*args: str, address: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **({"RELAY_ADDRESS": address} if address else {})}
    return subprocess.run([sys.executable, "-m", "torchrelay.client.cli.main", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=240)


def test_too_large_for_ddp_trains_as_fsdp_on_the_same_workers(cluster_factory, tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    monkeypatch.setenv("RELAY_AGENT_CGROUPS", "off")
    cluster = cluster_factory(1)
    with RelayClient(cluster.address) as c:
        ddp = c.submit(_spec("ddp"), base_dir=tmp_path)
        fsdp = c.submit(_spec("fsdp"), base_dir=tmp_path)
        failed, done = c.wait(ddp.id, timeout=240), c.wait(fsdp.id, timeout=240)
        fsdp_logs = "\n".join(line.text for line in c.logs(fsdp.id).lines)
    assert failed.state == JobState.FAILED
    reason = "\n".join(failed.failure.last_lines)
    assert "InsufficientMemory: memory: the training state needs" in reason, reason
    assert "under ddp on 2 workers" in reason and "but each worker has 780.0MiB" in reason
    assert "strategy fsdp on the same 2 workers needs" in reason and "(fits)" in reason, reason
    assert done.state == JobState.SUCCEEDED, (done.failure, fsdp_logs)
    assert "trained" in fsdp_logs
    assert done.last_metrics["memory_optimizer_state"] == pytest.approx(8 * (2048 * 2048 + 2048) * 4, rel=0.01)
    status = _relay("status", fsdp.id, "-o", "json", address=cluster.address)
    layout = json.loads(status.stdout)["sharded_layout"]
    assert layout["mesh"]["dp"] == 2 and [r["rank"] for r in layout["ranks"]] == [0, 1]
    assert all(r["fraction"] == pytest.approx(0.5, abs=0.01) for r in layout["ranks"])
    assert "mesh dp 2 (2 ranks)" in _relay("status", fsdp.id, address=cluster.address).stdout


def test_submit_dry_run_profile_sets_the_memory_per_worker(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "job.yaml").write_text(f"entrypoint: {sys.executable} train.py\nworkers: 2\nstrategy: {{kind: fsdp}}\n")
    proc = _relay("submit", "job.yaml", "--dry-run", "--profile", "-o", "json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    memory = json.loads(proc.stdout)["resources"]["memory"]
    assert "profile: one worker of 2 under fsdp: parameters" in proc.stderr
    assert memory % (64 << 20) == 0 and memory > 160 << 20  # at least the training state; a multiple of 64 MiB
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"entrypoint: {sys.executable} -c 'print(1)'\n")
    refused = _relay("submit", "bad.yaml", "--dry-run", "--profile", cwd=tmp_path)
    assert refused.returncode == 1 and "ended without a profile" in refused.stderr
