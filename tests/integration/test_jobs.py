"""Server + 2 agents + gloo workers on 127.0.0.1, driven through the SDK."""
import time
from pathlib import Path

import pytest

from conftest import group_members
from torchrelay.client.sdk import RelayClient
from torchrelay.spec import JobSpec, JobState

pytestmark = pytest.mark.timeout(240)
JOBS = Path(__file__).resolve().parents[1] / "jobs" / "plain"


def plain_spec(mode="ok"):
    return JobSpec.parse({"name": "allreduce", "entrypoint": f"python allreduce.py {mode}", "workers": 2})


def worker_pids(home: Path) -> list[int]:
    """Processes whose command line runs a test job's script under this RELAY_HOME, and the
    ranks an agent's warm zygote forked (they show the zygote's command line)."""
    out, zygotes = [], {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            env = (entry / "environ").read_bytes()
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if str(home).encode() not in env:
            continue
        if "allreduce.py" in cmd:
            out.append(int(entry.name))
        elif "torchrelay.agent.zygote" in cmd:
            zygotes[int(entry.name)] = ppid
    out += [pid for pid, parent in zygotes.items() if parent in zygotes]  # forked by a zygote
    return out


def test_two_nodes_two_workers_succeed(cluster_factory):
    cluster = cluster_factory(2)
    with RelayClient(cluster.address) as c:
        spec = JobSpec.parse({"name": "allreduce", "entrypoint": "python allreduce.py", "nodes": 2,
                              "workers_per_node": 1})
        info = c.submit(spec, base_dir=JOBS)
        final = c.wait(info.id, timeout=120)
        assert final.state == JobState.SUCCEEDED, final
        assert sorted(p.node_name for p in final.placement) == ["agent-0", "agent-1"]
        texts = [line.text for line in c.follow_logs(info.id)]
        assert "rank 0/2 sum=3" in texts and "rank 1/2 sum=3" in texts
        assert [e.state for e in final.events][-1] == JobState.SUCCEEDED
        warm = [e.message for e in final.events if "forked from the warm zygote" in e.message]
        assert len(warm) == 2, final.events  # each node's launch says how it started


def test_failing_rank_fails_job_and_ends_peers(cluster_factory):
    cluster = cluster_factory(2)
    with RelayClient(cluster.address) as c:
        spec = JobSpec.parse({"name": "fails", "entrypoint": "python allreduce.py fail", "nodes": 2,
                              "workers_per_node": 1})
        info = c.submit(spec, base_dir=JOBS)
        final = c.wait(info.id, timeout=120)
        assert final.state == JobState.FAILED
        assert final.failure.rank == 1 and final.failure.exit_code == 3
        assert any("about to fail with code 3" in line for line in final.failure.last_lines)
    # the healthy rank (sleeping 300 s) was ended by the platform
    deadline = time.monotonic() + 60
    while worker_pids(cluster.home) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert worker_pids(cluster.home) == []


def test_cancel_mid_run_leaves_no_process(cluster_factory):
    cluster = cluster_factory(1)
    with RelayClient(cluster.address) as c:
        info = c.submit(plain_spec("sleep"), base_dir=JOBS)
        for line in c.follow_logs(info.id):
            if "still working" in line.text:
                break
        assert len(worker_pids(cluster.home)) >= 2  # torchrun, the exit hooks and the workers
        c.cancel(info.id)
        final = c.wait(info.id, timeout=60)
        assert final.state == JobState.CANCELLED
        assert worker_pids(cluster.home) == []
        assert all(group_members(pid) == [] for pid in worker_pids(cluster.home))
