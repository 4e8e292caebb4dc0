"""The agent gives each launch its own GPU indices (CUDA_VISIBLE_DEVICES): two jobs on one
node never share a device, and a CPU job on a GPU node sees none. The node's "GPUs" are only
declared (``--gpus 3``); the jobs read the variable and never touch a device."""
from __future__ import annotations

import shlex
import sys
import time

import pytest

from torchrelay.client.cluster import AgentOptions
from torchrelay.client.sdk import RelayClient
from torchrelay.spec import JobState

pytestmark = pytest.mark.timeout(180)


def _print_devices_until(release) -> str:
    code = ("import os, time; print('devices=' + os.environ.get('CUDA_VISIBLE_DEVICES', 'unset'), flush=True); "
            f"[time.sleep(0.05) for _ in iter(lambda: os.path.exists({str(release)!r}), True)]")
    return f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}"


def test_each_launch_gets_its_own_devices(cluster_factory, tmp_path):
    cluster = cluster_factory(1, agent_options=[AgentOptions(cpus=4, gpus=3, gpu_type="fake")])
    release = tmp_path / "release"
    entry = _print_devices_until(release)
    with RelayClient(cluster.address) as c:
        jobs = [c.submit({"name": "two", "entrypoint": entry, "workers": 1, "resources": {"cpu": 1, "gpu": 2},
                          "env": {"CUDA_VISIBLE_DEVICES": "0,1,2"}}, upload=False),  # a job cannot widen its share
                c.submit({"name": "one", "entrypoint": entry, "workers": 1, "resources": {"cpu": 1, "gpu": 1}},
                         upload=False),
                c.submit({"name": "cpu", "entrypoint": entry, "workers": 1, "resources": {"cpu": 1}}, upload=False)]

        def printed(job_id):
            return next((line.text for line in c.iter_logs(job_id) if line.text.startswith("devices=")), None)

        deadline = time.monotonic() + 90
        while not all(printed(j.id) for j in jobs):
            assert time.monotonic() < deadline, [(c.job(j.id).state, c.job(j.id).failure) for j in jobs]
            time.sleep(0.2)
        seen = {j.id: printed(j.id).removeprefix("devices=") for j in jobs}
        release.touch()
        final = [c.wait(j.id, timeout=60, poll_s=0.2) for j in jobs]
    assert [f.state for f in final] == [JobState.SUCCEEDED] * 3, [f.failure for f in final]
    two, one, cpu = (seen[j.id] for j in jobs)
    assert cpu == ""  # a CPU-only launch on a GPU node sees no device
    assert len(two.split(",")) == 2 and len(one.split(",")) == 1
    assert sorted(two.split(",") + one.split(",")) == ["0", "1", "2"]  # disjoint, all of the node's
