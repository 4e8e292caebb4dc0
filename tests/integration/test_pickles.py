"""Nothing runs from a pickle the platform did not write.

Malicious pickles (unpickling one runs ``os.system("touch MARKER")``) are placed in a job's store
as artifacts and checkpoint files; then ``relay download`` and ``relay status`` run, the server
serves every route that reads them, and a restarted worker resumes from the checkpoints. The
marker file must not exist afterwards, and where a load is refused the message says why.
"""
from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import torch

from logins import bearer
from torchrelay.client.sdk import RelayClient


class _Evil:
    """Unpickling this runs ``touch marker`` (a visible side effect)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _payloads(marker: Path) -> dict[str, bytes]:
    buffer = io.BytesIO()
    torch.save({"weight": _Evil(marker)}, buffer)
    raw = pickle.dumps(_Evil(marker))
    return {"model.pt": buffer.getvalue(), "evil.pkl": raw, "pipeline-plan.json": raw,
            "sharded-layout.json": buffer.getvalue(), "nested/state.pth": raw}


def _cli(*args: str, address: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchrelay.client.cli.main", *args], cwd=cwd,
                          env={**os.environ, "RELAY_ADDRESS": address}, capture_output=True, text=True, timeout=120)


def test_the_payloads_are_live(tmp_path):
    """The control: unpickling these payloads does create the marker (so its absence below means something)."""
    marker = tmp_path / "PWNED"
    for name, data in _payloads(marker).items():
        (tmp_path / "payload").write_bytes(data)
        loader = "torch.load(f, weights_only=False)" if data[:2] == b"PK" else "pickle.load(f)"
        subprocess.run([sys.executable, "-c", f"import pickle, torch; f = open({str(tmp_path / 'payload')!r}, 'rb'); "
                        f"{loader}"], capture_output=True, timeout=120)
        assert marker.exists(), name
        marker.unlink()


def test_relay_download_and_the_server_never_unpickle_what_a_job_stored(server, relay_home, tmp_path):
    marker = tmp_path / "PWNED"
    payloads = _payloads(marker)
    with RelayClient(server) as c:
        job_id = c.submit({"entrypoint": "python x.py"}, upload=False).id
    for path, data in payloads.items():
        assert httpx.put(f"{server}/api/v1/jobs/{job_id}/artifacts/{path}", headers=bearer(server), content=data).status_code == 200
    # checkpoint files as a worker would have left them, pickles where DCP keeps its metadata and values
    step = relay_home / "store" / "jobs" / job_id / "checkpoints" / "step-0000000001"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    (step / "__0_0.distcp").write_bytes(payloads["model.pt"])
    (step.parent / "latest").write_text(step.name)

    dest = tmp_path / "downloaded"
    done = _cli("download", job_id, str(dest), address=server, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert {str(p.relative_to(dest)): p.read_bytes() for p in dest.rglob("*") if p.is_file()} == payloads
    status = _cli("status", job_id, address=server, cwd=tmp_path)
    assert "Traceback" not in status.stdout + status.stderr
    assert _cli("status", job_id, "-o", "json", address=server, cwd=tmp_path).returncode == 0

    for path, data in payloads.items():
        assert httpx.get(f"{server}/api/v1/jobs/{job_id}/artifacts/{path}", headers=bearer(server)).content == data
    listed = httpx.get(f"{server}/api/v1/jobs/{job_id}/checkpoints", headers=bearer(server)).json()
    assert {x["path"] for x in listed} >= {"latest", f"{step.name}/.metadata", f"{step.name}/__0_0.distcp"}
    for entry in listed:
        assert httpx.get(f"{server}/api/v1/jobs/{job_id}/checkpoints/{entry['path']}", headers=bearer(server)).status_code == 200
    httpx.post(f"{server}/api/v1/jobs/{job_id}/tensorboard", headers=bearer(server))
    for route in ("/", f"/api/v1/jobs/{job_id}", f"/api/v1/jobs/{job_id}/artifacts", "/metrics"):
        httpx.get(f"{server}{route}", headers=bearer(server))
    with RelayClient(server) as c:
        c.cancel(job_id)
    assert not marker.exists()


_FIRST_RUN = """
import os, sys, torch
import torchrelay.train as rt

class Evil:
    def __reduce__(self):
        return (os.system, ("touch " + sys.argv[1],))

model = torch.nn.Linear(3, 2)
rt.save_checkpoint({"model": model.state_dict(), "step": 1}, 1)
# what a tampered job could leave: a value whose unpickling runs code
rt.save_checkpoint({"model": model.state_dict(), "evil": Evil()}, 3)
rt.wait_for_checkpoint()
"""

_RESTART = """
import json, sys
import torchrelay.train as rt

loaded = rt.load_checkpoint()
print("RESUMED", json.dumps(None if loaded is None else loaded[1]))
"""


def test_a_restarted_worker_never_runs_a_pickle_planted_in_its_checkpoints(tmp_path):
    marker = tmp_path / "PWNED"
    store = tmp_path / "store"
    env = {**os.environ, "RELAY_STORE_URL": str(store), "RELAY_JOB_ID": "job-7", "PYTHONUNBUFFERED": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "RELAY_ATTEMPT"):
        env.pop(name, None)
    first = subprocess.run([sys.executable, "-c", textwrap.dedent(_FIRST_RUN), str(marker)], env=env,
                           capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    assert not marker.exists()
    # step 2: a checkpoint whose DCP metadata is a malicious pickle, its manifest rewritten to match
    # (as an attacker with write access to the store could)
    from torchrelay.train import checkpoint_dcp
    from torchrelay.train.checkpoint import MANIFEST, build_manifest

    checkpoints = store / "jobs" / "job-7" / "checkpoints"
    good = checkpoints / "step-0000000001"
    bad = checkpoints / "step-0000000002"
    bad.mkdir()
    for f in good.iterdir():
        if f.name != MANIFEST:
            (bad / f.name).write_bytes(f.read_bytes())
    (bad / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    entries = {f.name: checkpoint_dcp.digest_entry(f.read_bytes()) for f in bad.iterdir()}
    (bad / MANIFEST).write_bytes(build_manifest(2, entries, created=1.0))

    env["RELAY_ATTEMPT"] = "1"  # the job's next attempt, as the agent starts it after a restart
    restart = subprocess.run([sys.executable, "-c", textwrap.dedent(_RESTART)], env=env,
                             capture_output=True, text=True, timeout=120)
    assert restart.returncode == 0, restart.stderr
    assert not marker.exists()
    assert "RESUMED 1" in restart.stdout, restart.stdout + restart.stderr
    said = restart.stderr
    assert "step-0000000003 skipped" in said and "weights_only=True" in said, said
    assert "step-0000000002 skipped" in said and "is not allowed in checkpoint metadata" in said, said
